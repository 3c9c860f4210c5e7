"""Benchmark near misses of the local controllers against a cold prepare, per cache family.

For every family the controller tests use -- the tiny Llama (full attention) and the tiny
Gemma 3 (sliding window), Jamba (attention + Mamba) and Mamba (state only) of
``spoolctl.demo.tinyfamilies`` -- on PyTorch and, where mlx-lm is installed, on MLX:

* cold: ``prepare`` of the prompt on an empty store (prefill, instructions snapshot where
  the cache cannot be cut back, verified commit);
* message: a stored prompt (instructions + the first documents), then a NEW controller
  (nothing in memory: the base comes from disk) prepares it with one more document;
* mid-message: the same stored prompt, then a prompt whose last document changes in its
  second half (the base: the instructions snapshot, or a cut-back entry where the cache
  allows it).

Repeats are interleaved (cold, message, mid-message, cold, ...) on fresh stores. Reported:
the median wall time, the fastest wall time and the median process CPU time (the last two
are less disturbed by other jobs on a shared host; torch runs one thread unless
``--threads``), each near miss's ratios to cold, and next to each time the handle's path and
token counts (reused from memory / disk, computed, written) and whether 4 greedy tokens
equal a run of the whole prompt without a cache. The goal: every
near-miss / cold ratio <= 1.0. Usage::

    .venv/bin/python scripts/bench_controllers_nearmiss.py [--tokens 512] [--repeat 3]
        [--frameworks pytorch,mlx] [--families full,sliding,hybrid,ssm] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FAMILIES = ("full", "sliding", "hybrid", "ssm")
QUESTION = "Question: what does the log say?"
WORDS = ("pump", "valve", "tank", "level", "alarm", "ticket", "engineer", "seal", "pressure",
         "flow", "sensor", "log", "check", "open", "close", "start", "stop", "report")


def model_dir(work: Path, family: str) -> Path:
    if family == "full":
        from spoolctl.demo.tinymodel import build_tiny_model

        return build_tiny_model(work / "models" / "tiny", "tiny")
    from spoolctl.demo.tinyfamilies import build_family_model

    return build_family_model(work / "models" / family, family)


def make_backend(framework: str, path: Path, family: str) -> tuple[Any, Any]:
    """(backend, controller class) of ``framework`` on the model at ``path``."""
    if framework == "pytorch":
        from spoolctl.controllers.pytorch import PyTorchBackend, PyTorchCacheController

        return PyTorchBackend(path, model_id=family), PyTorchCacheController
    from spoolctl.controllers.mlx import MlxBackend, MlxCacheController

    return MlxBackend(path, model_id=family), MlxCacheController


def documents(backend: Any, tokens: int, count: int) -> list[str]:
    """``count`` documents of about ``tokens / count`` tokens each (seeded words)."""
    rng = random.Random(1)
    per = max(8, tokens // count)
    out = []
    for _ in range(count):
        words = per
        text = " ".join(rng.choice(WORDS) for _ in range(words)) + "."
        n = len(backend.tokenize_segments([text])[0])
        words = max(4, int(words * per / max(n, 1)))
        out.append(" ".join(rng.choice(WORDS) for _ in range(words)) + ".")
    return out


def prompts(backend: Any, tokens: int) -> dict[str, tuple[Any, Any]]:
    """Per near-miss kind: (stored params, prompt params)."""
    from spoolctl.controllers import CachePrepareParams

    docs = documents(backend, tokens, 8)
    system = ["You are a maintenance assistant. Answer from the logs below."]

    def p(data: list[str]) -> Any:
        return CachePrepareParams(instructions=system, data=data)

    last = docs[6]
    changed = last[: len(last) // 2] + " " + " ".join(reversed(last[len(last) // 2:].split()))
    return {"message": (p(docs[:7]), p(docs[:8])),
            "mid-message": (p(docs[:7]), p([*docs[:6], changed]))}


def counts(ctl: Any, backend: Any, handle: Any, check: bool) -> dict[str, Any]:
    """The handle's path and token counts, the usage split of its first generate, and
    (``check``) whether its 4 greedy tokens equal a run of the whole prompt without a cache."""
    out = ctl.generate(handle, QUESTION, 4)
    u = out.usage
    row = {"source": handle.source, "cached": handle.cached_tokens,
           "reused": handle.reused_tokens, "computed": handle.computed_tokens,
           "from_memory": u.cache_memory_tokens, "from_disk": u.cache_disk_tokens,
           "written": u.cache_write_tokens}
    if check:
        ids = ctl.prompt_tokens(handle, QUESTION)
        row["tokens_equal_cold"] = list(out.tokens) == list(backend.generate(None, 0, ids, 4))
    return row


def timed_prepare(controller: Any, backend: Any, store: Path, params: Any,
                  check: bool = False) -> tuple[tuple[float, float], dict]:
    """((wall s, process CPU s), counts) of one ``prepare`` in a new controller."""
    with controller(backend, store) as ctl:
        start, cpu = time.perf_counter(), time.process_time()
        handle = ctl.prepare(params)
        seconds = (time.perf_counter() - start, time.process_time() - cpu)
        return seconds, counts(ctl, backend, handle, check)


def medians(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def fastest(pairs: list[tuple[float, float]]) -> float:
    """The fastest wall time: other jobs only ever add to a run's time."""
    return min(p[0] for p in pairs)


