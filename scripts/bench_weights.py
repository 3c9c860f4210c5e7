"""Benchmark the vLLM connector's weights digest at engine start; prints one JSON document.

    .venv/bin/python scripts/bench_weights.py [--gib 4] [--files 4] [--sparse-gib 64] [--dir /tmp]

What an engine start pays to bind the model's files into the deployment identity
(``spoolctl.connector.deployment.weights``, decision 2110), on a model directory of ``--files``
safetensors shards of ``--gib`` GiB in total, written with real (random) bytes:

* ``first_start_cold``: no memo, the files not in the page cache (dropped per file with
  ``posix_fadvise(DONTNEED)``, which leaves other processes' cache alone): read + hash all.
* ``first_start_warm``: the same with the files in the page cache (hashing speed).
* ``memo_hit``: the next start, nothing changed: stats only.
* ``one_shard_replaced``: one shard rewritten in place: that shard is hashed again.
* ``hub_cache``: the same shards in a Hugging Face hub cache layout (snapshot symlinks to
  content-named blobs): nothing is read.
* ``sparse``: a ``--sparse-gib`` GiB sparse file set (holes read as zeros without disk I/O):
  the hashing rate alone at a 100 GB-class size, first start and memo hit.

Each timed case runs ``--repeat`` times (median reported). Reference: reading the same
bytes with ``cat``-style 8 MiB reads, cold, without hashing (the disk's share).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from spoolctl.connector.deployment.weights import weights_digest
from spoolctl.store.format.digest import hash_bytes

SHARD = "model-{:05d}-of-{:05d}.safetensors"


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write_model(where: Path, total: int, files: int, *, sparse: bool) -> list[Path]:
    where.mkdir(parents=True)
    (where / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    shards = []
    per = total // files
    block = os.urandom(8 << 20)
    for i in range(files):
        path = where / SHARD.format(i + 1, files)
        with open(path, "wb") as f:
            if sparse:
                f.truncate(per)
            else:
                for _ in range(per // len(block)):
                    f.write(block[:8] + os.urandom(8) + block[16:])  # no two blocks alike
            f.flush()
            os.fsync(f.fileno())
        shards.append(path)
    return shards


def _timed(fn, repeat: int, before=None) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def _raw_read(paths: list[Path]) -> int:
    buf = bytearray(8 << 20)
    n = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
    return n


def _hub_layout(root: Path, model: Path) -> Path:
    repo = root / "models--bench--model"
    snap = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for src in sorted(model.iterdir()):
        # The blob name stands for the hub's content hash; computed here from name + size
        # only to keep set-up quick (the digest reads the name, never the bytes).
        blob = repo / "blobs" / hash_bytes(f"{src.name}:{src.stat().st_size}".encode())
        os.link(src, blob)
        (snap / src.name).symlink_to(os.path.relpath(blob, snap))
    return snap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--sparse-gib", type=float, default=64.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-weights-", dir=args.dir))
    try:
        total = int(args.gib * (1 << 30))
        model = work / "model"
        shards = _write_model(model, total, args.files, sparse=False)
        size = sum(p.stat().st_size for p in model.iterdir())

        def evict_all() -> None:
            for p in shards:
                _evict(p)

        cold, _ = _timed(lambda: weights_digest(model, memo_dir=None), args.repeat, evict_all)
        raw, _ = _timed(lambda: _raw_read(shards), args.repeat, evict_all)
        warm, _ = _timed(lambda: weights_digest(model, memo_dir=None), args.repeat)
        memo = work / "memo"
        weights_digest(model, memo_dir=memo)  # the first start fills the memo
        hit, found = _timed(lambda: weights_digest(model, memo_dir=memo), args.repeat)
        assert found.hashed_bytes == 0

        def replace_one() -> None:
            with open(shards[0], "r+b") as f:
                f.write(os.urandom(16))
            _evict(shards[0])

        one, found1 = _timed(lambda: weights_digest(model, memo_dir=memo), args.repeat,
                             replace_one)
        hub = _hub_layout(work / "hub", model)
        hub_t, found_hub = _timed(lambda: weights_digest(hub, memo_dir=memo), args.repeat)
        assert found_hub.hashed_bytes == 0 and found_hub.hub_files == args.files + 1

        sparse_total = int(args.sparse_gib * (1 << 30))
        sparse = work / "sparse"
        _write_model(sparse, sparse_total, max(1, int(args.sparse_gib // 5)), sparse=True)
        smemo = work / "smemo"
        s_first, _ = _timed(lambda: weights_digest(sparse, memo_dir=None), 1)
        weights_digest(sparse, memo_dir=smemo)
        s_hit, _ = _timed(lambda: weights_digest(sparse, memo_dir=smemo), args.repeat)
        doc = {
            "bytes": size, "files": args.files + 1, "repeat": args.repeat,
            "first_start_cold_s": round(cold, 3),
            "first_start_cold_gb_s": round(size / cold / 1e9, 2),
            "raw_read_cold_s": round(raw, 3),
            "raw_read_cold_gb_s": round(size / raw / 1e9, 2),
            "first_start_warm_s": round(warm, 3),
            "first_start_warm_gb_s": round(size / warm / 1e9, 2),
            "memo_hit_s": round(hit, 5),
            "one_shard_replaced_s": round(one, 3),
            "one_shard_replaced_hashed_bytes": found1.hashed_bytes,
            "hub_cache_s": round(hub_t, 5),
            "sparse_bytes": sparse_total,
            "sparse_first_start_s": round(s_first, 2),
            "sparse_gb_s": round(sparse_total / s_first / 1e9, 2),
            "sparse_memo_hit_s": round(s_hit, 5),
            "cpus": len(os.sched_getaffinity(0)),
        }
        print(json.dumps(doc, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
