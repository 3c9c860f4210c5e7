"""Benchmark: spoolctl's ``SpoolTier`` against vLLM's ``fs`` tier, each the secondary tier
under the same ``OffloadingConnector`` CPU tier (same ``cpu_bytes_to_use``), same model, same
prompts, in one run. Prints one JSON document.

    .venv/bin/python scripts/bench_vllm_tier.py [--sizes 1024,4096,8192] [--repeat 3]

Per repeat and tier (the tiers' order alternates between repeats), two engine processes on a
fresh tier root:

    store    warm-up, then a stream of distinct prompts (``--stream`` fillers, then one prompt
             per size), the engine stepped until every full block of the stream is stored by
             the tier: ``store_bytes_per_s`` is the KV bytes the tier stored over that window
             (first request to last block stored); disk bytes (du of the root) after it
    restore  a restart on the same root: per size, the page cache dropped (as root) and the
             prompt measured (``cold``), then the CPU tier reset (``reset_prefix_cache(
             reset_connector=True)``: the secondary tier keeps its data) and measured again
             with the data in the page cache (``warm``)

Every TTFT is printed next to the tokens it restored (``num_cached_tokens``: after a
restart the device cache and the CPU tier are empty, so these come from the secondary tier).
A ratio between the tiers is computed only where both restored the same number of tokens;
otherwise it is refused and ``ratio_refused`` says why. SpoolTier is given ``max_size``
(default: a bound below the workload, so the store evicts and du shows it bounded); the fs
tier has no bound. vLLM's CPU offloading refuses CPU; ``MemmoveTieringSpec`` from
``bench_vllm.py`` replaces only the device <-> CPU-tier copy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

from bench_vllm import WARMUP_LENGTHS, _block_files, _tree_bytes
from benchutil import drop_page_cache, equal_work_ratio, spawn_phase

HERE = Path(__file__).resolve()
TIERS = ("spool", "fs")


# -- one engine process -----------------------------------------------------------------------


def _tier_entry(job: dict) -> dict:
    if job["tier"] == "spool":
        entry = {"type": "SpoolTier", "module_path": "spoolctl.connector.tier",
                 "root": job["root"], "max_size": job["max_size"],
                 "read_threads": job["threads"], "write_threads": job["threads"]}
    else:
        entry = {"type": "fs", "root_dir": job["root"],
                 "n_read_threads": job["threads"], "n_write_threads": job["threads"]}
    return entry


def _make_llm(job: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    sys.path.insert(0, str(HERE.parent))  # bench_vllm: MemmoveTieringSpec
    ktc = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "MemmoveTieringSpec", "spec_module_path": "bench_vllm",
            "cpu_bytes_to_use": job["cpu_bytes"], "secondary_tiers": [_tier_entry(job)]})
    return LLM(model=job["model"], tokenizer=job["model"], dtype="float32",
               block_size=job["block_size"], enforce_eager=True,
               distributed_executor_backend="uni", kv_cache_memory_bytes=job["kv_bytes"],
               max_model_len=job["max_model_len"], max_num_batched_tokens=2048,
               enable_prefix_caching=True, kv_transfer_config=ktc, seed=0)


class Engine:
    """One engine and its secondary tier; counts what the tier has stored."""

    def __init__(self, job: dict) -> None:
        from vllm import SamplingParams

        self.job = job
        self.llm = _make_llm(job)
        core = self.llm.llm_engine.engine_core.engine_core
        self.tier = core.scheduler.connector.connector_scheduler.manager.secondary_tiers[0]
        self.sp = SamplingParams(temperature=0.0, max_tokens=1)
        self.rng = random.Random(f"warmup-{job['phase']}-{job['repeat']}")

    def stored_blocks(self) -> int:
        """Blocks the tier has written (SpoolTier: its counter, evicted ones included)."""
        if self.job["tier"] == "spool":
            return int(self.tier.counters.snapshot()["store_chunks"])
        return _block_files(Path(self.job["root"]))

    def given_up_blocks(self) -> int:
        """Blocks SpoolTier refused (queue full, store full): they never land."""
        if self.job["tier"] != "spool":
            return 0
        c = self.tier.counters.snapshot()
        return int(c["stores_dropped"] + c["store_failures"])

    def generate(self, tokens: list[int]):
        return self.llm.generate([{"prompt_token_ids": tokens}], self.sp, use_tqdm=False)[0]

    def settle(self, want: int, timeout: float = 300.0) -> int:
        """Step the engine with tiny requests (the scheduler creates a finished request's
        last store jobs only on a later step) until ``want`` blocks are stored or given up."""
        until = time.monotonic() + timeout
        while self.stored_blocks() + self.given_up_blocks() < want and \
                time.monotonic() < until:
            self.generate([self.rng.randrange(3, 500) for _ in range(8)])
            time.sleep(0.02)
        return self.stored_blocks()

    def warm_up(self) -> None:
        """Random prompts (never stored by another phase), stored before measuring."""
        before = self.stored_blocks()
        for n in WARMUP_LENGTHS:
            self.generate([self.rng.randrange(3, 500) for _ in range(n)])
        self.settle(before + sum(n // self.job["block_size"] for n in WARMUP_LENGTHS))


def _blocks(tokens: list[int], block: int) -> int:
    return len(tokens) // block


def store_phase(eng: Engine, job: dict) -> dict:
    block, root = job["block_size"], Path(job["root"])
    stream = job["fillers"] + list(job["prompts"].values())  # measured prompts last (LRU)
    before, given_up = eng.stored_blocks(), eng.given_up_blocks()
    want = before + sum(_blocks(t, block) for t in stream)
    serve = 0.0
    t0 = time.perf_counter()
    for tokens in stream:
        t1 = time.perf_counter()
        eng.generate(tokens)
        serve += time.perf_counter() - t1
    stored = eng.settle(want)
    window = time.perf_counter() - t0
    nbytes = (stored - before) * job["block_bytes"]
    return {"stream_tokens": sum(len(t) for t in stream), "serve_s": round(serve, 3),
            "window_s": round(window, 3), "stored_blocks": stored - before,
            "wanted_blocks": want - before,
            "given_up_blocks": eng.given_up_blocks() - given_up,
            "stored_bytes": nbytes, "store_bytes_per_s": round(nbytes / window),
            "disk_bytes_after": _tree_bytes(root)[1]}


def _measure(eng: Engine, tokens: list[int]) -> dict:
    before = eng.tier.counters.snapshot()["load_chunks"] if eng.job["tier"] == "spool" else 0
    t0 = time.perf_counter()
    res = eng.generate(tokens)
    out = {"ttft_s": round(time.perf_counter() - t0, 4),
           "hit_tokens": int(res.num_cached_tokens or 0), "token": res.outputs[0].token_ids[0]}
    if eng.job["tier"] == "spool":
        out["tier_chunks_read"] = eng.tier.counters.snapshot()["load_chunks"] - before
    return out


def restore_phase(eng: Engine, job: dict) -> dict:
    out: dict = {"cold": {}, "warm": {}, "page_cache_dropped": True}
    for size, tokens in job["prompts"].items():
        out["page_cache_dropped"] &= drop_page_cache()
        out["cold"][size] = _measure(eng, tokens)
        eng.llm.reset_prefix_cache(reset_connector=True)  # the CPU tier, not the disk tier
        out["warm"][size] = _measure(eng, tokens)
        eng.llm.reset_prefix_cache(reset_connector=True)
    return out


def run_phase(job: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    eng = Engine(job)
    eng.warm_up()
    result = store_phase(eng, job) if job["phase"] == "store" else restore_phase(eng, job)
    if job["tier"] == "spool":
        result["tier_counters"] = eng.tier.counters.snapshot()
    eng.llm.llm_engine.engine_core.shutdown()
    return result


# -- orchestration ----------------------------------------------------------------------------


def _spawn(job: dict, workdir: Path) -> dict:
    return spawn_phase(HERE, job, workdir, f"{job['tier']}-{job['phase']}-{job['repeat']}")


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def _restore_row(runs: dict[str, list[dict]], kind: str, size: str) -> dict:
    """One size, cold or warm: each tier's median TTFT with every TTFT and hit count, and
    the ratio only where every repeat restored the same tokens on both sides."""
    row: dict = {}
    for tier in TIERS:
        ms = [r[kind][size] for r in runs[tier]]
        row[tier] = {"ttft_s": _median([m["ttft_s"] for m in ms]),
                     "ttft_all_s": [m["ttft_s"] for m in ms],
                     "hit_tokens_all": [m["hit_tokens"] for m in ms],
                     "first_tokens": [m["token"] for m in ms]}
        if tier == "spool":
            row[tier]["tier_chunks_read_all"] = [m["tier_chunks_read"] for m in ms]
    ratio, refused = equal_work_ratio(row["spool"]["ttft_s"], row["spool"]["hit_tokens_all"],
                                      row["fs"]["ttft_s"], row["fs"]["hit_tokens_all"])
    row["spool_over_fs"] = ratio
    if refused:
        row["ratio_refused"] = refused
    row["same_first_token"] = row["spool"]["first_tokens"] == row["fs"]["first_tokens"]
    return row


def _store_summary(stores: dict[str, list[dict]], max_size: int) -> dict:
    out: dict = {}
    for tier in TIERS:
        runs = stores[tier]
        out[tier] = {"store_bytes_per_s": _median([r["store_bytes_per_s"] for r in runs]),
                     "store_bytes_per_s_all": [r["store_bytes_per_s"] for r in runs],
                     "window_s_all": [r["window_s"] for r in runs],
                     "serve_s_all": [r["serve_s"] for r in runs],
                     "stored_blocks_all": [r["stored_blocks"] for r in runs],
                     "wanted_blocks": runs[0]["wanted_blocks"],
                     "given_up_blocks_all": [r["given_up_blocks"] for r in runs],
                     "disk_bytes_after_all": [r["disk_bytes_after"] for r in runs]}
    out["spool"]["max_size"] = max_size
    ratio, refused = equal_work_ratio(
        out["spool"]["store_bytes_per_s"], out["spool"]["stored_blocks_all"],
        out["fs"]["store_bytes_per_s"], out["fs"]["stored_blocks_all"])
    out["spool_over_fs"] = ratio
    if refused:
        out["ratio_refused"] = refused
    return out


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1024,4096,8192")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved repeats (medians)")
    ap.add_argument("--stream", default="4096,4096",
                    help="filler prompt lengths served before the measured ones")
    ap.add_argument("--preset", default="small", help="spoolctl.demo.tinymodel preset")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--cpu-bytes", type=int, default=64 << 20,
                    help="cpu_bytes_to_use of the CPU tier, the same for both tiers")
    ap.add_argument("--max-size", type=int, default=None,
                    help="SpoolTier max_size in bytes (default: the measured prompts, the "
                         "warm-ups and half the fillers)")
    ap.add_argument("--threads", type=int, default=4,
                    help="read threads and write threads of each tier (the same for both)")
    ap.add_argument("--workdir", default=None, help="scratch dir on the disk under test")
    ap.add_argument("--phase-job", help=argparse.SUPPRESS)
    ap.add_argument("--phase-out", help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    args = _parse()
    if args.phase_job:
        result = run_phase(json.loads(Path(args.phase_job).read_text()))
        Path(args.phase_out).write_text(json.dumps(result))
        os._exit(0)
    from spoolctl.demo.tinymodel import PRESETS, build_tiny_model

    spec = PRESETS[args.preset]
    # K and V, float32, every layer: the bytes of one token's KV.
    token_bytes = 2 * 4 * spec.num_hidden_layers * spec.num_key_value_heads * spec.head_dim
    block_bytes = token_bytes * args.block_size
    sizes = [int(s) for s in args.sizes.split(",")]
    fillers_len = [int(s) for s in args.stream.split(",") if s]
    workdir = Path(os.path.realpath(args.workdir or f"/var/tmp/spoolctl-tier-{os.getpid()}"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(workdir / f"model-{args.preset}", args.preset)
    max_size = args.max_size or token_bytes * (
        sum(sizes) + sum(WARMUP_LENGTHS) * 2 + sum(fillers_len) // 2)
    rng = random.Random(1234)
    stores: dict[str, list[dict]] = {t: [] for t in TIERS}
    restores: dict[str, list[dict]] = {t: [] for t in TIERS}
    load_start = os.getloadavg()[0]
    for rep in range(args.repeat):
        prompts = {str(n): [rng.randrange(3, 500) for _ in range(n)] for n in sizes}
        fillers = [[rng.randrange(3, 500) for _ in range(n)] for n in fillers_len]
        for tier in (TIERS if rep % 2 == 0 else TIERS[::-1]):
            root = workdir / f"root-{tier}"
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            base = {"tier": tier, "repeat": rep, "root": str(root), "model": str(model),
                    "prompts": prompts, "fillers": fillers, "block_size": args.block_size,
                    "block_bytes": block_bytes, "cpu_bytes": args.cpu_bytes,
                    "max_size": max_size, "threads": args.threads,
                    "kv_bytes": max(256 << 20, 3 * max(sizes) * token_bytes),
                    "max_model_len": max(sizes + fillers_len + list(WARMUP_LENGTHS)) + 64}
            stores[tier].append(_spawn({**base, "phase": "store"}, workdir))
            drop_page_cache()
            restores[tier].append(_spawn({**base, "phase": "restore"}, workdir))
            cold = restores[tier][-1]["cold"]
            print(f"# {rep} {tier}: " + ", ".join(
                f"{k}={v['ttft_s']:.3f}s hit {v['hit_tokens']}" for k, v in cold.items())
                + f"; store {stores[tier][-1]['store_bytes_per_s'] / 2**20:.1f} MiB/s",
                file=sys.stderr)
    report = {"model": args.preset, "block_size": args.block_size,
              "kv_bytes_per_block": block_bytes, "cpu_bytes_to_use": args.cpu_bytes,
              "repeat": args.repeat, "stream_fillers": fillers_len, "threads": args.threads,
              "load_avg": {"start": load_start, "end": os.getloadavg()[0]},
              "page_cache_dropped_before_cold": all(
                  r["page_cache_dropped"] for rs in restores.values() for r in rs),
              "restore_cold": {str(n): _restore_row(restores, "cold", str(n)) for n in sizes},
              "restore_warm": {str(n): _restore_row(restores, "warm", str(n)) for n in sizes},
              "store": _store_summary(stores, max_size),
              "spool_tier_counters": [r["tier_counters"] for r in restores["spool"]]}
    report["goals"] = _goals(report)
    print(json.dumps(report, indent=2))


def _goals(report: dict) -> dict:
    """None where the ratio was refused (unequal work)."""
    goals: dict = {}
    for kind in ("restore_cold", "restore_warm"):
        for size, row in report[kind].items():
            r = row["spool_over_fs"]
            goals[f"{kind}_{size}_le_1.0x_fs"] = None if r is None else r <= 1.0
    r = report["store"]["spool_over_fs"]
    goals["store_throughput_ge_0.9x_fs"] = None if r is None else r >= 0.9
    return goals


if __name__ == "__main__":
    main()
