"""Warm catalog rebuild against a raw read of the same manifests, and manifest decoding with
and without the msgspec fast path (decision 2900); prints one JSON document.

    python scripts/bench_rebuild.py [--entries 20000] [--dir /tmp] [--repeat 3]

Builds a store of N small vLLM entries (as ``bench_cli.py`` does), then ``--repeat`` times:
read every manifest file raw (open + fstat + read, the floor), then delete the catalog and
open the store (a rebuild, in process). Both sides warm (the files stay in the page cache:
what is measured is the per-manifest work); ``bench_cli.py`` also has the cold figure (it
drops the page cache, as root). Ratios are the raw time over the rebuild's (goal ≥ 0.5),
from wall time and from this process's CPU time (user + system), which a shared host
disturbs less; best and median. Then ``manifest.decode`` over 5,000 of the files held in
memory, fast path on and off alternately: CPU µs per manifest, best of 5.

The **floor** (decision 2901): each repeat also loads the same manifests, decoded
beforehand, into a new catalog (``Catalog.load``: the rows built and inserted, the indexes
and totals made; no file read, no decoding). A rebuild must do at least that *and* read
the files, so ``ceiling_raw_read_plus_load`` (raw time over raw + load time) is the best
ratio any decoding could reach with this catalog; where it is below the goal, the goal
cannot be met by the decoding alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench_cli import build, raw_manifest_read, rebuild

from spoolctl.store import Store
from spoolctl.store.catalog.index import Catalog
from spoolctl.store.format import manifest, manifest_fast


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def decode_us(root: Path, count: int = 5000, repeat: int = 5) -> dict:
    """CPU µs per ``manifest.decode``, fast path on and off (alternating), best of ``repeat``."""
    files = sorted(root.glob("manifests/*/*.json"))[:count]
    blobs = [(p.read_bytes(), p.name[:-5]) for p in files]
    real, best = manifest_fast.parse, {"fast": float("inf"), "reference": float("inf")}
    try:
        for _ in range(repeat):
            for mode in best:
                manifest_fast.parse = real if mode == "fast" else (lambda data, schema: None)
                t0 = time.process_time()
                for data, entry_id in blobs:
                    manifest.decode(data, expected_entry_id=entry_id)
                best[mode] = min(best[mode], (time.process_time() - t0) / len(blobs) * 1e6)
    finally:
        manifest_fast.parse = real
    return {k: round(v, 1) for k, v in best.items()} | {
        "speedup": round(best["reference"] / best["fast"], 2)}


def decoded(root: Path) -> list:
    """Every manifest of the store decoded, in the batches a rebuild loads (untimed)."""
    with Store.open(root) as store:
        return list(store._recovery._decoded())


def load_seconds(base: Path, batches: list, tag: str) -> tuple[float, float]:
    """(wall, CPU) seconds to load ``batches`` into a new catalog (the rebuild's SQLite part)."""
    path = base / f"floor-{tag}.sqlite3"
    c0, t0 = _cpu(), time.perf_counter()
    catalog = Catalog(path)
    catalog.load(batches)
    took, cpu = time.perf_counter() - t0, _cpu() - c0
    catalog.close()
    return took, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=20_000)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="spoolctl-bench-", dir=os.path.realpath(args.dir)))
    try:
        root = base / "store"
        build(root, args.entries)
        wall, cpu, ceil_wall, ceil_cpu = [], [], [], []
        batches = decoded(root)
        for i in range(args.repeat):
            c0 = _cpu()
            files, raw_s = raw_manifest_read(root)
            c1 = _cpu()
            indexed, rebuild_s = rebuild(root)
            c2 = _cpu()
            assert indexed == files == args.entries, (indexed, files)
            wall.append(raw_s / rebuild_s)
            cpu.append((c1 - c0) / (c2 - c1))
            load_s, load_cpu = load_seconds(base, batches, str(i))
            ceil_wall.append(raw_s / (raw_s + load_s))
            ceil_cpu.append((c1 - c0) / ((c1 - c0) + load_cpu))
        result = {
            "entries": args.entries,
            "rebuild_vs_raw_read_warm_wall": {"best": round(max(wall), 3),
                                              "median": round(statistics.median(wall), 3)},
            "rebuild_vs_raw_read_warm_cpu": {"best": round(max(cpu), 3),
                                             "median": round(statistics.median(cpu), 3)},
            "ceiling_raw_read_plus_load_wall": {"best": round(max(ceil_wall), 3),
                                                "median": round(statistics.median(ceil_wall),
                                                                3)},
            "ceiling_raw_read_plus_load_cpu": {"best": round(max(ceil_cpu), 3),
                                               "median": round(statistics.median(ceil_cpu), 3)},
            "decode_cpu_us_per_manifest": decode_us(root),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count(),
        }
        result["goal_rebuild_ge_0_5x_raw_read_warm"] = \
            result["rebuild_vs_raw_read_warm_wall"]["best"] >= 0.5
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
