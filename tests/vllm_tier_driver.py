"""Engine driver for the SpoolTier tests: one real vLLM engine per process.

Run as ``python tests/vllm_tier_driver.py JOB.json OUT.json``. The engine is vLLM's
``OffloadingConnector`` with its CPU tier and ``SpoolTier`` behind it; only the device <->
CPU-tier copy is replaced (``MemmoveTieringSpec`` from ``scripts/bench_vllm.py``: vLLM's own
CPU worker refuses the CPU backend). Requests (``tokens``, optional ``salt``: the cache salt)
run one at a time (greedy); after one with ``entries``, the engine is stepped with tiny
requests until the tier's store holds that many entries (or ``settle_s`` passed). OUT.json
holds each request's tokens, ``num_cached_tokens``, the tier's counters and the metrics it
reported to vLLM (``metrics``: what vLLM took from its ``get_stats``, summed). Two runs in a row
are an engine restart.

A request may first set the FUSE mount under the root (``job["control"]``, the control file
of ``tests/fusemount.py``): ``"disk": "hang"`` (every operation on it blocks) or
``"disk": "answer"`` (it answers again; the driver then waits until the tier's lookups do).
While it hangs the driver never touches the store itself. ``tp`` > 1 runs that many workers.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
# bench_vllm (the test-side copy) must import in worker processes too
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(SCRIPTS), os.environ.get("PYTHONPATH", "")) if p)


def make_llm(job: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    sys.path.insert(0, str(SCRIPTS))  # bench_vllm: the test-side device <-> CPU copy
    tier = {"type": "SpoolTier", "module_path": "spoolctl.connector.tier",
            "root": job["root"], **job.get("tier", {})}
    ktc = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "MemmoveTieringSpec", "spec_module_path": "bench_vllm",
            "cpu_bytes_to_use": job.get("cpu_bytes", 8 << 20),
            "secondary_tiers": [tier]})
    tp = job.get("tp", 1)
    return LLM(model=job["model"], tokenizer=job["model"], dtype="float32",
               block_size=job.get("block_size", 32), enforce_eager=True,
               distributed_executor_backend="mp" if tp > 1 else "uni",
               tensor_parallel_size=tp, kv_cache_memory_bytes=32 << 20,
               max_model_len=1024, enable_prefix_caching=True, kv_transfer_config=ktc,
               seed=0, **job.get("llm_kwargs", {}))


def the_tier(llm):
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector.connector_scheduler.manager.secondary_tiers[0]


def entries(tier) -> int:
    return len(tier.store.live_keys("vllm", tier.namespace))


def settle(llm, tier, want: int, seconds: float) -> None:
    """Step the engine with tiny requests until the tier's store holds ``want`` entries."""
    from vllm import SamplingParams

    until = time.monotonic() + seconds
    nudge = SamplingParams(temperature=0.0, max_tokens=1)
    while entries(tier) < want and time.monotonic() < until:
        llm.generate([{"prompt_token_ids": [7, 8, 9]}], nudge, use_tqdm=False)
        time.sleep(0.05)


def disk(job: dict, tier, state: str) -> bool:
    """Set the FUSE mount under the root hung or answering; True while it hangs."""
    path = job["control"]
    Path(path + ".new").write_text("hang /\n" if state == "hang" else "")
    os.replace(path + ".new", path)  # the FUSE daemon never reads half a file
    if state == "hang":
        return True
    until = time.monotonic() + 120
    while tier.lookup_guard.stuck and time.monotonic() < until:
        time.sleep(0.05)  # the lookup stuck on the disk returns, then lookups resume
    return False


def serve(llm, tier, job: dict, out: dict) -> None:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 8))
    hung = False
    for request in job["requests"]:
        if "disk" in request:
            hung = disk(job, tier, request["disk"])
        prompt = {"prompt_token_ids": request["tokens"]}
        if "salt" in request:
            prompt["cache_salt"] = request["salt"]
        res = llm.generate([prompt], sp, use_tqdm=False)[0]
        if "entries" in request:  # the store entries expected once this request is stored
            settle(llm, tier, request["entries"], job.get("settle_s", 60.0))
        out["requests"].append({"tokens": list(res.outputs[0].token_ids),
                                "cached": int(res.num_cached_tokens or 0),
                                "entries": None if hung else entries(tier)})


def record_stats(tier, into: dict) -> None:
    """Sum into ``into`` what vLLM's scheduler takes from the tier's ``get_stats`` (it polls
    every step; offline, without stat loggers, it drops them after)."""
    take = tier.get_stats

    def get_stats():
        stats = take()
        for name, value in ({} if stats is None else stats.reduce()).items():
            into[name] = into.get(name, 0) + value
        return stats

    tier.get_stats = get_stats


def run(job: dict) -> dict:
    llm = make_llm(job)
    tier = the_tier(llm)
    out: dict = {"requests": [], "namespace": tier.namespace, "metrics": {}}
    record_stats(tier, out["metrics"])
    try:
        serve(llm, tier, job, out)
    finally:
        if "control" in job:
            disk(job, tier, "answer")  # nothing this process leaves may stay hung
    out["counters"] = tier.counters.snapshot()
    tier.get_stats()  # what vLLM has not taken yet
    llm.llm_engine.engine_core.shutdown()
    return out


if __name__ == "__main__":
    job_path, out_path = sys.argv[1], sys.argv[2]
    result = run(json.loads(Path(job_path).read_text()))
    Path(out_path).write_text(json.dumps(result))
