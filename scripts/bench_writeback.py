#!/usr/bin/env python3
"""Early write-back (``sync_file_range``) for the commit's data file, encrypted and plain.

Decision 2830: an encrypted commit starts the write-back of each sealed 1 MiB piece as soon
as it is written (``fsio.start_writeback``), so the disk works while the next piece is
encrypted and the final fsync has little left. This measures the file step alone (no
manifest, catalog or rename), four ways on the same bytes, interleaved, in one run:

* ``enc``: ``Sealer.seal_stream`` through ``fsio.write_tmp`` with ``start_writeback``
  turned off (the commit before decision 2830);
* ``enc_wb``: the same as the commit does it now;
* ``plain``: the bytes through ``fsio.write_tmp`` as the plain commit did before decision
  2951 (one write, then the fsync on a helper while this thread hashes);
* ``plain_wb``: the same as the plain commit does it now (decision 2951: from
  ``fsio.PLAIN_WRITEBACK_MIN`` on, written in 1 MiB pieces, each one's write-back started
  at once, then the same fsync and hash; below it, the same as ``plain``).

Also the parts of an encrypted 64 MiB-style write (``parts``): sealing, writing and the
final fsync, with and without early write-back. Files stay until the end (a deletion on
a ``discard`` mount slows the I/O after it). Ratios are plain over the side, from the
best and the median. Prints JSON.

    python scripts/bench_writeback.py [--dir /path/on/disk] [--sizes 1,16,64] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from spoolctl.store.disk import fsio
from spoolctl.store.sealing import MasterKey, Sealer

MiB = 1 << 20
TID = "00" * 8
VERSION = 1 << 40  # a random-id key: SPS2, as every new key since decision 2812


class _Ring:  # seal_stream needs only a data key, not a store's keyring
    def __init__(self, key: bytes):
        self.key = key

    def data_key(self, tid: str, version: int) -> bytes:
        return self.key


def _sealer() -> tuple[Sealer, bytes]:
    key = os.urandom(32)
    return Sealer(MasterKey(os.urandom(32), "bench"), _Ring(key)), key  # type: ignore[arg-type]


def _no_writeback(fd: int, offset: int, length: int) -> None:
    return None


def _enc(tmp: Path, sealer: Sealer, key: bytes, data: bytes, early: bool) -> None:
    saved = fsio.start_writeback
    fsio.start_writeback = saved if early else _no_writeback
    try:
        fsio.write_tmp(tmp, sealer.seal_stream(TID, VERSION, key, data))
    finally:
        fsio.start_writeback = saved


def _plain(tmp: Path, data: bytes, early: bool) -> None:
    """The plain commit's file step, with (``fsio.PLAIN_WRITEBACK_MIN`` as it is, decision
    2951) or without (one write, the commit before 2951) early write-back."""
    saved = fsio.PLAIN_WRITEBACK_MIN
    fsio.PLAIN_WRITEBACK_MIN = saved if early else 1 << 62
    try:
        fsio.write_tmp(tmp, [data])
    finally:
        fsio.PLAIN_WRITEBACK_MIN = saved


def bench(tmp: Path, size: int, repeat: int) -> dict:
    sealer, key = _sealer()
    sides = {
        "enc": lambda d: _enc(tmp, sealer, key, d, early=False),
        "enc_wb": lambda d: _enc(tmp, sealer, key, d, early=True),
        "plain": lambda d: _plain(tmp, d, early=False),
        "plain_wb": lambda d: _plain(tmp, d, early=True),
    }
    times: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(repeat):
        data = os.urandom(size)
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            os.sync()
            t = time.perf_counter()
            sides[name](data)
            times[name].append(time.perf_counter() - t)
    row: dict = {"size_mib": size // MiB}
    for name, runs in times.items():
        row[f"{name}_ms"] = [round(min(runs) * 1e3, 1), round(statistics.median(runs) * 1e3, 1)]
    for name in ("enc", "enc_wb", "plain_wb"):
        row[f"plain_over_{name}"] = [round(row["plain_ms"][k] / row[f"{name}_ms"][k], 2)
                                     for k in (0, 1)]
    return row


def parts(tmp: Path, size: int, repeat: int) -> dict:
    """Median ms of sealing, writing, starting write-back and the final fsync of one
    encrypted file, without and with early write-back (the pieces as the commit makes them,
    no hashing)."""
    sealer, key = _sealer()
    out = {}
    for early in (False, True, False, True):
        runs = []
        for _ in range(repeat):
            data = os.urandom(size)
            os.sync()
            t0 = time.perf_counter()
            made = fsio.create_tmp(tmp)
            spent = {"seal": 0.0, "write": 0.0, "writeback": 0.0}
            pieces, offset = iter(sealer.seal_stream(TID, VERSION, key, data)), 0
            while True:
                t = time.perf_counter()
                piece = next(pieces, None)
                spent["seal"] += time.perf_counter() - t
                if piece is None:
                    break
                t = time.perf_counter()
                n = os.write(made.fd, piece)
                spent["write"] += time.perf_counter() - t
                t = time.perf_counter()
                if early:
                    fsio.start_writeback(made.fd, offset, n)
                spent["writeback"] += time.perf_counter() - t
                offset += n
            t = time.perf_counter()
            fsio.fsync_close(made.fd)
            spent["fsync"] = time.perf_counter() - t
            spent["total"] = time.perf_counter() - t0
            runs.append(spent)
        out["early" if early else "late"] = {
            k: round(statistics.median(r[k] for r in runs) * 1e3, 1) for k in runs[0]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    parser.add_argument("--sizes", default="1,16,64", help="sizes in MiB")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        base = Path(os.path.realpath(tmp))
        sizes = [int(float(s) * MiB) for s in args.sizes.split(",") if s]
        results = [bench(base, size, args.repeat) for size in sizes]
        split = parts(base, max(sizes), args.repeat)
    print(json.dumps({"benchmark": "writeback", "repeat": args.repeat,
                      "loadavg_before": [round(x, 2) for x in load],
                      "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                      "results": results, f"parts_{max(sizes) // MiB}_mib": split}, indent=2))


if __name__ == "__main__":
    main()
