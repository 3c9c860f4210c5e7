"""Benchmark the import check of the local controllers (decision 2102).

``import_cache`` recomputes an offered cache from its tokens before anything is written.
The default check (``full``) prefills the tokens again and compares every layer's K/V at
every position; ``check="sample"`` recomputes four positions. This prints, per framework
and prompt length, the time of each check next to a bare prefill of the same tokens (what
``prepare`` would have paid to compute the cache itself), median of ``--repeat`` runs, on
the locally generated model (``--preset``, default "small": 4 layers, hidden 512).

Prints one JSON document. Usage::

    .venv/bin/python scripts/bench_import_check.py [--tokens 1024 4096] [--repeat 3]
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


def timed(fn, repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return round(statistics.median(runs), 4)


def measure(framework: str, backend, n: int, repeat: int) -> dict:
    rng = random.Random(n)
    tokens = [rng.randrange(3, 500) for _ in range(n)]
    cache = backend.prefill(backend.new_cache(), tokens)
    return {
        "framework": framework, "tokens": n,
        "prefill_s": timed(lambda: backend.prefill(backend.new_cache(), tokens), repeat),
        "check_full_s": timed(lambda: backend.check_import(cache, tokens, full=True), repeat),
        "check_sample_s": timed(lambda: backend.check_import(cache, tokens, full=False),
                                repeat),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--frameworks", nargs="+", default=["pytorch", "mlx"])
    args = ap.parse_args()
    from spoolctl.demo.tinymodel import build_tiny_model

    model = build_tiny_model(Path(tempfile.gettempdir()) / f"spoolctl-bench-{args.preset}",
                             args.preset)
    rows = []
    for framework in args.frameworks:
        if framework == "pytorch":
            from spoolctl.controllers.pytorch import PyTorchBackend

            backend = PyTorchBackend(model)
        else:
            try:
                from spoolctl.controllers.mlx import MlxBackend
            except ImportError as exc:  # pragma: no cover
                print(f"skipping mlx: {exc}", file=sys.stderr)
                continue
            backend = MlxBackend(model)
        rows.extend(measure(framework, backend, n, args.repeat) for n in args.tokens)
    print(json.dumps({"preset": args.preset, "repeat": args.repeat, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
