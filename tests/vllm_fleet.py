"""Engine driver for the fleet tests (KV events, host budget, admission): one real engine.

Run as ``python tests/vllm_fleet.py JOB.json OUT.json``. Unlike ``vllm_support.py`` the
engine core runs in its own process with vLLM's busy loop (``VLLM_ENABLE_V1_MULTIPROCESSING
=1``, what ``vllm serve`` runs), so an idle engine behaves as in production: it steps only
while the connector says work is pending. With ``"events": true`` vLLM publishes KV events
over ZMQ to a SUB socket this driver binds on 127.0.0.1, decoded with vLLM's own
``KVEventBatch``; every event is recorded with the phase it arrived in.

The job's ``steps`` run in order, each one of:
``{"phase": NAME}`` (later events belong to it), ``{"request": {...}}`` (greedy, like
vllm_support; ``bypass``/``salt`` supported; waits for the workers' commits),
``{"wait": {"hashes": [[int...]...], "kind": "BlockStored"|"BlockRemoved", "timeout": S}}``
(until events with each of those block hash lists arrived in this phase, or the timeout),
``{"sleep": S}``, ``{"corrupt": {"tokens": [...], "chunk": I}}`` (flip one byte of that
prompt chunk's object on rank 0), ``{"cli": [ARGS...]}`` (run the ``spoolctl`` CLI;
``{rank0}`` / ``{deployment}`` in an argument name rank 0's store / the deployment
directory; output recorded), ``{"flush": true}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from vllm_support import _rank_state  # runs in each worker: flush, report what it holds
from waiting import wait_until

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
# collective_rpc with a function (the worker-state probe, vllm_support._rank_state) crosses
# into the engine core process; local test processes only.
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class Events:
    """Collects KV event batches published to a SUB socket bound on 127.0.0.1."""

    def __init__(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self._sub.bind_to_random_port("tcp://127.0.0.1")
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._lock = threading.Lock()
        self.phase = "start"
        self.records: list[dict] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                _topic, seq, payload = self._sub.recv_multipart()
            except self._zmq.ZMQError:
                return
            batch = self._decoder.decode(payload)
            with self._lock:
                for ev in batch.events:
                    rec = {"phase": self.phase, "type": type(ev).__name__,
                           "seq": int.from_bytes(seq, "big"),
                           "medium": getattr(ev, "medium", None)}
                    for name in ("block_hashes", "parent_block_hash", "token_ids",
                                 "block_size", "lora_name", "extra_keys", "locality",
                                 "ownership", "group_idx", "kv_cache_spec_kind"):
                        if hasattr(ev, name):
                            value = getattr(ev, name)
                            rec[name] = [_jsonable(v) for v in value] \
                                if isinstance(value, list) else _jsonable(value)
                    self.records.append(rec)

    def set_phase(self, name: str) -> None:
        with self._lock:
            self.phase = name

    def wait(self, hashes: list[list], kind: str, timeout: float) -> bool:
        want = [list(h) for h in hashes]

        def seen() -> bool:
            with self._lock:
                got = [r["block_hashes"] for r in self.records
                       if r["phase"] == self.phase and r["type"] == kind]
            return all(h in got for h in want)

        try:
            wait_until(seen, timeout, what=f"{kind} events", interval=0.1)
        except AssertionError:
            return False
        return True


def _jsonable(value):
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def make_llm(job: dict, events: Events | None):
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    extra = {"spoolctl_root": job["root"], "spoolctl_scrub_rate": "0", **job.get("extra", {})}
    ktc = KVTransferConfig(
        kv_connector="SpoolConnector", kv_connector_module_path="spoolctl.connector",
        kv_role="kv_both", kv_connector_extra_config=extra,
        kv_load_failure_policy="recompute")
    kwargs = {}
    if events is not None:
        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq",
            endpoint=f"tcp://127.0.0.1:{events.port}")
    tp = job.get("tp", 1)
    return LLM(model=job["model"], tokenizer=job["model"], dtype="float32", block_size=32,
               enforce_eager=True, distributed_executor_backend="mp" if tp > 1 else "uni",
               tensor_parallel_size=tp, kv_cache_memory_bytes=64 << 20, max_model_len=2048,
               enable_prefix_caching=job.get("prefix_caching", False),
               max_num_batched_tokens=2048, kv_transfer_config=ktc, seed=0,
               disable_log_stats=not job.get("metrics", False), **kwargs)


def _flush(llm) -> list[dict]:
    states = llm.collective_rpc(_rank_state, args=(60.0,))
    if not all(s["flushed"] for s in states):
        raise RuntimeError("connector stores did not finish within 60 s")
    return states


def _deployment(root: str) -> Path:
    (found,) = [p for p in Path(root).iterdir() if p.is_dir()]  # one deployment per job
    return found


def _corrupt(root: str, tokens: list[int], chunk: int, chunk_tokens: int) -> None:
    from spoolctl.connector.planning.chain import chain_root, chunk_keys
    from spoolctl.store import Store

    deployment = _deployment(root)
    key = chunk_keys(chain_root(deployment.name, None), tokens, chunk_tokens)[chunk]
    with Store.open(deployment / "rank-0000") as store:
        (row,) = [r for r in store.entries(kind="vllm") if r.key == key]
        path = store.layout.object_path(store.manifest(row.entry_id).objects[0].digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    os.chmod(path, 0o600)
    path.write_bytes(bytes(data))


def run(job: dict) -> dict:
    from vllm import SamplingParams

    events = Events() if job.get("events") else None
    llm = make_llm(job, events)
    spoolctl = str(Path(sys.executable).with_name("spoolctl"))
    results, waits, cli = {}, {}, []
    states: list[dict] = []
    for step in job["steps"]:
        if "phase" in step and events is not None:
            events.set_phase(step["phase"])
        elif "request" in step:
            req = step["request"]
            extra = {"kv_transfer_params": {"spoolctl_bypass": True}} \
                if req.get("bypass") else None
            sp = SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 4),
                                ignore_eos=True, extra_args=extra)
            prompt: dict = {"prompt_token_ids": req["tokens"]}
            if req.get("salt") is not None:
                prompt["cache_salt"] = req["salt"]
            out = llm.generate([prompt], sp, use_tqdm=False)[0]
            states = _flush(llm)
            results[req["name"]] = {"tokens": list(out.outputs[0].token_ids),
                                    "num_cached_tokens": int(out.num_cached_tokens or 0)}
        elif "wait" in step:
            w = step["wait"]
            assert events is not None
            waits[w.get("name", str(len(waits)))] = events.wait(
                w["hashes"], w.get("kind", "BlockStored"), w.get("timeout", 20.0))
        elif "sleep" in step:
            time.sleep(step["sleep"])
        elif "corrupt" in step:
            _corrupt(job["root"], step["corrupt"]["tokens"], step["corrupt"]["chunk"],
                     job["extra"]["spoolctl_chunk_tokens"])
        elif "cli" in step:
            deployment = _deployment(job["root"])
            args = [a.replace("{rank0}", str(deployment / "rank-0000"))
                    .replace("{deployment}", str(deployment)) for a in step["cli"]]
            proc = subprocess.run([spoolctl, *args], capture_output=True, text=True,
                                  timeout=120)
            cli.append({"args": step["cli"], "rc": proc.returncode, "stdout": proc.stdout,
                        "stderr": proc.stderr[-2000:]})
        elif "flush" in step:
            states = _flush(llm)
    states = _flush(llm)
    metrics_text = ""
    if job.get("metrics"):
        import prometheus_client

        metrics_text = prometheus_client.generate_latest().decode()
    out = {"results": results, "waits": waits, "cli": cli, "ranks": states,
           "events": events.records if events is not None else [],
           "metrics": [line for line in metrics_text.splitlines() if "spoolctl_" in line]}
    _stop(llm)
    return out


def _stop(llm) -> None:
    """End the engine core process (and its workers): the driver exits with ``os._exit``,
    and a surviving child would hold the test's output pipes open."""
    import multiprocessing

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # still terminate the children below
        print(f"engine shutdown: {exc}", file=sys.stderr)
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(10)
        if child.is_alive():
            child.kill()


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        job = json.load(f)
    result = run(job)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    os._exit(0)
