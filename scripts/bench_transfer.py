#!/usr/bin/env python3
"""Export/import throughput next to ``tar`` of the same files, measured in the same run.

Builds a store of vLLM-chunk-sized entries (default 2 MiB each, 512 MiB in all), then
times, alternating and repeated:

* export: ``spoolctl export --root S -o A.tar`` (reads, verifies every byte, writes the
  archive) vs ``tar -cf R.tar -C S objects manifests`` (reads and writes the same files);
* import: ``spoolctl import --root T A.tar`` (reads, verifies, writes, fsyncs, commits) vs
  ``tar -xf R.tar -C T2`` (writes the same files, no fsync) and the same followed by
  ``sync -f`` (durable, the fair reference for a commit).

Reads are warm (page cache) for both sides unless ``--cold`` (root only: caches dropped
before each run, then the interpreter, spoolctl's modules and tar loaded again, so that only
the data is cold). Ratios are tar's time over spoolctl's (1.0 = as fast as tar), from the best
of the repeats (least disturbed by other work on a shared machine) and from the medians.
The reference's member count and bytes are printed and a ratio is refused if tar did less
work than spoolctl. Each repeat also times ``startup``: a process that only starts the
interpreter and imports the CLI and the transfer modules (what every ``spoolctl`` command
pays before its first byte; tar's start is a millisecond). From it the JSON shows the data
path alone (``ratio_less_startup``: tar's time over spoolctl's minus start-up) and the
**ceiling** this start-up leaves (``ceiling_with_startup``: tar's time over tar's plus
start-up, what spoolctl would reach with a data path exactly as fast as tar's); where that
ceiling is below a goal, no change to the data path can meet it (decision 2901). Prints
one JSON document.

    python scripts/bench_transfer.py [--dir /path/on/nvme] [--mib 512] [--entry-mib 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchutil import drop_page_cache

from spoolctl.store import Store

MiB = 1 << 20
SPOOLCTL = [sys.executable, "-c", "from spoolctl.cli.app import main; main()"]


def build(root: Path, total: int, entry: int) -> tuple[int, int]:
    """A store of ``total // entry`` entries of one ``entry``-byte object each."""
    n = max(1, total // entry)
    chunk = os.urandom(entry)
    with Store.open(root, create=True) as store:
        for i in range(n):
            # distinct bytes per entry (no dedup) without paying for urandom each time
            data = i.to_bytes(8, "little") + chunk[8:]
            store.put(kind="vllm", namespace="bench", key=f"chunk-{i}", objects={"kv": data})
        totals = store.totals()
    return totals.entries, totals.bytes


# Loaded after a cache drop so that "cold" means cold *data*: the interpreter and the
# package (like the tar binary) are what a host that runs spoolctl has in memory.
WARM_CODE = [sys.executable, "-c", "import spoolctl.cli.app, spoolctl.store.transfer.exporter, "
             "spoolctl.store.transfer.importer, spoolctl.store.transfer.ingest"]
# The start-up every spoolctl command pays: the same interpreter and imports, no work.
STARTUP = WARM_CODE


def timed(cmd: list[str], cold: bool) -> float:
    if cold:
        drop_page_cache()
        subprocess.run(WARM_CODE, check=True)
        subprocess.run(["tar", "--version"], check=True, stdout=subprocess.DEVNULL)
    else:
        os.sync()  # no dirty pages of the previous run in this one's time
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - t


def tar_members(path: Path) -> tuple[int, int]:
    with tarfile.open(path) as tf:
        members = [m for m in tf.getmembers() if m.isfile()]
    return len(members), sum(m.size for m in members)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--mib", type=int, default=512, help="store size in MiB")
    ap.add_argument("--entry-mib", type=float, default=2.0, help="entry (object) size in MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="drop caches before each run (root)")
    args = ap.parse_args()
    if shutil.which("tar") is None:
        sys.exit("tar not found: the reference needs it")
    if args.dir:  # the disk to measure: made if missing, like --work elsewhere
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    base = Path(os.path.realpath(tempfile.mkdtemp(prefix="bench-transfer-", dir=args.dir)))
    try:
        src = base / "src"
        entries, store_bytes = build(src, args.mib * MiB, int(args.entry_mib * MiB))
        runs: dict[str, list[float]] = {k: [] for k in (
            "export", "tar_create", "import", "tar_extract", "tar_extract_sync", "startup")}
        archive, ref = base / "a.tar", base / "r.tar"
        for i in range(args.repeat):
            for p in (archive, ref):
                p.unlink(missing_ok=True)
            runs["export"].append(timed([*SPOOLCTL, "export", "--root", str(src), "-o",
                                         str(archive), "--no-progress"], args.cold))
            runs["startup"].append(timed(STARTUP, args.cold))
            runs["tar_create"].append(timed(["tar", "-cf", str(ref), "-C", str(src), "objects",
                                             "manifests"], args.cold))
            dst, dst_ref, dst_sync = base / f"dst-{i}", base / f"ref-{i}", base / f"sync-{i}"
            dst_ref.mkdir()
            dst_sync.mkdir()
            runs["import"].append(timed([*SPOOLCTL, "import", "--root", str(dst), str(archive),
                                         "--no-progress"], args.cold))
            runs["tar_extract"].append(timed(["tar", "-xf", str(ref), "-C", str(dst_ref)],
                                             args.cold))
            runs["tar_extract_sync"].append(timed(
                ["sh", "-c", f"tar -xf '{ref}' -C '{dst_sync}' && sync -f '{dst_sync}'"],
                args.cold))
            with Store.open(dst) as store:
                imported = store.totals()
            if imported.entries != entries:
                sys.exit(f"import holds {imported.entries} entries, expected {entries}")
            for d in (dst, dst_ref, dst_sync):
                shutil.rmtree(d)
        ours_members, ours_bytes = tar_members(archive)
        ref_members, ref_bytes = tar_members(ref)
        # spoolctl's archive adds its index and end record; tar must have moved at least the
        # same objects and manifests, else the ratio would flatter spoolctl.
        if ref_members < ours_members - 2 or ref_bytes < ours_bytes - 2 * MiB:
            sys.exit(f"reference did less work: {ref_members} members / {ref_bytes} B vs "
                     f"{ours_members} / {ours_bytes}")
        med = {k: statistics.median(v) for k, v in runs.items()}
        best = {k: min(v) for k, v in runs.items()}
        mbps = {k: round(store_bytes / v / MiB, 1) for k, v in best.items()}

        def ratios(t: dict[str, float]) -> dict[str, float]:
            return {"export_vs_tar_create": round(t["tar_create"] / t["export"], 3),
                    "import_vs_tar_extract": round(t["tar_extract"] / t["import"], 3),
                    "import_vs_tar_extract_sync": round(t["tar_extract_sync"] / t["import"],
                                                        3)}

        def less_startup(t: dict[str, float]) -> dict[str, float | None]:
            # spoolctl's data path alone against tar's whole run (tar's start is ~1 ms)
            def one(ref: str, ours: str) -> float | None:
                left = t[ours] - t["startup"]
                return round(t[ref] / left, 3) if left > 0 else None
            return {"export_vs_tar_create": one("tar_create", "export"),
                    "import_vs_tar_extract": one("tar_extract", "import"),
                    "import_vs_tar_extract_sync": one("tar_extract_sync", "import")}

        def ceiling(t: dict[str, float]) -> dict[str, float]:
            # the best ratio reachable with this start-up and a data path as fast as tar's
            return {f"{k}_vs_{k2}": round(t[k2] / (t[k2] + t["startup"]), 3)
                    for k, k2 in (("export", "tar_create"), ("import", "tar_extract"),
                                  ("import", "tar_extract_sync"))}
        print(json.dumps({
            "entries": entries, "store_bytes": store_bytes, "entry_bytes": int(args.entry_mib
                                                                                * MiB),
            "cold": args.cold, "repeat": args.repeat,
            "archive": {"members": ours_members, "bytes": ours_bytes},
            "reference": {"members": ref_members, "bytes": ref_bytes},
            "seconds_best": {k: round(v, 3) for k, v in best.items()},
            "seconds_median": {k: round(v, 3) for k, v in med.items()},
            "seconds_all": {k: [round(x, 3) for x in v] for k, v in runs.items()},
            "mib_per_s_best": mbps,
            # best of the repeats: on a shared machine the fastest run is the one least
            # disturbed by other work (as timeit does); the median ratio is printed too
            "ratio": ratios(best),
            "ratio_median": ratios(med),
            "ratio_less_startup": less_startup(best),
            "ratio_less_startup_median": less_startup(med),
            "ceiling_with_startup": ceiling(best),
        }, indent=2))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
