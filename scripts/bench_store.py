#!/usr/bin/env python3
"""Store throughput next to the raw disk, measured in the same run.

For entries of 1, 16 and 64 MiB: commit (``Store.put``: write, hash, fsync, publish,
manifest, catalog) vs raw write+fsync of the same bytes, and verified read
(``Store.read``: read + digest in one pass) vs a raw read of the same file. Reads are
cold (page cache dropped) when running as root, else warm (reported). Prints JSON.

    python scripts/bench_store.py [--dir /path/on/nvme] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from spoolctl.store import Store
from spoolctl.store.fsio import READ_CHUNK, full_fsync

MiB = 1 << 20


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_write(path: Path, data: bytes) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    full_fsync(fd)
    os.close(fd)
    return time.perf_counter() - t


def raw_read(path: Path, size: int) -> float:
    t = time.perf_counter()
    buf = memoryview(bytearray(size))  # allocation is timed: Store.read allocates too
    with open(path, "rb", buffering=0) as f:
        off = 0
        while off < size:
            n = f.readinto(buf[off:off + READ_CHUNK])
            if not n:
                break
            off += n
    return time.perf_counter() - t


def bench(base: Path, size: int, repeat: int) -> dict:
    raw_w, raw_r, commit, vread = [], [], [], []
    cold = True
    for i in range(repeat):
        data = os.urandom(size)
        raw_path = base / f"raw-{size}-{i}.bin"
        os.sync()  # start each timed write with no dirty pages from the previous one
        raw_w.append(raw_write(raw_path, data))
        with Store.open(base / "store", create=True) as store:
            os.sync()
            t = time.perf_counter()
            m = store.put(kind="vllm", namespace="bench", key=f"{size}-{i}", objects={"kv": data})
            commit.append(time.perf_counter() - t)
            cold = drop_caches() and cold
            raw_r.append(raw_read(raw_path, size))
            cold = drop_caches() and cold
            t = time.perf_counter()
            view = store.read(m, "kv")
            vread.append(time.perf_counter() - t)
            assert len(view) == size
        raw_path.unlink()

    def mbps(times: list[float]) -> float:
        return round(size / statistics.median(times) / MiB, 1)

    out = {
        "size_mib": size // MiB,
        "raw_write_fsync_mib_s": mbps(raw_w),
        "commit_mib_s": mbps(commit),
        "raw_read_mib_s": mbps(raw_r),
        "verified_read_mib_s": mbps(vread),
        "cold_reads": cold,
    }
    out["commit_vs_raw_write"] = round(out["commit_mib_s"] / out["raw_write_fsync_mib_s"], 2)
    out["verified_read_vs_raw_read"] = round(out["verified_read_mib_s"] / out["raw_read_mib_s"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", default="1,16,64", help="entry sizes in MiB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        base = Path(os.path.realpath(tmp))
        results = [bench(base, int(s) * MiB, args.repeat) for s in args.sizes.split(",")]
    print(json.dumps({
        "benchmark": "store", "goal": {"verified_read_vs_raw_read": 0.9,
                                       "commit_vs_raw_write": 0.8},
        "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
