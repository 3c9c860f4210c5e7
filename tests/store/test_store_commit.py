"""Commit, lookup, verified read, content addressing, hints and supersedes."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest
from page_cache import dirty_pages, skip_without_dirty_accounting

from spoolctl.store import (
    CorruptionError,
    InvalidIdError,
    Manifest,
    NotFoundError,
    Store,
)

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)


def _objects_on_disk(root: Path) -> list[Path]:
    return sorted((root / "objects").rglob("*.obj"))


def test_put_lookup_read_round_trip(store: Store) -> None:
    data = os.urandom(3 << 20)
    m = store.put(kind="pytorch", namespace="model-a", key="prefix-1",
                  objects={"kv": data, "ids": [b"1,2,", memoryview(b"3")]},
                  meta={"token_count": 3}, index={"elements": ["e1"]})
    assert isinstance(m, Manifest)
    hit = store.lookup("pytorch", "model-a", "prefix-1")
    assert hit is not None and hit.entry_id == m.entry_id
    assert bytes(store.read(hit, "kv")) == data
    assert bytes(store.read(hit, "ids")) == b"1,2,3"
    assert hit.meta["token_count"] == 3
    assert store.row(m.entry_id).index == {"elements": ["e1"]}
    assert store.lookup("pytorch", "model-b", "prefix-1") is None
    assert store.lookup("mlx", "model-a", "prefix-1") is None


def test_read_into_caller_buffer(store: Store) -> None:
    data = os.urandom(100_000)
    m = store.put(kind="vllm", namespace="ns", key="k", objects={"kv": data})
    buf = bytearray(len(data))
    view = store.read(m, "kv", into=memoryview(buf))
    assert bytes(view) == data and bytes(buf) == data


def test_identical_content_is_stored_once(store: Store, store_root: Path) -> None:
    blob = os.urandom(50_000)
    a = store.put(kind="vllm", namespace="ns", key="a", objects={"kv": blob})
    b = store.put(kind="vllm", namespace="ns", key="b", objects={"kv": blob})
    assert a.entry_id != b.entry_id
    assert a.objects[0].digest == b.objects[0].digest
    assert len(_objects_on_disk(store_root)) == 1
    assert store.totals().objects == 1


def test_collision_with_corrupt_existing_object_repairs_and_quarantines(
    store: Store, store_root: Path
) -> None:
    blob = os.urandom(10_000)
    first = store.put(kind="vllm", namespace="ns", key="a", objects={"kv": blob})
    path = store.layout.object_path(first.objects[0].digest)
    damaged = bytearray(path.read_bytes())
    damaged[100] ^= 0xFF
    path.write_bytes(bytes(damaged))
    second = store.put(kind="vllm", namespace="ns", key="b", objects={"kv": blob})
    assert bytes(store.read(second, "kv")) == blob  # repaired
    assert bytes(store.read(first, "kv")) == blob
    reasons = [item.reason for item in store.quarantine_items()]
    assert reasons == ["object_collision"]
    evidence = store.quarantine_items()[0].path / path.name
    assert evidence.read_bytes() == bytes(damaged)


def test_put_of_existing_key_returns_the_committed_entry(store: Store) -> None:
    m1 = store.put(kind="mlx", namespace="ns", key="k", objects={"a": b"one"})
    m2 = store.put(kind="mlx", namespace="ns", key="k", objects={"a": b"one"})
    assert m1 == m2
    assert store.totals().entries == 1


def test_release_removes_from_reuse_at_once_and_clean_deletes(store: Store, store_root) -> None:
    keep = store.put(kind="mlx", namespace="ns", key="keep", objects={"a": b"shared", "b": b"k"})
    gone = store.put(kind="mlx", namespace="ns", key="gone", objects={"a": b"shared", "b": b"g"})
    assert store.release(gone.entry_id)
    assert store.lookup("mlx", "ns", "gone") is None
    assert store.row(gone.entry_id).hint == "release"
    dry = store.clean_released(dry_run=True)
    assert dry.entries == 1 and store.row(gone.entry_id) is not None
    report = store.clean_released()
    assert report.entries == 1 and report.objects == 1  # the unshared "g" object only
    assert store.row(gone.entry_id) is None
    assert not store.layout.manifest_path(gone.entry_id).exists()
    assert bytes(store.read(keep, "a")) == b"shared"
    assert len(_objects_on_disk(store_root)) == 2
    with pytest.raises(NotFoundError):
        store.manifest(gone.entry_id)


def test_put_revives_a_released_entry(store: Store) -> None:
    m = store.put(kind="mlx", namespace="ns", key="k", objects={"a": b"x"})
    store.release(m.entry_id)
    store.put(kind="mlx", namespace="ns", key="k", objects={"a": b"x"})
    assert store.lookup("mlx", "ns", "k") is not None
    assert store.clean_released().entries == 0


def test_supersedes_records_and_releases_the_base(store: Store) -> None:
    base = store.put(kind="pytorch", namespace="ns", key="base", objects={"a": b"1"})
    new = store.put(kind="pytorch", namespace="ns", key="new", objects={"a": b"12"},
                    supersedes=base.entry_id)
    assert new.supersedes == base.entry_id
    assert store.row(new.entry_id).supersedes == base.entry_id
    assert store.row(base.entry_id).hint == "release"
    assert store.lookup("pytorch", "ns", "base") is None


_PATH_EVENTS = frozenset({"open", "os.rename", "os.remove", "os.mkdir", "os.rmdir",
                          "os.scandir", "os.listdir", "os.chmod", "os.truncate",
                          "sqlite3.connect", "shutil.rmtree"})
_recorders: list[tuple[str, list[tuple[str, str]]]] = []


def _audit(event: str, args: tuple) -> None:
    if not _recorders or event not in _PATH_EVENTS:
        return
    for arg in args:
        if isinstance(arg, (str, bytes, os.PathLike)):
            path = os.fsdecode(arg)
            for root, seen in _recorders:
                # A relative name is one opened or renamed through a directory descriptor
                # (store/disk/dirfd.py: the walk from / and every call under a root): counted.
                if path.startswith(root) or not os.path.isabs(path):
                    seen.append((event, path))


sys.addaudithook(_audit)  # hooks cannot be removed: it records only inside _disk_access


@contextlib.contextmanager
def _disk_access(root: Path):
    """Record every file-system call (open, rename, remove, mkdir, scandir...) on a path
    under ``root`` made inside the block, through Python's audit hooks."""
    seen: list[tuple[str, str]] = []
    entry = (str(root), seen)
    _recorders.append(entry)
    try:
        yield seen
    finally:
        _recorders.remove(entry)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


