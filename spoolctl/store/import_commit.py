"""Publish a batch of already-verified entries into a store (the import's one commit path).

``Store.put`` takes payload bytes and hashes them as it writes them. An import already
holds each object in the store's ``tmp/``, written and proven to match its digest while it
was read from the archive; copying and hashing it again would double the work. This module
commits such staged entries with the same protocol and the same guarantees as ``put``
(``docs/format.md``):

1. every staged object file is fsynced (concurrently: the filesystem merges the flushes);
2. objects are renamed into ``objects/`` and each touched fan-out directory is fsynced;
3. a pending catalog row (the intent) is recorded per entry;
4. manifests are written to ``tmp/``, fsynced, renamed into ``manifests/``, directories
   fsynced -- only now is any entry visible;
5. the rows are marked committed.

A crash at any step leaves each entry complete or invisible: objects without a manifest are
orphans reclaimed by age, pending rows are resolved by the store's recovery at the next
open, exactly as after an interrupted ``put``. All of it runs under the store's shared
maintenance lock, so no deletion runs in between.

This is the one function an import publishes through, so the store's group commit
(issue #19) can replace its body. It uses the store's maintenance lock and catalog directly
because it *is* a commit path of the store (like ``commit.Committer``); see decision 1601.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .errors import SpoolError
from .fsio import ensure_real_dirs, fsync_dir, full_fsync, io_error, open_for_read, tmp_name
from .manifest import Manifest, ObjectRef
from .store import Store

FILE_MODE = 0o600
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
FSYNC_WORKERS = 16
# Crash-test points of this path: faults.IMPORT_CHECKPOINTS (``SPOOLCTL_CRASH_AT``).


@dataclass
class StagedEntry:
    """One verified entry waiting to be published.

    ``data`` is the manifest envelope to write; ``staged`` maps the digests of objects this
    entry brought (files in the store's ``tmp/``, already verified) to their paths. Every
    other object the manifest names must already be in the store (or staged by an earlier
    entry of the same batch)."""

    manifest: Manifest
    data: bytes
    staged: dict[str, Path] = field(default_factory=dict)


def object_present(store: Store, ref: ObjectRef) -> bool:
    """True if the store holds a regular file of the right size for ``ref`` (cheap: lstat;
    its bytes are verified by every read and by scrub, like any stored object)."""
    try:
        st = os.lstat(store.layout.object_path(ref.digest))
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == ref.size


def write_tmp_unsynced(store: Store, data: bytes) -> Path:
    """A new private file in ``tmp/`` holding ``data`` (flushed later by ``publish_entries``)."""
    path = store.layout.tmp / tmp_name()
    ensure_real_dirs(store.root, store.layout.tmp)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
                 FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)
    return path


def _fsync_path(path: Path) -> None:
    fd = open_for_read(path)
    try:
        full_fsync(fd)
    finally:
        os.close(fd)


def _fsync_all(paths: Iterable[Path], pool: ThreadPoolExecutor) -> None:
    for f in [pool.submit(_fsync_path, p) for p in paths]:
        f.result()


def _fsync_dirs(dirs: Iterable[Path], pool: ThreadPoolExecutor) -> None:
    """Make the renames in ``dirs`` durable. Concurrently: the filesystem journal commits the
    concurrent flushes together instead of one commit per directory."""
    for f in [pool.submit(fsync_dir, d) for d in sorted(dirs)]:
        f.result()


def publish_entries(store: Store, batch: list[StagedEntry], *, synced: bool = False
                    ) -> dict[str, str]:
    """Commit ``batch`` (manifest-last, crash-safe); return each entry id's outcome:
    ``published``, ``present`` (a committed entry of that id already existed: the staged
    copy is dropped) or ``vanished`` (an object it relies on is no longer in the store).

    ``synced``: the caller already flushed every staged file to disk (step 1 is skipped).
    Staged files are consumed: moved into the store or deleted, also on error. Raises
    StoreIOError on a disk failure (entries whose manifest was not yet published stay
    invisible), BusyError if the maintenance lock cannot be taken.
    """
    staged = {d: p for e in batch for d, p in e.staged.items()}
    outcomes: dict[str, str] = {}
    try:
        if batch:
            store.run_with_catalog_repair(
                lambda: _publish_locked(store, batch, staged, outcomes, synced))
    finally:
        for path in staged.values():  # whatever was not moved into objects/
            with contextlib.suppress(OSError):
                os.unlink(path)
    return outcomes


def _publish_locked(store: Store, batch: list[StagedEntry], staged: dict[str, Path],
                    outcomes: dict[str, str], synced: bool) -> None:
    with store.maintenance(exclusive=False, what="importing entries"), \
            ThreadPoolExecutor(FSYNC_WORKERS, thread_name_prefix="spoolctl-import") as pool:
        todo: list[StagedEntry] = []
        for entry in batch:
            m = entry.manifest
            row = store.catalog.get(m.entry_id)
            if row is not None and row.state == "committed" and \
                    store.layout.manifest_path(m.entry_id).exists():
                outcomes[m.entry_id] = "present"
            elif all(r.digest in staged or object_present(store, r) for r in m.objects):
                todo.append(entry)
            else:
                outcomes[m.entry_id] = "vanished"
        needed = {r.digest for e in todo for r in e.manifest.objects if r.digest in staged}
        if not todo:
            return
        current = Path()
        try:
            if not synced:
                _fsync_all((staged[d] for d in sorted(needed)), pool)
            store.checkpoint("import.objects_fsynced")
            dirs: set[Path] = set()
            for digest in sorted(needed):
                current = store.layout.object_path(digest)
                ensure_real_dirs(store.root, current.parent)
                # A file already there under this name is replaced by the verified copy.
                os.replace(staged.pop(digest), current)
                dirs.add(current.parent)
                store.checkpoint("import.object_published")
            _fsync_dirs(dirs, pool)
        except OSError as exc:
            raise io_error(exc, "publishing imported objects", current) from exc
        _commit_manifests(store, todo, pool, outcomes)


def _commit_manifests(store: Store, todo: list[StagedEntry], pool: ThreadPoolExecutor,
                      outcomes: dict[str, str]) -> None:
    now = time.time()
    recorded: list[str] = []
    published: set[str] = set()
    tmps: list[Path] = []
    current = store.layout.tmp
    try:
        for entry in todo:
            store.catalog.record_intent(entry.manifest, len(entry.data), now)
            recorded.append(entry.manifest.entry_id)
        store.checkpoint("import.intents")
        for entry in todo:
            tmps.append(write_tmp_unsynced(store, entry.data))
        _fsync_all(tmps, pool)
        dirs: set[Path] = set()
        for entry, tmp in zip(todo, tmps, strict=True):
            current = store.layout.manifest_path(entry.manifest.entry_id)
            ensure_real_dirs(store.root, current.parent)
            os.replace(tmp, current)
            published.add(entry.manifest.entry_id)
            dirs.add(current.parent)
            store.checkpoint("import.manifest_published")
        _fsync_dirs(dirs, pool)
        for entry in todo:
            store.catalog.mark_committed(entry.manifest.entry_id, entry.manifest.supersedes)
            outcomes[entry.manifest.entry_id] = "published"
        store.checkpoint("import.committed")
    except (OSError, SpoolError, sqlite3.DatabaseError) as exc:
        # Roll back the intents of entries that never became visible (their objects become
        # orphans, reclaimed by age); a published manifest's pending row is resolved by
        # recovery, as after an interrupted put.
        with contextlib.suppress(sqlite3.DatabaseError):
            store.catalog.delete_entries([e for e in recorded if e not in published])
        for tmp in tmps:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(exc, OSError):
            raise io_error(exc, "publishing imported manifests", current) from exc
        raise
