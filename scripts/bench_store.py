#!/usr/bin/env python3
"""Store throughput next to the raw disk, measured in the same run.

Rows (every reference measured in the same run, alternating with the store's side):

* single entries of 1, 16 and 64 MiB: commit (``Store.put``: write, hash, fsync, publish,
  manifest, catalog) vs a raw write + fsync of the same bytes, and vs the same bytes taken
  raw through the durability steps the format requires (``raw_same_steps``: data and a
  small file written and fsynced, each renamed into its own directory and that directory
  fsynced, in manifest-last order: the floor of a commit on this disk); verified read
  (``Store.read``: read + digest in one pass) vs a raw read of the same file;
* batches: 32 entries of 256 KiB and of 1 MiB committed with one ``Store.put_many`` (group
  commit) vs the same bytes written raw as 32 files, each written and fsynced in turn, then
  their directory fsynced once (the same durability: data and names on disk); and vs the
  format's steps done raw for the batch (``raw_same_steps``: 32 data files and 32 small
  files written with their fsyncs in flight together, the data renamed into 256-way fan-out
  directories by name and each touched directory fsynced, then the small files likewise:
  the floor of a group commit, without hashing or catalog).

Nothing is deleted while measuring: every side's files stay until the run ends (about 3
GB at ``--repeat 15``). On a filesystem mounted with ``discard`` a deletion slows the I/O
that follows it for seconds, so deleting one side's files would slow whichever side ran
next (64 empty files created in 20 ms just after a deletion, 2 ms a minute later).

Reads are cold (page cache dropped) when running as root, else warm (reported). After a
drop, a small unrelated file is read first on both sides, so that only the *data* is cold
(the interpreter's and BLAKE3's code pages are what a serving process has in memory).
Ratios are the store's throughput over the reference's, from the medians. Prints JSON.

    python scripts/bench_store.py [--dir /path/on/nvme] [--repeat 5]
    python scripts/bench_store.py --probe     # where inline hashing beats the helper thread
    python scripts/bench_store.py --tags      # cost of entry tags (decision 2011)
    python scripts/bench_store.py --encrypted # cost of encryption at rest (decision 2800)
    python scripts/bench_store.py --catalog-share --sizes 1 --batch-sizes 256 --repeat 15
                                              # commits with their catalog calls made free
                                              # (decision 2921)
    python scripts/bench_store.py --floor --sizes 1 --batch-sizes 256 --repeat 15
                                              # where a commit's time goes, step by step, on
                                              # the disk and on a RAM filesystem (decision 2950)

``--tags`` measures what a tag key costs, both sides in the same run, taking turns entry by
entry: two stores, one opened with a tag key and one without, each committing the same
entries (``put``, 64 KiB and 1 MiB), loading their manifests (``Store.manifest``: read,
decode, digest, and on the keyed side the tag check) and doing a verified read of every entry
(``lookup`` + ``read``, warm page cache); plus the tag computation alone.

``--catalog-share`` bounds what any catalog change can give a commit: a single ``put`` and a
group commit, each as it is and with the catalog's per-commit calls (the existence check, the
intent, the committed mark) replaced by no-ops, taking turns with the format's steps done
raw. The catalog-free ratio is the ceiling a commit meets without touching the protocol.

``--floor`` shows which steps of a commit ``raw_same_steps`` does not count (decision 2950): a
single ``put`` and a group commit, timed step by step through the store's crash checkpoints,
next to ``raw_same_steps`` timed step by step, taking turns, on the disk (``--dir``) and on a
RAM filesystem (``--ram-dir``, default /dev/shm) where a flush costs nothing, so what is left
there is the software each step costs. ``ceiling`` is what a commit reaches on this disk if
every step the format adds cost no more than it does on the RAM filesystem: the raw steps'
time over that time plus the software the commit adds before its first flush starts and
after its last flush ends (``critical_software_us``); ``ceiling_no_overlap`` also counts the
software that runs while the flushes do (hashing, the manifest, the intent), which costs wall
time only when no core is free for it.

``--encrypted`` measures what encryption at rest costs (issue 33: encrypted commit and
verified read each at least 0.9x the plain ones), both sides in the same run, taking turns
entry by entry: two stores, one opened with a master key (AES-256-GCM objects of one tenant)
and one without, each committing the same bytes (``put``) and reading them back verified
(``read``: digest on the plain side, the GCM tag on the encrypted one; cold when root).
Each size reports medians and bests (``*_best_*``) and, under ``cpu``, the same work done in
memory without a disk: BLAKE3 vs AES-256-GCM on this CPU, the floor of the two ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchutil import drop_page_cache

from spoolctl.store import (
    Manifest,
    Store,
)
from spoolctl.store.catalog.index import Catalog
from spoolctl.store.commit.committer import PutRequest
from spoolctl.store.disk import (
    fsio,
    verify,
)
from spoolctl.store.disk.fsio import fsync_dir, full_fsync
from spoolctl.store.format.entry_tags import TagKey

MiB = 1 << 20
READ_CHUNK = 8 * MiB  # the raw read's chunk
KiB = 1 << 10
BATCH = 32


def raw_write(path: Path, data: bytes) -> float:
    t = time.perf_counter()
    _write_fsync(path, data)
    return time.perf_counter() - t


def _write_fsync(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    full_fsync(fd)
    os.close(fd)


def raw_same_steps(base: Path, data: bytes, tag: str) -> float:
    """The commit protocol done raw: what the format requires of one entry and nothing
    else (no hashing, no catalog, no checks): data and a 400-byte file written to a temp
    directory and fsynced; the data renamed into one directory, that directory fsynced; then
    the small file renamed into another and that one fsynced."""
    dirs = [base / "same-steps" / d for d in ("tmp", "objects", "manifests")]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    tmp, objects, manifests = dirs
    t = time.perf_counter()
    _write_fsync(tmp / f"{tag}.obj", data)
    _write_fsync(tmp / f"{tag}.json", b"m" * 400)
    os.rename(tmp / f"{tag}.obj", objects / f"{tag}.obj")
    fsync_dir(objects)
    os.rename(tmp / f"{tag}.json", manifests / f"{tag}.json")
    fsync_dir(manifests)
    return time.perf_counter() - t  # the files stay until the run ends (module docstring)


def raw_batch_same_steps(base: Path, blobs: list[bytes], tag: str) -> float:
    """A group commit's steps done raw (see the module docstring), timed."""
    tmp, objects, manifests = (base / "same-batch" / d for d in ("tmp", "objects", "manifests"))
    for top in (objects, manifests):
        for i in range(256):
            (top / f"{i:02x}").mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    names = [os.urandom(32).hex() for _ in blobs] + [os.urandom(32).hex() for _ in blobs]
    t = time.perf_counter()
    flushing = []
    for i, data in enumerate([*blobs, *[b"m" * 400] * len(blobs)]):
        fd = os.open(tmp / f"{tag}-{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        flushing.append(fsio.flush_submit(fsio.fsync_close, fd))
    for f in flushing:
        f.result()
    for top, part in ((objects, range(len(blobs))), (manifests, range(len(blobs), len(names)))):
        dirs = set()
        for i in part:
            final = top / names[i][:2] / names[i]
            os.rename(tmp / f"{tag}-{i}", final)
            dirs.add(final.parent)
        for f in [fsio.flush_submit(fsync_dir, d) for d in dirs]:
            f.result()
    return time.perf_counter() - t  # the files stay until the run ends (module docstring)


def raw_batch(directory: Path, blobs: list[bytes]) -> float:
    """Write each blob to its own file, fsync it, next; then fsync the directory once."""
    directory.mkdir()
    t = time.perf_counter()
    for i, data in enumerate(blobs):
        _write_fsync(directory / f"{i}.bin", data)
    fsync_dir(directory)
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


def cold(warm_up) -> bool:
    """Drop the page cache, then run ``warm_up`` (reads a small unrelated file the same way
    as the timed read, so its code is in memory again). False when not root."""
    dropped = drop_page_cache()
    warm_up()
    return dropped


def _timed_put(store: Store, key: str, data: bytes, committed: list[Manifest]) -> float:
    t = time.perf_counter()
    committed.append(store.put(kind="vllm", namespace="bench", key=key, objects={"kv": data}))
    return time.perf_counter() - t


def bench_single(base: Path, size: int, repeat: int) -> dict:
    raw_w, raw_r, commit, vread, same = [], [], [], [], []
    was_cold = True
    with Store.open(base / "store", create=True) as store:
        warm_m = store.put(kind="vllm", namespace="bench", key=f"warm-{size}",
                           objects={"kv": os.urandom(64 * KiB)})
        warm_raw = base / f"warm-{size}.bin"
        warm_raw.write_bytes(os.urandom(64 * KiB))
        for i in range(repeat):
            data = os.urandom(size)
            raw_path = base / f"raw-{size}-{i}.bin"
            committed: list[Manifest] = []
            sides = [(raw_w, lambda p=raw_path, d=data: raw_write(p, d)),
                     (same, lambda d=data, t=f"{size}-{i}": raw_same_steps(base, d, t)),
                     (commit, lambda d=data, k=f"{size}-{i}", c=committed:
                      _timed_put(store, k, d, c))]
            if i % 2:
                sides.reverse()  # alternate which side runs first (the disk's rate varies)
            for times, run in sides:
                os.sync()  # start each timed write with no dirty pages from the previous one
                times.append(run())
            (m,) = committed
            was_cold = cold(lambda: raw_read(warm_raw, 64 * KiB)) and was_cold
            raw_r.append(raw_read(raw_path, size))
            was_cold = cold(lambda: store.read(warm_m, "kv")) and was_cold
            t = time.perf_counter()
            view = store.read(m, "kv")
            vread.append(time.perf_counter() - t)
            assert len(view) == size

    def mbps(times: list[float]) -> float:
        return round(size / statistics.median(times) / MiB, 1)

    out = {
        "size_mib": size // MiB,
        "raw_write_fsync_mib_s": mbps(raw_w),
        "raw_same_steps_mib_s": mbps(same),
        "commit_mib_s": mbps(commit),
        "raw_read_mib_s": mbps(raw_r),
        "verified_read_mib_s": mbps(vread),
        "cold_reads": was_cold,
    }
    out["commit_vs_raw_write"] = round(out["commit_mib_s"] / out["raw_write_fsync_mib_s"], 2)
    out["commit_vs_raw_same_steps"] = round(out["commit_mib_s"] / out["raw_same_steps_mib_s"], 2)
    out["raw_same_steps_vs_raw_write"] = round(
        out["raw_same_steps_mib_s"] / out["raw_write_fsync_mib_s"], 2)
    out["verified_read_vs_raw_read"] = round(out["verified_read_mib_s"] / out["raw_read_mib_s"], 2)
    return out


def bench_batch(base: Path, size: int, repeat: int) -> dict:
    raw, ours, same = [], [], []
    with Store.open(base / "store", create=True) as store:
        for i in range(repeat):
            blobs = [os.urandom(size) for _ in range(BATCH)]
            requests = [PutRequest("vllm", "bench-batch", f"{size}-{i}-{k}", {"kv": b})
                        for k, b in enumerate(blobs)]
            raw_dir = base / f"raw-batch-{size}-{i}"
            sides = [(raw, lambda d=raw_dir, b=blobs: raw_batch(d, b)),
                     (same, lambda b=blobs, t=f"{size}-{i}": raw_batch_same_steps(base, b, t)),
                     (ours, lambda r=requests: _timed_put_many(store, r))]
            if i % 2:
                sides.reverse()  # alternate which side runs first
            for times, run in sides:
                os.sync()
                times.append(run())
    total = size * BATCH

    def mbps(times: list[float]) -> float:
        return round(total / statistics.median(times) / MiB, 1)

    out = {"entry_kib": size // KiB, "entries_per_batch": BATCH,
           "raw_files_fsynced_mib_s": mbps(raw), "raw_same_steps_mib_s": mbps(same),
           "batch_commit_mib_s": mbps(ours),
           "raw_seconds": [round(x, 4) for x in raw],
           "batch_seconds": [round(x, 4) for x in ours]}
    out["batch_commit_vs_raw"] = round(out["batch_commit_mib_s"] / out["raw_files_fsynced_mib_s"],
                                       2)
    out["batch_commit_vs_raw_same_steps"] = round(
        out["batch_commit_mib_s"] / out["raw_same_steps_mib_s"], 2)
    out["raw_same_steps_vs_raw"] = round(
        out["raw_same_steps_mib_s"] / out["raw_files_fsynced_mib_s"], 2)
    return out


def _timed_put_many(store: Store, requests: list[PutRequest]) -> float:
    t = time.perf_counter()
    outcomes = store.put_many(requests)
    took = time.perf_counter() - t
    assert all(o.status == "committed" for o in outcomes), [o.error for o in outcomes]
    return took


def probe(base: Path, repeat: int) -> dict:
    """Verified-read time with inline hashing vs the helper-thread pipeline, by size,
    warm (page cache) and, as root, cold."""
    rows = []
    saved = verify.INLINE_HASH_MAX
    try:
        with Store.open(base / "probe", create=True) as store:
            warm_m = store.put(kind="vllm", namespace="p", key="warm",
                               objects={"kv": os.urandom(64 * KiB)})
            for size in (64 * KiB, 256 * KiB, MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB):
                m = store.put(kind="vllm", namespace="p", key=str(size),
                              objects={"kv": os.urandom(size)})
                row = {"size_kib": size // KiB}
                for temp in ("warm", "cold"):
                    times: dict[str, list[float]] = {"inline": [], "pipelined": []}
                    for _ in range(repeat):
                        for mode in ("inline", "pipelined"):
                            verify.INLINE_HASH_MAX = size if mode == "inline" else 0
                            if temp == "cold" and not cold(lambda: store.read(warm_m, "kv")):
                                break
                            t = time.perf_counter()
                            store.read(m, "kv")
                            times[mode].append(time.perf_counter() - t)
                    if times["inline"] and times["pipelined"]:
                        row[f"{temp}_inline_ms"] = round(statistics.median(times["inline"])
                                                         * 1e3, 3)
                        row[f"{temp}_pipelined_ms"] = round(
                            statistics.median(times["pipelined"]) * 1e3, 3)
                rows.append(row)
    finally:
        verify.INLINE_HASH_MAX = saved
    return {"benchmark": "store-inline-hash-probe", "current_threshold_kib": saved // KiB,
            "loadavg": [round(x, 2) for x in os.getloadavg()], "rows": rows}


def bench_tags(base: Path, repeat: int, entries: int = 32) -> dict:
    """Same-run cost of tagging (commit) and checking (every manifest load) -- see the
    module docstring. Each operation is timed on its own, the two stores taking turns
    entry by entry (which goes first alternates), so load on the machine falls on both
    sides alike; ratios are keyed throughput over unkeyed, from the medians."""
    key = TagKey(os.urandom(32), "bench")
    rows = []
    with Store.open(base / "tags-off", create=True, tag_key=None) as off, \
            Store.open(base / "tags-on", create=True, tag_key=key) as on:
        stores = {"off": off, "on": on}
        for size in (64 * KiB, MiB):
            times: dict[str, dict[str, list[float]]] = {
                side: {"commit": [], "manifest": [], "read": []} for side in stores}
            for i in range(repeat):
                keys = [f"{size}-{i}-{k}" for k in range(entries)]
                ids: dict[str, list[str]] = {side: [] for side in stores}
                for k, name in enumerate(keys):
                    data = os.urandom(size)
                    for side in (("off", "on") if k % 2 else ("on", "off")):
                        t = time.perf_counter()
                        m = stores[side].put(kind="vllm", namespace="tags", key=name,
                                             objects={"kv": data})
                        times[side]["commit"].append(time.perf_counter() - t)
                        ids[side].append(m.entry_id)
                for k, name in enumerate(keys):
                    for side in (("off", "on") if k % 2 else ("on", "off")):
                        t = time.perf_counter()
                        stores[side].manifest(ids[side][k])
                        times[side]["manifest"].append(time.perf_counter() - t)
                        t = time.perf_counter()
                        hit = stores[side].lookup("vllm", "tags", name, touch=False)
                        assert hit is not None and len(stores[side].read(hit, "kv")) == size
                        times[side]["read"].append(time.perf_counter() - t)
            row: dict = {"entry_kib": size // KiB, "samples_per_side": repeat * entries}
            for op in ("commit", "manifest", "read"):
                med = {side: statistics.median(times[side][op]) for side in stores}
                row[f"{op}_us_untagged"] = round(med["off"] * 1e6, 1)
                row[f"{op}_us_tagged"] = round(med["on"] * 1e6, 1)
                row[f"{op}_tagged_vs_untagged"] = round(med["off"] / med["on"], 3)
            rows.append(row)
    digest = "ab" * 32
    n = 20000
    t = time.perf_counter()
    for _ in range(n):
        key.mac(digest)
    mac_us = (time.perf_counter() - t) / n * 1e6
    tag = key.tag(digest)
    t = time.perf_counter()
    for _ in range(n):
        key.problem(tag, digest)
    check_us = (time.perf_counter() - t) / n * 1e6
    return {"benchmark": "store-tags", "repeat": repeat, "mac_us": round(mac_us, 2),
            "check_us": round(check_us, 2),
            "loadavg": [round(x, 2) for x in os.getloadavg()], "rows": rows}


def bench_encrypted(base: Path, size: int, repeat: int) -> dict:
    from spoolctl.store.sealing import MasterKey

    key = MasterKey.from_hex(os.urandom(32).hex(), "bench")
    times: dict[str, list[float]] = {"plain_commit": [], "enc_commit": [], "plain_read": [],
                                     "enc_read": []}
    was_cold = True
    with Store.open(base / f"plain-{size}", create=True, master_key=None) as plain, \
            Store.open(base / f"enc-{size}", create=True, master_key=key) as enc:
        stores = {"plain": plain, "enc": enc}
        warm = {side: s.put(kind="vllm", namespace="bench", key="warm",
                            objects={"kv": os.urandom(64 * KiB)}) for side, s in stores.items()}
        for i in range(repeat):
            data = os.urandom(size)
            order = ["plain", "enc"] if i % 2 == 0 else ["enc", "plain"]
            committed: dict[str, Manifest] = {}
            for side in order:
                os.sync()
                t = time.perf_counter()
                committed[side] = stores[side].put(kind="vllm", namespace="bench",
                                                   key=f"{size}-{i}", objects={"kv": data})
                times[f"{side}_commit"].append(time.perf_counter() - t)
            for side in order:
                was_cold = cold(lambda s=side: stores[s].read(warm[s], "kv")) and was_cold
                t = time.perf_counter()
                view = stores[side].read(committed[side], "kv")
                times[f"{side}_read"].append(time.perf_counter() - t)
                assert len(view) == size

    def mbps(name: str, pick=statistics.median) -> float:
        return round(size / pick(times[name]) / MiB, 1)

    out = {"size_mib": round(size / MiB, 3), "cold_reads": was_cold,
           **{f"{name}_mib_s": mbps(name) for name in times},
           **{f"{name}_best_mib_s": mbps(name, min) for name in times}}
    for op in ("commit", "read"):
        out[f"enc_{op}_vs_plain"] = round(out[f"enc_{op}_mib_s"] / out[f"plain_{op}_mib_s"], 2)
        out[f"enc_{op}_vs_plain_best"] = round(
            out[f"enc_{op}_best_mib_s"] / out[f"plain_{op}_best_mib_s"], 2)
    out["cpu"] = crypto_floor(size)
    return out


@contextlib.contextmanager
def _catalog_free(on: bool):
    """While inside (``on``), a commit's catalog calls cost nothing: ``get`` answers None,
    the intent and the committed mark do nothing. Only for timing: the store is left
    without those rows (its entries are never read back)."""
    real = (Catalog.get, Catalog.record_intents, Catalog.mark_committed_many)
    if on:
        Catalog.get = lambda self, entry_id: None
        Catalog.record_intents = lambda self, *a, **k: set()
        Catalog.mark_committed_many = lambda self, *a, **k: None
    try:
        yield
    finally:
        Catalog.get, Catalog.record_intents, Catalog.mark_committed_many = real


def bench_catalog_share(base: Path, size: int, batch_size: int, repeat: int) -> dict:
    """The upper bound of any catalog change (decision 2921): a single ``put`` of ``size``
    and a group commit of ``BATCH`` x ``batch_size``, each as it is and with the catalog's
    per-commit calls made free, next to the format's steps done raw; taking turns, medians
    and bests of ``repeat``. Where even the catalog-free commit misses a goal, no catalog
    change can meet it."""
    times: dict[str, list[float]] = {k: [] for k in (
        "put", "put_catalog_free", "raw_same_steps",
        "batch", "batch_catalog_free", "raw_batch_same_steps")}
    with Store.open(base / "share", create=True, max_bytes=1 << 40) as store:
        n = 0
        for _ in range(repeat):
            os.sync()
            for kind in ("put", "put_catalog_free", "raw_same_steps"):
                data, n = os.urandom(size), n + 1
                if kind == "raw_same_steps":
                    times[kind].append(raw_same_steps(base, data, f"share-{n}"))
                    continue
                with _catalog_free(kind == "put_catalog_free"):
                    t = time.perf_counter()
                    store.put(kind="pytorch", namespace="share", key=f"k{n}",
                              objects={"kv": data})
                    times[kind].append(time.perf_counter() - t)
            os.sync()
            for kind in ("batch", "batch_catalog_free", "raw_batch_same_steps"):
                blobs, n = [os.urandom(batch_size) for _ in range(BATCH)], n + 1
                if kind == "raw_batch_same_steps":
                    times[kind].append(raw_batch_same_steps(base, blobs, f"share-{n}"))
                    continue
                requests = [PutRequest("pytorch", "share", f"b{n}-{i}", {"kv": b})
                            for i, b in enumerate(blobs)]
                with _catalog_free(kind == "batch_catalog_free"):
                    times[kind].append(_timed_put_many(store, requests))

    def ratio(ref: str, side: str) -> dict:
        return {"best": round(min(times[ref]) / min(times[side]), 3),
                "median": round(statistics.median(times[ref])
                                / statistics.median(times[side]), 3)}

    return {"size_mib": size / MiB, "batch_kib": batch_size / KiB, "repeat": repeat,
            "ms_median": {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()},
            "put_vs_raw_same_steps": ratio("raw_same_steps", "put"),
            "put_catalog_free_vs_raw_same_steps": ratio("raw_same_steps", "put_catalog_free"),
            "batch_vs_raw_same_steps": ratio("raw_batch_same_steps", "batch"),
            "batch_catalog_free_vs_raw_same_steps": ratio("raw_batch_same_steps",
                                                          "batch_catalog_free")}


# The single put's steps, each named by the crash checkpoint that ends it (the last pass of
# that checkpoint, for a batch), in commit order; "end" is the return of ``put``.
COMMIT_STEPS = (
    ("until_written", "object.tmp_written"),    # lock, existence check, temp files, write
    #                                             (a batch: until its last object is written)
    ("until_flushed", "manifest.fsynced"),       # hash, manifest, intent, waiting for flushes
    ("object_placed", "object.dir_fsynced"),     # rename(s) and the fan-out fsync(s)
    ("manifest_placed", "manifest.dir_fsynced"),
    ("until_return", "end"),                     # committed mark, clean-up, lock release
)
RAW_STEPS = ("until_written", "until_flushed", "object_placed", "manifest_placed")


def _stepped_put(store: Store, commit) -> dict[str, float]:
    """Run ``commit()`` (a put or put_many on ``store``), returning seconds per COMMIT_STEPS
    step, from the times its crash checkpoints pass (the last pass of each)."""
    passed: dict[str, float] = {}
    real = store.checkpoint

    def stamp(name: str) -> None:
        passed[name] = time.perf_counter()
        real(name)
    store.checkpoint = stamp
    try:
        t0 = time.perf_counter()
        commit()
        passed["end"] = time.perf_counter()
    finally:
        store.checkpoint = real
    steps, prev = {}, t0
    for label, name in COMMIT_STEPS:
        steps[label] = passed[name] - prev
        prev = passed[name]
    return steps


def _stepped_raw(base: Path, data: bytes, tag: str) -> dict[str, float]:
    """``raw_same_steps`` timed step by step (RAW_STEPS), the same calls in the same order."""
    dirs = [base / "same-steps" / d for d in ("tmp", "objects", "manifests")]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    tmp, objects, manifests = dirs
    t = [time.perf_counter()]
    fd = os.open(tmp / f"{tag}.obj", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    t.append(time.perf_counter())
    full_fsync(fd)
    os.close(fd)
    _write_fsync(tmp / f"{tag}.json", b"m" * 400)
    t.append(time.perf_counter())
    os.rename(tmp / f"{tag}.obj", objects / f"{tag}.obj")
    fsync_dir(objects)
    t.append(time.perf_counter())
    os.rename(tmp / f"{tag}.json", manifests / f"{tag}.json")
    fsync_dir(manifests)
    t.append(time.perf_counter())
    return {label: t[i + 1] - t[i] for i, label in enumerate(RAW_STEPS)}


def _floor_runs(base: Path, size: int, batch_size: int, repeat: int) -> dict:
    """``bench_floor``'s sides on one filesystem, taking turns: totals (median, best) and,
    for the stepped sides, each step's median, in µs."""
    runs: dict[str, list[dict[str, float]]] = {"put": [], "raw_same_steps": [], "batch": []}
    flat: dict[str, list[float]] = {"raw_batch_same_steps": [], "raw_batch": []}
    with Store.open(base / "floor-store", create=True, max_bytes=1 << 40) as store:
        store.put(kind="pytorch", namespace="floor", key="warm",
                  objects={"kv": os.urandom(64 * KiB)})
        for i in range(repeat):
            data = os.urandom(size)
            blobs = [os.urandom(batch_size) for _ in range(BATCH)]
            requests = [PutRequest("pytorch", "floor-batch", f"{i}-{k}", {"kv": b})
                        for k, b in enumerate(blobs)]
            sides = [
                ("put", lambda d=data, k=f"k{i}": _stepped_put(store, lambda: store.put(
                    kind="pytorch", namespace="floor", key=k, objects={"kv": d}))),
                ("raw_same_steps", lambda d=data, t=f"f{i}": _stepped_raw(base, d, t)),
                ("batch", lambda r=requests: _stepped_put(
                    store, lambda: _timed_put_many(store, r))),
                ("raw_batch_same_steps",
                 lambda b=blobs, t=f"fb{i}": raw_batch_same_steps(base, b, t)),
                ("raw_batch", lambda b=blobs, t=f"rb{i}": raw_batch(base / t, b)),
            ]
            if i % 2:
                sides.reverse()  # alternate which side runs first
            for name, run in sides:
                os.sync()
                got = run()
                (runs[name] if isinstance(got, dict) else flat[name]).append(got)
    row: dict = {}
    for name, samples in runs.items():
        totals = [sum(s.values()) for s in samples]
        row[name] = {"total_us": {"median": round(statistics.median(totals) * 1e6),
                                  "best": round(min(totals) * 1e6)},
                     "steps_us_median": {k: round(statistics.median(
                         [s[k] for s in samples]) * 1e6) for k in samples[0]}}
    for name, times in flat.items():
        row[name] = {"total_us": {"median": round(statistics.median(times) * 1e6),
                                  "best": round(min(times) * 1e6)}}
    return row


def bench_floor(disk: Path, ram: Path, size: int, batch_size: int, repeat: int) -> dict:
    """Step-by-step times of a single put of ``size``, of ``raw_same_steps`` and of a group
    commit of ``BATCH`` x ``batch_size`` (with ``raw_batch_same_steps`` and ``raw_batch``),
    on ``disk`` and on ``ram``, taking turns; see the module docstring."""
    out: dict = {"size_mib": size / MiB, "batch_kib": batch_size / KiB, "repeat": repeat,
                 "disk": _floor_runs(disk, size, batch_size, repeat),
                 "ram": _floor_runs(ram, size, batch_size, repeat)}
    d, r = out["disk"], out["ram"]

    def extra(side: str, ref: str, steps: tuple[str, ...]) -> int:
        """Software ``side`` adds over ``ref`` in ``steps`` (RAM medians, µs)."""
        return sum(r[side]["steps_us_median"].get(k, 0) - r[ref]["steps_us_median"].get(k, 0)
                   for k in steps)

    crit = ("until_written", "object_placed", "manifest_placed", "until_return")
    single_crit = extra("put", "raw_same_steps", crit)
    single_all = r["put"]["total_us"]["median"] - r["raw_same_steps"]["total_us"]["median"]
    batch_all = r["batch"]["total_us"]["median"] - r["raw_batch_same_steps"]["total_us"]["median"]
    # A batch's staging (every write, hash and manifest) overlaps its flushes; what follows
    # the last flush is its renames, its fan-out fsyncs (hand-offs, in RAM) and the mark.
    batch_crit = sum(r["batch"]["steps_us_median"][k] for k in crit[1:])

    def ceiling(ref_us: float, floor_us: float, add_us: float) -> float:
        return round(ref_us / (floor_us + add_us), 3)

    for pick in ("median", "best"):
        raw_us = d["raw_same_steps"]["total_us"][pick]
        out[f"put_vs_raw_same_steps_{pick}"] = round(raw_us / d["put"]["total_us"][pick], 3)
        out[f"put_ceiling_{pick}"] = ceiling(raw_us, raw_us, single_crit)
        out[f"put_ceiling_no_overlap_{pick}"] = ceiling(raw_us, raw_us, single_all)
        rb = d["raw_batch"]["total_us"][pick]
        same = d["raw_batch_same_steps"]["total_us"][pick]
        out[f"batch_vs_raw_batch_{pick}"] = round(rb / d["batch"]["total_us"][pick], 3)
        out[f"batch_vs_raw_batch_same_steps_{pick}"] = round(
            same / d["batch"]["total_us"][pick], 3)
        out[f"batch_ceiling_vs_raw_batch_{pick}"] = ceiling(rb, same, batch_crit)
        out[f"batch_ceiling_no_overlap_vs_raw_batch_{pick}"] = ceiling(rb, same, batch_all)
    out["put_critical_software_us"] = single_crit
    out["put_software_us"] = single_all
    out["batch_critical_software_us"] = batch_crit
    out["batch_software_us"] = batch_all
    return out


def crypto_floor(size: int) -> dict:
    """What the CPU alone charges per byte, in memory, best of 5 (no disk): the digest the
    plain side computes (BLAKE3 of the object), the encrypted commit's CPU work (sealing
    with ``Sealer.seal_stream``, each piece hashed as the commit does: its name is the
    digest of the ciphertext) and the decryption of a read (``Sealer.unseal`` into a
    buffer). ``*_cpu_ratio`` is what the commit and read ratios tend to when the disk is
    infinitely fast: the floor set by AES-GCM against BLAKE3 on this CPU."""
    from spoolctl.store.format.digest import Hasher
    from spoolctl.store.sealing import Binding, MasterKey, Sealer

    class _Ring:  # Sealer.seal/unseal need only a data key, not a store's keyring
        def __init__(self, key: bytes):
            self.key = key

        def data_key(self, tid: str, version: int) -> bytes:
            return self.key

    data = os.urandom(size)
    key = os.urandom(32)
    sealer = Sealer(MasterKey(os.urandom(32), "bench"), _Ring(key))  # type: ignore[arg-type]
    binding = Binding("00" * 32, "kv", "00" * 8, 1)
    sealed = memoryview(sealer.seal(binding, key, data))
    out = memoryview(bytearray(size))

    def best(fn) -> float:
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t)
        return min(runs)

    def digest(chunks) -> None:
        h = Hasher()
        for c in chunks:
            h.update(c)
        h.hexdigest()

    t_hash = best(lambda: digest([data]))
    t_seal = best(lambda: digest(sealer.seal_stream(binding, key, data)))
    t_open = best(lambda: sealer.unseal(sealed, out, binding=binding))
    rate = {"blake3": t_hash, "aes_gcm_seal_and_hash": t_seal, "aes_gcm_open": t_open}
    row = {f"{k}_gb_s": round(size / v / 1e9, 2) for k, v in rate.items()}
    row["commit_cpu_ratio"] = round(t_hash / t_seal, 2)
    row["read_cpu_ratio"] = round(t_hash / t_open, 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", default="1,16,64", help="single entry sizes in MiB")
    parser.add_argument("--batch-sizes", default="256,1024",
                        help=f"entry sizes in KiB for batches of {BATCH} (empty: none)")
    parser.add_argument("--probe", action="store_true",
                        help="measure inline vs pipelined hashing of verified reads instead")
    parser.add_argument("--tags", action="store_true",
                        help="measure the cost of entry tags (keyed vs unkeyed store) instead")
    parser.add_argument("--encrypted", action="store_true",
                        help="measure encryption at rest (encrypted vs plain store) instead")
    parser.add_argument("--floor", action="store_true",
                        help="a commit's steps on the disk and on a RAM filesystem, against "
                             "the raw steps, instead (the first --sizes / --batch-sizes)")
    parser.add_argument("--ram-dir", default="/dev/shm",
                        help="a RAM filesystem for --floor (default /dev/shm)")
    parser.add_argument("--catalog-share", action="store_true",
                        help="commits with and without their catalog calls, against the "
                             "raw steps, instead (the first --sizes / --batch-sizes)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        base = Path(os.path.realpath(tmp))
        if args.floor:
            if not os.path.isdir(args.ram_dir):
                parser.error(f"--ram-dir {args.ram_dir} is not a directory: give a RAM "
                             "filesystem (a tmpfs mount)")
            load = os.getloadavg()
            with tempfile.TemporaryDirectory(dir=args.ram_dir) as ram:
                result = bench_floor(
                    base, Path(os.path.realpath(ram)),
                    int(float(args.sizes.split(",")[0]) * MiB),
                    int(args.batch_sizes.split(",")[0] or 256) * KiB, args.repeat)
            print(json.dumps({"benchmark": "store-floor",
                              "loadavg_before": [round(x, 2) for x in load],
                              "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                              **result}, indent=2))
            return
        if args.catalog_share:
            load = os.getloadavg()
            result = bench_catalog_share(
                base, int(float(args.sizes.split(",")[0]) * MiB),
                int(args.batch_sizes.split(",")[0] or 256) * KiB, args.repeat)
            print(json.dumps({"benchmark": "store-catalog-share",
                              "loadavg_before": [round(x, 2) for x in load],
                              "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                              **result}, indent=2))
            return
        if args.probe:
            print(json.dumps(probe(base, args.repeat), indent=2))
            return
        if args.tags:
            print(json.dumps(bench_tags(base, args.repeat), indent=2))
            return
        if args.encrypted:
            load = os.getloadavg()
            print(json.dumps({
                "benchmark": "store-encrypted",
                "goal": {"enc_commit_vs_plain": 0.9, "enc_read_vs_plain": 0.9},
                "repeat": args.repeat, "loadavg_before": [round(x, 2) for x in load],
                "results": [bench_encrypted(base, int(float(s) * MiB), args.repeat)
                            for s in args.sizes.split(",") if s],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()]}, indent=2))
            return
        load_before = os.getloadavg()
        results = [bench_single(base, int(s) * MiB, args.repeat)
                   for s in args.sizes.split(",") if s]
        batches = [bench_batch(base, int(s) * KiB, args.repeat)
                   for s in args.batch_sizes.split(",") if s]
    print(json.dumps({
        "benchmark": "store",
        "goal": {"verified_read_vs_raw_read": 0.9, "commit_vs_raw_write": 0.8,
                 "batch_commit_vs_raw": 0.8},
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "results": results,
        "batches": batches,
    }, indent=2))


if __name__ == "__main__":
    main()