def test_disk_access_recorder_sees_a_commit(store: Store, store_root: Path) -> None:
    with _disk_access(store_root) as seen:
        store.put(kind="mlx", namespace="ns", key="k", objects={"a": b"x"})
    assert {"open", "os.rename"} <= {event for event, _ in seen}


def test_invalid_ids_are_refused_before_touching_disk(store: Store, store_root: Path) -> None:
    store.put(kind="mlx", namespace="ns", key="existing", objects={"a": b"x"})
    before = _tree(store_root)
    valid = {"ok": b"payload that would be written first"}
    with _disk_access(store_root) as seen:
        for bad in ("../../etc/passwd", "ABC", "g" * 64, "", "0" * 63):
            with pytest.raises(InvalidIdError):
                store.manifest(bad)
            with pytest.raises(InvalidIdError):
                store.release(bad)
        with pytest.raises(InvalidIdError):  # a valid object before the bad name
            store.put(kind="pytorch", namespace="ns", key="k", objects={**valid, "../x": b"1"})
        with pytest.raises(InvalidIdError):
            store.put(kind="nope", namespace="ns", key="k", objects=valid)
        with pytest.raises(InvalidIdError):
            store.put(kind="mlx", namespace="has space", key="k", objects=valid)
        with pytest.raises(InvalidIdError):
            store.put(kind="mlx", namespace="ns", key="k", objects=valid, supersedes="../x")
    assert seen == []  # not one open, scandir or rename under the root
    assert _tree(store_root) == before


