"""Garbage collection: what a store may delete, and in which order.

* ``clean_released``: every released entry (except those held for a remote delete);
* ``evict``: released entries first, then least recently used, down to the low
  watermark (90% of the maximum);
* ``delete_entries``: the one deletion sequence every path uses, manifests first, then
  catalog rows, then the objects no remaining entry references, so a concurrent reader
  sees either the whole entry or a clean miss and a crash at any point leaves nothing
  visible that is incomplete (leftover objects are orphans, see ``recovery``);
* ``clean_tmp``: temp files whose writer is dead (or that are too old to be in flight).

Locking is the caller's job: ``Store`` holds the exclusive maintenance lock around every
method here except ``clean_tmp`` (temp files of live writers are never touched, so it
needs no lock). Results are ``DeleteReport`` data; ``dry_run`` plans without deleting.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .fsio import fsync_dir, unlink_many

if TYPE_CHECKING:
    from .store import Store

LOW_WATERMARK = 0.9
DELETE_BATCH = 1000
DEFAULT_ORPHAN_AGE = 3600.0
LIVE_WRITER_GRACE = 3600.0
_TMP_RE = re.compile(r"([0-9]+)-[0-9a-f]{16}\.part")


@dataclass
class DeleteReport:
    """What a maintenance pass deleted (or would delete, under ``dry_run``)."""

    entries: int = 0
    objects: int = 0
    bytes: int = 0
    files: int = 0
    dry_run: bool = False
    entry_ids: list[str] = field(default_factory=list)

    def add(self, other: DeleteReport) -> None:
        self.entries += other.entries
        self.objects += other.objects
        self.bytes += other.bytes
        self.files += other.files
        self.entry_ids.extend(other.entry_ids)

    def to_json(self) -> dict:
        return {
            "entries": self.entries, "objects": self.objects, "bytes": self.bytes,
            "files": self.files, "dry_run": self.dry_run,
        }


class GarbageCollector:
    """Deletions on one store (see the module docstring); the caller holds the lock."""

    def __init__(self, store: Store):
        self._store = store

    def clean_released(self, dry_run: bool) -> DeleteReport:
        catalog = self._store.catalog
        report = DeleteReport(dry_run=dry_run)
        if dry_run:
            rows = catalog.list(hint="release", sort="age", skip_held=True)
            report.entries = len(rows)
            report.bytes = sum(r.size for r in rows)
            report.entry_ids = [r.entry_id for r in rows]
            return report
        # Id order: each batch touches few manifest fan-out dirs, so it needs few
        # directory fsyncs (10k released entries: ~256 instead of ~2,500).
        while rows := catalog.list(hint="release", sort="id", limit=DELETE_BATCH,
                                   skip_held=True):
            report.add(self.delete_entries([r.entry_id for r in rows], "clean"))
        return report

    def delete_if_released(self, entry_ids: list[str]) -> DeleteReport:
        """Delete those of ``entry_ids`` that are still released."""
        catalog = self._store.catalog
        doomed = [e for e in entry_ids
                  if (row := catalog.get(e)) is not None and row.hint == "release"]
        return self.delete_entries(doomed, "clean") if doomed else DeleteReport()

    def evict(self, dry_run: bool, budget: int | None) -> DeleteReport:
        """Down to the low watermark if over the maximum; at most ``budget`` entries."""
        max_bytes = self._store.max_bytes
        catalog = self._store.catalog
        report = DeleteReport(dry_run=dry_run)
        if max_bytes is None:
            return report
        total = catalog.totals().bytes
        if total <= max_bytes:
            return report
        target = int(max_bytes * LOW_WATERMARK)
        remaining = budget if budget is not None else 1 << 62
        if dry_run:
            for entry_id, _hint in catalog.eviction_order(min(remaining, 1 << 20)):
                if total <= target:
                    break
                row = catalog.get(entry_id)
                total -= row.size if row else 0
                report.entries += 1
                report.bytes += row.size if row else 0
                report.entry_ids.append(entry_id)
            return report
        while total > target and remaining > 0:
            batch, estimate = [], 0
            for entry_id, _hint in catalog.eviction_order(min(remaining, DELETE_BATCH)):
                row = catalog.get(entry_id)
                batch.append(entry_id)
                estimate += row.size if row else 0
                if total - estimate <= target:
                    break
            if not batch:
                break
            report.add(self.delete_entries(batch, "evict"))
            remaining -= len(batch)
            total = catalog.totals().bytes
        return report

    def delete_entries(self, entry_ids: list[str], step: str) -> DeleteReport:
        """Delete entries: manifests, then catalog rows, then freed objects.

        ``step`` ("clean" or "evict") names the crash checkpoints passed on the way.
        """
        store = self._store
        layout = store.layout
        report = DeleteReport(entries=len(entry_ids), entry_ids=list(entry_ids))
        dirs: set[Path] = set()
        paths = [layout.manifest_path(entry_id) for entry_id in entry_ids]
        for path, size in zip(paths, unlink_many(paths), strict=True):  # concurrent (fsio)
            if size is not None:
                report.bytes += size
                dirs.add(path.parent)
            store.checkpoint(f"{step}.manifest_deleted")
        for d in dirs:
            fsync_dir(d)
        freed = store.catalog.delete_entries(entry_ids)
        store.checkpoint(f"{step}.catalog_deleted")
        paths = [layout.object_path(digest) for digest, _size in freed]
        for (_digest, size), gone in zip(freed, unlink_many(paths), strict=True):
            if gone is not None:
                report.objects += 1
                report.bytes += size
            store.checkpoint(f"{step}.object_deleted")
        # No fsync of the object directories: an object unlink lost in a crash leaves an
        # unreferenced object, which orphan collection reclaims (the catalog deletion above
        # is already durable). This halves the directory fsyncs of every deletion batch.
        return report


def clean_tmp(tmp_dir: Path, *, min_age: float, dry_run: bool) -> DeleteReport:
    """Delete temp files whose writer is dead, or that are older than ``min_age`` seconds
    and whose writer is not a live process of this host.

    A temp file of a live writer is kept unless it is older than an hour (a real write
    takes seconds; only a reused pid can be that old), so ``min_age=0`` never breaks a
    commit in flight.
    """
    report = DeleteReport(dry_run=dry_run)
    now = time.time()
    for e in os.scandir(tmp_dir):
        m = _TMP_RE.fullmatch(e.name)
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        writer = int(m.group(1)) if m else None
        alive = writer is None or writer == os.getpid() or pid_alive(writer)
        age = now - st.st_mtime
        if alive and age < max(min_age, LIVE_WRITER_GRACE):
            continue
        report.files += 1
        report.bytes += st.st_size
        if not dry_run:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(e.path)
    return report


def tmp_usage(tmp_dir: Path) -> tuple[int, int]:
    """(files, bytes) under ``tmp_dir``."""
    files = size = 0
    for e in os.scandir(tmp_dir):
        with contextlib.suppress(FileNotFoundError):
            size += e.stat(follow_symlinks=False).st_size
            files += 1
    return files, size


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
