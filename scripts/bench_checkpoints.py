"""Benchmark mid-prompt checkpoints of caches that cannot be cut back (sliding window,
attention + Mamba): what they cost and what they save.

For one tiny model per family (``spoolctl.demo.tinyfamilies``) and a prompt of instructions
plus one long document (``--tokens`` ids):

* cold ``prepare`` with checkpoints vs without (``plan_rules.MAX_CHECKPOINTS = 0``, the
  in-run reference), interleaved, ``--repeat`` times each, median seconds; the entries
  written and their bytes (the checkpoints' share, and bytes per checkpoint);
* a prompt that stops inside the document (3/4 of it) prepared by a fresh controller on
  each store: restored from the nearest checkpoint vs from the instructions snapshot alone;
  reused and computed ids next to the times (median);
* ``--wide``: the same models widened (hidden 512), where compute outweighs the store I/O.

Cold ``prepare`` times leave out the checkpoints' puts (a background thread writes them;
``close`` waits for them, untimed).

Prints one JSON document. Times are wall clock on whatever host runs it. Usage::

    .venv/bin/python scripts/bench_checkpoints.py [--tokens 1024] [--repeat 3] [--wide]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from spoolctl.controllers import CachePrepareParams
from spoolctl.controllers.local import plan_rules
from spoolctl.controllers.pytorch import PyTorchBackend, PyTorchCacheController
from spoolctl.store import Store

SYSTEM = "You are a helpful assistant. Answer using the reference documents below."
SENTENCE = "Manual: the pump starts when the valve is open and the tank is full. "


def _document(backend: PyTorchBackend, tokens: int) -> str:
    per = max(1, len(backend.tokenize_segments([SENTENCE])[0]))
    return SENTENCE * max(1, tokens // per)


def _store_bytes(root: Path) -> tuple[int, int, int]:
    """(entries, bytes of all entries, bytes of checkpoint entries)."""
    with Store.open(str(root)) as store:
        rows = store.entries(hint="retain")
        total = ckpt = 0
        for row in rows:
            size = sum(o.size for o in store.manifest(row.entry_id).objects)
            total += size
            if isinstance(row.index, dict) and row.index.get("checkpoint"):
                ckpt += size
        return len(rows), total, ckpt


def _cold(backend: PyTorchBackend, root: Path, p: CachePrepareParams, limit: int
          ) -> tuple[float, int]:
    plan_rules.MAX_CHECKPOINTS = limit
    with PyTorchCacheController(backend, root) as ctl:
        t0 = time.perf_counter()
        h = ctl.prepare(p)
        return time.perf_counter() - t0, h.cached_tokens


def _inside(backend: PyTorchBackend, root: Path, p: CachePrepareParams) -> dict[str, Any]:
    with PyTorchCacheController(backend, root) as ctl:
        t0 = time.perf_counter()
        h = ctl.prepare(p)
        took = time.perf_counter() - t0
    return {"s": round(took, 4), "source": h.source, "reused": h.reused_tokens,
            "computed": h.computed_tokens}


WIDE = {"hidden_size": 512, "intermediate_size": 2048}


def bench_family(family: str, tokens: int, repeat: int, work: Path, wide: bool
                 ) -> dict[str, Any]:
    from spoolctl.demo.tinyfamilies import build_family_model

    model = build_family_model(work / family, family, overrides=WIDE if wide else None)
    backend = PyTorchBackend(model, model_id=family)
    doc = _document(backend, tokens)
    p = CachePrepareParams(model=family, instructions=[SYSTEM], data=[doc])
    inside = CachePrepareParams(model=family, instructions=[SYSTEM],
                                data=[doc[: len(doc) * 3 // 4]])
    times: dict[str, list[float]] = {"with": [], "without": []}
    inside_times: dict[str, list[float]] = {"with": [], "without": []}
    limits = {"with": plan_rules.MAX_CHECKPOINTS, "without": 0}
    out: dict[str, Any] = {"family": family, "extends_by_token": backend.extends_by_token}
    for i in range(repeat):
        for arm in ("without", "with") if i % 2 else ("with", "without"):
            root = work / f"{family}-{arm}-{i}"
            took, cached = _cold(backend, root, p, limits[arm])
            times[arm].append(took)
            out["prefix_tokens"] = cached
            if i == 0:
                entries, total, ckpt = _store_bytes(root)
                out[f"{arm}_entries"], out[f"{arm}_bytes"] = entries, total
                if arm == "with":
                    out["checkpoint_bytes"] = ckpt
            seen = _inside(backend, root, inside)
            inside_times[arm].append(seen.pop("s"))
            out[f"inside_{arm}"] = seen
    plan_rules.MAX_CHECKPOINTS = limits["with"]
    out["checkpoints"] = out["with_entries"] - out["without_entries"]
    if out["checkpoints"]:
        out["bytes_per_checkpoint"] = out["checkpoint_bytes"] // out["checkpoints"]
    for arm in ("with", "without"):
        out[f"cold_s_{arm}"] = round(statistics.median(times[arm]), 4)
        out[f"inside_s_{arm}"] = round(statistics.median(inside_times[arm]), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--families", default="sliding,hybrid")
    ap.add_argument("--wide", action="store_true",
                    help=f"widen the tiny models ({WIDE}) so compute weighs more than I/O")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="spoolctl-bench-ckpt-") as tmp:
        results = [bench_family(f, args.tokens, args.repeat, Path(tmp), args.wide)
                   for f in args.families.split(",")]
    print(json.dumps({"bench": "checkpoints", "tokens": args.tokens, "repeat": args.repeat,
                      "wide": args.wide,
                      "max_checkpoints": plan_rules.MAX_CHECKPOINTS,
                      "checkpoint_first": plan_rules.CHECKPOINT_FIRST,
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
