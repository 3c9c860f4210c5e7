"""Benchmark the operator CLI on a large store; prints one JSON document.

    .venv/bin/python scripts/bench_cli.py [--entries 100000] [--released N/10] [--dir /tmp]

Builds a store of N small entries (256-byte objects, kind vllm), then times, as
real ``spoolctl`` processes: ``status --json``, ``ls --limit 100``,
``clean --released --yes`` of R released entries, and one scrub step
(``scrub --max-items 1000 --rate 0``). Each process time includes Python start-up
and imports, so the same run also measures ``spoolctl --version`` (start-up only)
as the reference, and times ``status``'s in-process work separately. For ``clean``
the reference is unlinking the same number of plain files on the same disk; for the
scrub step, the same step on a store of ``--small`` entries built in the same run.
Last, the catalog is deleted and rebuilt from the manifests (``Store.open``, in process),
against reading every manifest file raw (open + read, the same files, just before), twice:
warm (the files in the page cache: decoding is what is measured) and, when running as root,
cold (page cache dropped before each side: what a rebuild after a reboot or a lost catalog
meets).

Building: entries are written with the store's own manifest encoder and catalog
indexer in one transaction per 5,000 entries (what a catalog rebuild does), with no
per-entry fsync. That only makes the *setup* fast; every timed command runs the
normal code paths on the resulting store (the scrub step re-verifies what it reads).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchutil import drop_page_cache

from spoolctl.store import Store
from spoolctl.store.catalog.writes import CatalogWrites
from spoolctl.store.disk.fsio import FILE_MODE
from spoolctl.store.format.digest import hash_bytes
from spoolctl.store.format.manifest import Manifest, ObjectRef, encode

SPOOLCTL = str(Path(sys.executable).parent / "spoolctl")
ENV = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}


def build(root: Path, n: int) -> float:
    """Create a store with ``n`` entries; return the seconds it took."""
    t0 = time.perf_counter()
    store = Store.open(root, create=True, max_bytes=64 << 30)
    cat = store.catalog
    now = time.time()
    batch = 5000
    for start in range(0, n, batch):
        rows = []
        for i in range(start, min(start + batch, n)):
            data = i.to_bytes(8, "big") * 32  # 256 distinct bytes per entry
            digest = hash_bytes(data)
            obj = store.layout.object_path(digest)
            fd = os.open(obj, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            os.write(fd, data)
            os.close(fd)
            m = Manifest.new(kind="vllm", namespace="bench-model", key=f"chunk-{i}",
                             created=now - (n - i), objects=(ObjectRef("kv", digest, 256),))
            blob = encode(m)
            mp = store.layout.manifest_path(m.entry_id)
            fd = os.open(mp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            os.write(fd, blob)
            os.close(fd)
            rows.append((m, len(blob)))
        with cat.write_transaction() as db:  # one transaction per batch (setup only)
            for m, size in rows:
                CatalogWrites._insert(db, m, size, m.created, hint="retain", state="committed")
        if (start + batch) % 100_000 == 0:
            print(f"built {start + batch} entries in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    store.close()
    return time.perf_counter() - t0


def release(root: Path, count: int) -> None:
    with Store.open(root) as store:
        ids = [r.entry_id for r in store.entries(sort="age", limit=count)]
        with store.catalog.write_transaction() as db:
            db.executemany("UPDATE entries SET hint='release' WHERE entry_id=?",
                           [(i,) for i in ids])


def timed(*args: str, repeat: int = 1) -> dict:
    """Run ``spoolctl ARGS`` ``repeat`` times; median wall seconds and the last rc."""
    times, rc, out = [], 0, ""
    for _ in range(repeat):
        t0 = time.perf_counter()
        proc = subprocess.run([SPOOLCTL, *args], capture_output=True, text=True, env=ENV,
                              stdin=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
        rc, out = proc.returncode, proc.stdout
        if rc not in (0, 1):
            raise SystemExit(f"spoolctl {' '.join(args)} failed: {proc.stderr}")
    return {"seconds": round(statistics.median(times), 4), "rc": rc, "stdout": out}


def in_process_status(root: Path, repeat: int = 5) -> float:
    from spoolctl.cli.store_status import status_doc

    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        with Store.open(root) as store:
            status_doc(store)
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times), 4)


def raw_unlink_reference(base: Path, files: int) -> float:
    """Seconds to unlink ``files`` plain files spread over 256 directories (the disk's
    floor for ``clean``, measured in the same run under the same load)."""
    ref = base / "unlink-ref"
    for fan in range(256):
        (ref / f"{fan:02x}").mkdir(parents=True)
    paths = [ref / f"{i % 256:02x}" / f"{i}.f" for i in range(files)]
    for p in paths:
        p.write_bytes(b"x" * 256)
    # Write back first, so the unlinks free allocated blocks as the store's do (an
    # unlink of a never-written-back file only drops page cache and costs nothing).
    os.sync()
    t0 = time.perf_counter()
    for p in paths:
        os.unlink(p)
    os.sync()  # the store fsyncs the manifest directories of what it deletes
    took = time.perf_counter() - t0
    shutil.rmtree(ref)
    return round(took, 3)


def raw_manifest_read(root: Path) -> tuple[int, float]:
    """(files, seconds) to open and read every manifest file of the store (the floor of a
    catalog rebuild, which reads and decodes each of them)."""
    files = 0
    t0 = time.perf_counter()
    for fan in sorted(os.scandir(root / "manifests"), key=lambda e: e.name):
        if not fan.is_dir(follow_symlinks=False):
            continue
        for e in os.scandir(fan.path):
            fd = os.open(e.path, os.O_RDONLY)
            try:
                os.fstat(fd)
                os.read(fd, 1 << 16)
            finally:
                os.close(fd)
            files += 1
    return files, round(time.perf_counter() - t0, 3)


def rebuild(root: Path) -> tuple[int, float]:
    """(entries indexed, seconds) for a catalog rebuilt from the manifests: the catalog
    files are deleted and the store opened writable (in process, no start-up cost)."""
    for suffix in ("", "-wal", "-shm"):
        (root / "state" / f"catalog.sqlite3{suffix}").unlink(missing_ok=True)
    t0 = time.perf_counter()
    store = Store.open(root)
    took = time.perf_counter() - t0
    try:
        return store.totals().entries, round(took, 3)
    finally:
        store.close()


def scrub_step(root: Path) -> dict:
    scrub = timed("scrub", "--root", str(root), "--max-items", "1000", "--rate", "0", "--json")
    doc = json.loads(scrub["stdout"])
    assert doc["checked"] == 1000 and not doc["quarantined"], doc
    return {"seconds": scrub["seconds"], "in_process_seconds": doc["seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--released", type=int, default=None,
                    help="entries released and cleaned (default: a tenth of --entries)")
    ap.add_argument("--small", type=int, default=10_000,
                    help="entries of the store the scrub step is compared with")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    if args.released is None:
        args.released = args.entries // 10
    if args.dir:  # the disk to measure: made if missing, like --work elsewhere
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="spoolctl-bench-", dir=os.path.realpath(args.dir)))
    root = base / "store"
    try:
        result: dict = {"entries": args.entries, "released": args.released}
        result["build_seconds"] = round(build(root, args.entries), 2)
        r = str(root)
        result["startup_reference_seconds"] = timed("--version", repeat=3)["seconds"]
        status = timed("status", "--root", r, "--json", repeat=3)
        assert json.loads(status["stdout"])["entries"] == args.entries
        result["status_json_seconds"] = status["seconds"]
        result["status_in_process_seconds"] = in_process_status(root)
        ls = timed("ls", "--root", r, "--limit", "100", repeat=3)
        result["ls_limit_100_seconds"] = ls["seconds"]
        # clean unlinks a manifest and an object per entry
        result["raw_unlink_reference_seconds"] = raw_unlink_reference(base, 2 * args.released)
        release(root, args.released)
        clean = timed("clean", "--root", r, "--released", "--yes", "--json")
        deleted = json.loads(clean["stdout"])["steps"]["released"]["entries"]
        assert deleted == args.released, deleted
        result["clean_released_seconds"] = clean["seconds"]
        result["loadavg_before_scrub"] = [round(x, 2) for x in os.getloadavg()]
        scrub = scrub_step(root)
        result["scrub_step_1000_seconds"] = scrub["seconds"]
        result["scrub_step_in_process_seconds"] = scrub["in_process_seconds"]
        small = base / "small"
        build(small, args.small)
        ref = scrub_step(small)
        result["scrub_reference"] = {"entries": args.small, **ref}
        shutil.rmtree(small)
        # Rebuild: the reference reads the same manifest files first (same cache state).
        result["rebuild"] = {}
        for cache in ("warm", "cold"):
            if cache == "cold" and not drop_page_cache():
                continue  # not root: no cold figure
            files, raw_s = raw_manifest_read(root)
            if cache == "cold":
                drop_page_cache()
            indexed, rebuild_s = rebuild(root)
            assert indexed == files == args.entries - args.released, (indexed, files)
            result["rebuild"][cache] = {
                "raw_manifest_read": {"files": files, "seconds": raw_s,
                                      "per_second": round(files / raw_s)},
                "rebuild": {"entries": indexed, "seconds": rebuild_s,
                            "per_second": round(indexed / rebuild_s)},
                "rebuild_rate_vs_raw_read": round((indexed / rebuild_s) / (files / raw_s), 3),
            }
        result["loadavg"] = [round(x, 2) for x in os.getloadavg()]
        result["cpus"] = os.cpu_count()
        ratios = {
            "clean_vs_unlink": round(result["clean_released_seconds"]
                                     / result["raw_unlink_reference_seconds"], 2),
            "scrub_step_vs_small_store": round(scrub["in_process_seconds"]
                                               / ref["in_process_seconds"], 2),
        }
        result["ratios"] = ratios
        result["goals"] = {
            "status_under_1s": result["status_json_seconds"] < 1.0,
            "ls_limit_100_under_1s": result["ls_limit_100_seconds"] < 1.0,
            "clean_le_1_5x_unlink": ratios["clean_vs_unlink"] <= 1.5,
            "scrub_step_independent_of_size (<= 1.5x small store)":
                ratios["scrub_step_vs_small_store"] <= 1.5,
            **{f"rebuild_ge_0_5x_raw_read_{cache}": r["rebuild_rate_vs_raw_read"] >= 0.5
               for cache, r in result["rebuild"].items()},
        }
        print(json.dumps(result, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