def test_resolve_prefix(store: Store) -> None:
    m = store.put(kind="mlx", namespace="ns", key="k", objects={"a": b"x"})
    assert store.resolve(m.entry_id[:8]) == m.entry_id
    with pytest.raises(NotFoundError):
        store.resolve("0000" if not m.entry_id.startswith("0000") else "ffff")
    with pytest.raises(InvalidIdError):
        store.resolve("xyz!")


def test_verify_reports_healthy_entry(store: Store) -> None:
    m = store.put(kind="mlx", namespace="ns", key="k", objects={"a": b"x", "b": b"y"})
    assert store.verify(m.entry_id) == m
    with pytest.raises(NotFoundError):
        store.verify("f" * 64)
    # a corrupt entry is reported through CorruptionError
    path = store.layout.object_path(m.object("b").digest)
    path.write_bytes(b"z")
    with pytest.raises(CorruptionError):
        store.verify(m.entry_id)


def test_single_put_syncs_its_directories_without_a_hand_off(
        store: Store, store_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put's two directory fsyncs (its object's fan-out, then its manifest's) run on the
    caller's thread: a hand-off to the flush pool and back for one directory only adds
    thread switches to every commit (decision 2901). The real fsync still runs, in order."""
    import threading

    from spoolctl.store.commit import committer

    synced: list[tuple[str, int]] = []
    real = committer.fsync_dir

    def spy(path: Path) -> None:
        real(path)
        synced.append((Path(path).parent.name, threading.get_ident()))

    monkeypatch.setattr(committer, "fsync_dir", spy)
    m = store.put(kind="vllm", namespace="ns", key="one", objects={"kv": b"x" * 4096})
    assert [top for top, _ in synced] == ["objects", "manifests"]
    assert {ident for _, ident in synced} == {threading.get_ident()}
    assert (store_root / "manifests" / m.entry_id[:2] / f"{m.entry_id}.json").is_file()


@pytest.mark.parametrize("chunk_mib", [8, 0.25], ids=["one-chunk", "streamed"])
def test_a_large_plain_put_starts_write_back_before_its_fsync(
        store: Store, chunk_mib: float) -> None:
    """A plain payload of 4 MiB or more is written in 1 MiB pieces, each one's write-back
    started at once, so the disk works while the rest is written and the fsync finds little
    left (one 64 MiB write stalled in dirty-page throttling: 1.6-2.4x slower; decision 2951).
    Seen from the page cache at the commit's ``object.tmp_written`` checkpoint (written, not
    yet fsynced): almost nothing of the object is still dirty (before 2951, all of it was),
    whether it came in one chunk or streamed. The entry reads back whole."""

    size = 8 << 20
    pages = size // os.sysconf("SC_PAGE_SIZE")
    skip_without_dirty_accounting(store.layout.tmp, size)
    seen: list[int | None] = []

    def at(point: str) -> None:
        if point == "object.tmp_written":
            (path,) = (p for p in store.layout.tmp.iterdir() if p.stat().st_size == size)
            fd = os.open(path, os.O_RDONLY)
            try:
                seen.append(dirty_pages(fd, size))
            finally:
                os.close(fd)

    data = os.urandom(size)
    step = int(chunk_mib * (1 << 20))
    store.checkpoint = at
    m = store.put(kind="vllm", namespace="ns", key="big",
                  objects={"kv": [data[i:i + step] for i in range(0, size, step)]})
    assert seen and seen[0] is not None and seen[0] <= pages // 4, (seen, pages)
    assert bytes(store.read(m, "kv")) == data