def one_family(framework: str, family: str, work: Path, tokens: int, repeat: int) -> dict:
    backend, controller = make_backend(framework, model_dir(work, family), family)
    cases = prompts(backend, tokens)
    times: dict[str, list[tuple[float, float]]] = {"cold": [], **{k: [] for k in cases}}
    seen: dict[str, dict] = {}
    # Untimed: the first forwards of a process pay one-off setup (allocator, kernels).
    timed_prepare(controller, backend, Path(tempfile.mkdtemp(dir=work)), cases["message"][0])
    for r in range(repeat):
        last = r == repeat - 1
        for kind in ("cold", *cases):
            store = Path(tempfile.mkdtemp(dir=work, prefix=f"{framework}-{family}-{kind}-{r}-"))
            if kind != "cold":
                with controller(backend, store) as ctl:  # the stored prefix
                    ctl.prepare(cases[kind][0])
            target = cases["message" if kind == "cold" else kind][1]
            s, c = timed_prepare(controller, backend, store, target, check=last)
            times[kind].append(s)
            seen[kind] = c
    cold_s, cold_cpu = medians(times["cold"])
    cold_min = fastest(times["cold"])
    row: dict[str, Any] = {"cold": {"s": round(cold_s, 4), "min_s": round(cold_min, 4),
                                    "cpu_s": round(cold_cpu, 4), **seen["cold"]}}
    for kind in cases:
        s, cpu = medians(times[kind])
        row[kind] = {"s": round(s, 4), "min_s": round(fastest(times[kind]), 4),
                     "cpu_s": round(cpu, 4), "ratio_to_cold": round(s / cold_s, 3),
                     "min_ratio_to_cold": round(fastest(times[kind]) / cold_min, 3),
                     "cpu_ratio_to_cold": round(cpu / cold_cpu, 3), **seen[kind]}
    if hasattr(backend, "extends_by_token"):
        row["extends_by_token"] = bool(backend.extends_by_token)
    return row


def mlx_usable() -> str | None:
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mlx-lm is not installed here ({exc})"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512, help="prefix tokens (about)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--frameworks", default="pytorch,mlx")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared host more add noise)")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: tmp)")
    args = ap.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    import torch

    torch.set_num_threads(args.threads)
    if unknown := set(families) - set(FAMILIES):
        ap.error(f"unknown families {sorted(unknown)}; use some of {','.join(FAMILIES)}")
    report: dict[str, Any] = {"tokens": args.tokens, "repeat": args.repeat,
                              "torch_threads": args.threads,
                              "goal": "near-miss / cold <= 1.0 for every family",
                              "host": "shared, loaded (medians of interleaved repeats)"}
    with tempfile.TemporaryDirectory(prefix="spoolctl-nearmiss-") as tmp:
        work = args.work or Path(tmp)
        for framework in [f for f in args.frameworks.split(",") if f]:
            if framework == "mlx" and (why := mlx_usable()) is not None:
                report["mlx"] = {"skipped": why}
                continue
            report[framework] = {f: one_family(framework, f, work, args.tokens, args.repeat)
                                 for f in families}
            print(json.dumps({framework: report[framework]}), file=sys.stderr, flush=True)
    rows = [r[k] for fw in ("pytorch", "mlx") for r in report.get(fw, {}).values()
            if isinstance(r, dict) for k in ("message", "mid-message") if k in r]
    for name in ("ratio_to_cold", "min_ratio_to_cold", "cpu_ratio_to_cold"):
        report[f"max_{name}"] = max((r[name] for r in rows), default=None)
    report["all_tokens_equal"] = all(r["tokens_equal_cold"] for r in rows)
    print(json.dumps(report, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
