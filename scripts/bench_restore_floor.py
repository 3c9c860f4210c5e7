"""Benchmark: a restore's verified reads against the floor of the same bytes, in one run.
Prints one JSON document.

    .venv/bin/python scripts/bench_restore_floor.py [--chunks 64] [--chunk-mib 1]
        [--threads 2,4] [--repeat 7] [--workdir DIR]

One store of ``--chunks`` entries of one object each (``--chunk-mib``: 1 MiB is a SpoolTier
chunk of the ``small`` model, 2 MiB a SpoolConnector chunk), then, per repeat, in alternating
order, each with the page cache dropped first (as root) and the same thread count:

    raw_buffered[_blake3]  read the same object files (and hash them): no store
    raw_direct[_blake3]    the same with O_DIRECT, as vLLM's fs tier reads (it hashes nothing)
    tier_per_chunk         SpoolTier's I/O threads, one catalog lookup and verified read per
                           chunk (the code before ``Store.lookup_many``)
    tier_sliced            SpoolTier's I/O threads as shipped: one ``lookup_many`` per read
                           thread's slice, then a verified read per chunk
    connector_per_chunk    SpoolConnector's restore before: per chunk, its manifest, then its
                           verified read, on a pool of the same threads
    connector_ahead        as shipped: the manifests loaded ahead in slices (``ManifestsAhead``)
                           on the same pool, each chunk's verified read after them

Each time is printed with the chunks it read (every verified read hit: ``found``). The
``*_over_*`` ratios compare medians of the same run.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
from benchutil import drop_page_cache

from spoolctl.connector.tier.io import TierIO
from spoolctl.connector.worker_side.manifests import ManifestsAhead
from spoolctl.store import Manifest, PutRequest, Store

KIND, NAMESPACE, OBJECT = "vllm", "bench-restore-floor", "kv"


class Bench:
    """The store, its object files and one destination buffer per chunk."""

    def __init__(self, root: Path, chunks: int, size: int) -> None:
        self.store = Store.open(root, create=True)
        self.keys = [f"{i:064x}" for i in range(chunks)]
        self.store.put_many([PutRequest(KIND, NAMESPACE, k, {OBJECT: os.urandom(size)})
                             for k in self.keys])
        found = self.store.lookup_many(KIND, NAMESPACE, self.keys, touch=False)
        self.paths = [self.store.layout.object_path(m.object(OBJECT).digest)
                      for m in found if m is not None]
        self.size = size
        self.bufs = [memoryview(bytearray(size)) for _ in self.keys]
        self.aligned = [mmap.mmap(-1, size) for _ in self.keys]  # O_DIRECT wants alignment

    def raw(self, i: int, *, direct: bool, digest: bool) -> bool:
        fd = os.open(self.paths[i], os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            buf = self.aligned[i] if direct else self.bufs[i]
            got = os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
        if digest:
            blake3.blake3(buf).digest()
        return got == self.size

    def connector(self, threads: int, *, ahead: bool) -> int:
        ids = [self.store.entry_id(KIND, NAMESPACE, k) for k in self.keys]
        with ThreadPoolExecutor(threads) as pool:
            got = ManifestsAhead(self.store, pool, ids) if ahead else None

            def read(i: int) -> bool:
                manifest = self.store.manifest(ids[i]) if got is None else got.take(ids[i])
                self.store.read(manifest, OBJECT, into=self.bufs[i])
                return True
            return sum(pool.map(read, range(len(ids))))

    def per_chunk(self, key: bytes, into: memoryview) -> bool:
        manifest = self.store.lookup(KIND, NAMESPACE, key.decode(), touch=False)
        if manifest is None:
            return False
        self.store.read(manifest, OBJECT, into=into)
        return True

    def find(self, keys: list[bytes]) -> list[Callable[[memoryview], bool] | None]:
        found = self.store.lookup_many(KIND, NAMESPACE, [k.decode() for k in keys],
                                       touch=False)
        return [None if m is None else _reader(self.store, m) for m in found]


def _reader(store: Store, manifest: Manifest) -> Callable[[memoryview], bool]:
    def read(into: memoryview) -> bool:
        store.read(manifest, OBJECT, into=into)
        return True
    return read


def _pool(fn: Callable[[int], bool], n: int, threads: int) -> int:
    with ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(fn, range(n)))


def _tier(bench: Bench, threads: int, *, sliced: bool) -> Callable[[], int]:
    """One promotion of every chunk on a ``TierIO`` started before the clock starts."""
    io = TierIO(find=bench.find if sliced else None, read=None if sliced else bench.per_chunk,
                write=lambda chunks: set(), chunk_bytes=bench.size, read_threads=threads,
                write_threads=1, queue_depth=2, read_deadline=60.0)

    def run() -> int:
        io.submit_load(1, [k.encode() for k in bench.keys], bench.bufs)
        while not (done := io.finished()):
            io.wait_loads(0.001)
        return len(done[0].ok_keys)
    return run


def modes(bench: Bench, threads: int) -> dict[str, Callable[[], int]]:
    n = len(bench.keys)
    return {
        "raw_buffered": lambda: _pool(lambda i: bench.raw(i, direct=False, digest=False),
                                      n, threads),
        "raw_buffered_blake3": lambda: _pool(lambda i: bench.raw(i, direct=False, digest=True),
                                             n, threads),
        "raw_direct": lambda: _pool(lambda i: bench.raw(i, direct=True, digest=False),
                                    n, threads),
        "raw_direct_blake3": lambda: _pool(lambda i: bench.raw(i, direct=True, digest=True),
                                           n, threads),
        "tier_per_chunk": _tier(bench, threads, sliced=False),
        "tier_sliced": _tier(bench, threads, sliced=True),
        "connector_per_chunk": lambda: bench.connector(threads, ahead=False),
        "connector_ahead": lambda: bench.connector(threads, ahead=True),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-mib", type=int, default=1)
    ap.add_argument("--threads", default="2,4")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--workdir", default=None, help="scratch dir on the disk under test")
    args = ap.parse_args()
    work = Path(args.workdir or f"/var/tmp/spoolctl-restore-floor-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    bench = Bench(work / "store", args.chunks, args.chunk_mib << 20)
    load_start = os.getloadavg()[0]
    times: dict[str, dict[str, list[float]]] = {}
    found: dict[str, dict[str, list[int]]] = {}
    dropped = True
    for rep in range(args.repeat):
        for threads in (int(t) for t in args.threads.split(",")):
            items = list(modes(bench, threads).items())
            for name, run in items if rep % 2 == 0 else items[::-1]:
                dropped = drop_page_cache() and dropped
                start = time.perf_counter()
                hits = run()
                times.setdefault(str(threads), {}).setdefault(name, []).append(
                    time.perf_counter() - start)
                found.setdefault(str(threads), {}).setdefault(name, []).append(hits)
    bench.store.close()
    shutil.rmtree(work, ignore_errors=True)
    report: dict = {"chunks": args.chunks, "chunk_bytes": args.chunk_mib << 20,
                    "repeat": args.repeat, "page_cache_dropped": dropped,
                    "load_avg": {"start": load_start, "end": os.getloadavg()[0]},
                    "threads": {}}
    for threads, per_mode in times.items():
        med = {name: statistics.median(v) for name, v in per_mode.items()}
        report["threads"][threads] = {
            "median_s": {k: round(v, 4) for k, v in med.items()},
            "found": {k: min(v) for k, v in found[threads].items()},
            "all_s": {k: [round(x, 4) for x in v] for k, v in per_mode.items()},
            "tier_sliced_over_tier_per_chunk": round(med["tier_sliced"]
                                                     / med["tier_per_chunk"], 3),
            "tier_sliced_over_raw_direct": round(med["tier_sliced"] / med["raw_direct"], 3),
            "tier_sliced_over_raw_buffered_blake3": round(
                med["tier_sliced"] / med["raw_buffered_blake3"], 3),
            "connector_ahead_over_connector_per_chunk": round(
                med["connector_ahead"] / med["connector_per_chunk"], 3),
            "connector_ahead_over_raw_direct": round(med["connector_ahead"]
                                                     / med["raw_direct"], 3)}
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
