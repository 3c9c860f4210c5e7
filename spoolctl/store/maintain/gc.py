"""Garbage collection: what a store may delete, and in which order.

* ``clean_released``: every released entry not held for a remote delete, in pipelined
  batches;
* ``evict``: released entries first, then least recently used, down to the low watermark;
* ``delete_entries``: the one deletion order: manifests, then catalog rows, then the
  objects no entry references, so a reader sees the whole entry or a clean miss and a
  crash leaves only orphan objects (``recovery`` reclaims them);
* ``clean_tmp``: temp files whose writer is dead (or too old to be in flight).

A file that cannot be deleted is counted in ``DeleteReport.failed`` and its entry kept.
The caller holds the maintenance lock (``clean_tmp`` needs none: it never touches a live
writer's file). ``dry_run`` plans without deleting.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..capacity import low_watermark
from ..disk import (
    dirfd,
    faults,
    progress,
)
from ..disk.fsio import describe_os_error, fsync_dir, tmp_writer, unlink_many
from ..disk.sqlite_files import no_space
from ..format import clocks

if TYPE_CHECKING:
    from ..catalog.index import Catalog
    from ..context import PartContext

DELETE_BATCH = 1000
DEFAULT_ORPHAN_AGE = 3600.0
LIVE_WRITER_GRACE = 3600.0
log = logging.getLogger("spoolctl.store")


@dataclass
class DeleteReport:
    """What a maintenance pass deleted (or would delete, under ``dry_run``)."""

    entries: int = 0
    objects: int = 0
    bytes: int = 0
    files: int = 0
    dry_run: bool = False
    entry_ids: list[str] = field(default_factory=list)
    # files that could not be deleted (path: reason), e.g. a directory without write access
    failed: dict[str, str] = field(default_factory=dict)

    def add(self, other: DeleteReport) -> None:
        self.entries += other.entries
        self.objects += other.objects
        self.bytes += other.bytes
        self.files += other.files
        self.entry_ids.extend(other.entry_ids)
        self.failed.update(other.failed)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "entries": self.entries, "objects": self.objects, "bytes": self.bytes,
            "files": self.files, "dry_run": self.dry_run,
        }
        if self.failed:
            doc["failed"] = len(self.failed)
            doc["failed_paths"] = dict(list(self.failed.items())[:20])
        return doc


class GarbageCollector:
    """Deletions on one store (see the module docstring); the caller holds the lock."""

    def __init__(self, ctx: PartContext):
        self._ctx = ctx
        # This thread's pass's directory descriptors: every unlink goes through one, so a
        # directory swapped for a link meanwhile is never followed.
        self._local = threading.local()

    @contextlib.contextmanager
    def _pass(self) -> Iterator[dirfd.DirFds]:
        """Directory descriptors for one deletion pass, closed when it ends."""
        if getattr(self._local, "dirs", None) is not None:
            yield self._local.dirs  # nested: one set for the pass
            return
        with dirfd.DirFds() as dirs:
            self._local.dirs = dirs
            try:
                yield dirs
            finally:
                self._local.dirs = None

    def planned(self, entry_ids: list[str], before: set[str] | None = None) -> DeleteReport:
        """What deleting ``entry_ids`` frees (a dry run): their manifests and the objects
        no other entry references. ``before``: entries an earlier step of the same plan
        deletes (not counted again)."""
        catalog = self._ctx.catalog()
        freed = catalog.freed_by(entry_ids, before)
        sizes = catalog.manifest_sizes(entry_ids)
        return DeleteReport(entries=len(entry_ids), objects=len(freed),
                            bytes=sum(sizes.values()) + sum(size for _, size in freed),
                            dry_run=True, entry_ids=list(entry_ids))

    def clean_released(self, dry_run: bool, also: Iterable[str] = ()) -> DeleteReport:
        catalog = self._ctx.catalog()
        report = DeleteReport(dry_run=dry_run)
        if dry_run:  # exactly what the run below deletes
            ids = [r.entry_id for r in catalog.list(hint="release", sort="age", skip_held=True)]
            extra = set(also) - set(ids)
            if extra:  # entries the same clean releases first (``clean --superseded``)
                ids += [r.entry_id for r in catalog.list(skip_held=True)
                        if r.entry_id in extra and r.hint == "retain"]
            return self.planned(ids)
        # Id order: each batch touches few fan-out dirs, so needs few directory fsyncs.
        # Pipelined: a batch's rows are deleted (waiting on SQLite) while the next batch's
        # manifests and the previous batch's objects are unlinked (waiting on the journal);
        # each entry still goes manifest, row, objects.
        with catalog.background_checkpoints(), self._pass():
            page: list[tuple[str, int]] = catalog.released_page("", DELETE_BATCH)
            manifests = self._start_manifests(page)
            objects: _Unlinking | None = None
            try:
                while manifests is not None:
                    full = len(page) == DELETE_BATCH
                    page = catalog.released_page(page[-1][0], DELETE_BATCH) if full else []
                    upcoming = self._start_manifests(page)
                    deleted = self._finish_manifests(manifests, report, "clean")
                    manifests = upcoming
                    unlinking = self._drop_rows(deleted, report, "clean")
                    if objects is not None:
                        self._finish_objects(objects, report, "clean")
                    objects = unlinking
            except BaseException:
                # What is in flight still completes (a manifest unlinked without its row
                # deleted is a clean miss: the next pass or reconcile drops the row).
                for pending in (manifests, objects):
                    if pending is not None:
                        pending.drain()
                raise
            if objects is not None:
                self._finish_objects(objects, report, "clean")
        self._log_failed(report)
        return report

    def _start_manifests(self, page: list[tuple[str, int]]) -> _Unlinking | None:
        """Start unlinking the manifests of ``page`` ((entry id, manifest size) rows)."""
        if not page:
            return None
        return _Unlinking.start(page, [self._ctx.layout.manifest_path(entry_id)
                                       for entry_id, _ in page], self._live_dirs())

    def _live_dirs(self) -> dirfd.DirFds:
        dirs: dirfd.DirFds | None = getattr(self._local, "dirs", None)
        if dirs is None:
            raise RuntimeError("unlinks outside a deletion pass")  # a programming error
        return dirs

    def delete_if_released(self, entry_ids: list[str]) -> DeleteReport:
        """Delete those of ``entry_ids`` that are still released."""
        catalog = self._ctx.catalog()
        doomed = [e for e in entry_ids
                  if (row := catalog.get(e)) is not None and row.hint == "release"]
        return self.delete_entries(doomed, "clean") if doomed else DeleteReport()

    def evict(self, dry_run: bool, budget: int | None,
              before: Iterable[str] = ()) -> DeleteReport:
        """Down to the low watermark if over the maximum; at most ``budget`` entries.
        ``before`` (dry run only): entries an earlier step of the same plan deletes."""
        max_bytes = self._ctx.limits.max_bytes
        catalog = self._ctx.catalog()
        report = DeleteReport(dry_run=dry_run)
        if max_bytes is None:
            return report
        total = catalog.totals().bytes
        if dry_run:
            return self._plan_evict(total, max_bytes, budget, set(before))
        if total <= max_bytes:
            return report
        if not dry_run:
            # no LRU rank from a clock that ran ahead
            catalog.clamp_future_access(self._ctx.clock())
        target = low_watermark(max_bytes)
        remaining = budget if budget is not None else 1 << 62
        while total > target and remaining > 0:
            batch: list[str] = []
            estimate = 0
            order: list[tuple[str, str]] = catalog.eviction_order(min(remaining, DELETE_BATCH))
            for entry_id, _hint in order:
                row = catalog.get(entry_id)
                batch.append(entry_id)
                estimate += row.size if row else 0
                if total - estimate <= target:
                    break
            if not batch:
                break
            done = self.delete_entries(batch, "evict")
            report.add(done)
            remaining -= len(batch)
            total = catalog.totals().bytes
            if not done.entry_ids:
                break  # nothing could be deleted (permissions): do not spin
        return report

    def _plan_evict(self, total: int, max_bytes: int, budget: int | None,
                    before: set[str]) -> DeleteReport:
        """The dry run of ``evict``: the same batches, chosen the same way, counted by
        ``planned`` instead of deleted."""
        catalog = self._ctx.catalog()
        report = DeleteReport(dry_run=True)
        total -= self.planned(list(before)).bytes if before else 0
        if total <= max_bytes:
            return report
        target = low_watermark(max_bytes)
        remaining = budget if budget is not None else 1 << 62
        doomed = set(before)
        order = (e for e in _eviction_order(catalog) if e not in doomed)
        while total > target and remaining > 0:
            want = min(remaining, DELETE_BATCH)
            batch: list[str] = []
            estimate = 0
            for entry_id in order:
                row = catalog.get(entry_id)
                batch.append(entry_id)
                estimate += row.size if row else 0
                if total - estimate <= target or len(batch) >= want:
                    break
            if not batch:
                break
            done = self.planned(batch, doomed)
            report.add(done)
            doomed.update(batch)
            remaining -= len(batch)
            total -= done.bytes
        report.dry_run = True
        return report

    def delete_entries(self, entry_ids: list[str], step: str) -> DeleteReport:
        """Delete entries: manifests, then catalog rows, then freed objects.

        ``step`` ("clean" or "evict") names the crash checkpoints passed on the way.
        """
        report = DeleteReport()
        sizes = self._ctx.catalog().manifest_sizes(entry_ids)
        with self._pass():
            manifests = self._start_manifests([(e, sizes.get(e, 0)) for e in entry_ids])
            deleted = ([] if manifests is None
                       else self._finish_manifests(manifests, report, step))
            objects = self._drop_rows(deleted, report, step)
            if objects is not None:
                self._finish_objects(objects, report, step)
        self._log_failed(report)
        return report

    def _finish_manifests(self, unlinking: _Unlinking, report: DeleteReport,
                          step: str) -> list[str]:
        """Wait for the manifest unlinks and fsync their directories; return the entries
        whose manifest is gone (one that could not be deleted keeps its entry whole)."""
        dirs: set[Path] = set()
        deleted: list[str] = []
        for (entry_id, size), path, gone in unlinking.results():
            if isinstance(gone, OSError):  # the entry stays whole: its row is kept too
                report.failed[str(path)] = describe_os_error(gone)
                continue
            deleted.append(entry_id)
            if gone:
                report.bytes += size  # the catalog's size: no stat
                dirs.add(path.parent)
            self._ctx.checkpoint(f"{step}.manifest_deleted")
        for d in dirs:
            fsync_dir(d)
        report.entries += len(deleted)
        report.entry_ids.extend(deleted)
        return deleted

    def _drop_rows(self, deleted: list[str], report: DeleteReport,
                   step: str) -> _Unlinking | None:
        """Delete the catalog rows of ``deleted``; return the unlinks of the objects no
        entry references any more, started and in flight (None if there are none)."""
        ctx = self._ctx
        chunk = max(len(deleted), 1)
        objects: _Unlinking | None = None
        while deleted:
            part = deleted[:chunk]
            try:
                freed: list[tuple[str, int]] = ctx.catalog().delete_entries(part)
            except sqlite3.OperationalError as exc:
                if not no_space(exc, ctx.catalog().path) or chunk == 1:
                    raise
                chunk = max(1, chunk // 16)  # smaller transactions need less journal space
                log.warning("disk full: deleting in batches of %d entries", chunk)
                continue
            deleted = deleted[len(part):]
            ctx.checkpoint(f"{step}.catalog_deleted")
            if objects is not None:  # a full disk: each part's objects go before the next
                self._finish_objects(objects, report, step)  # part is recorded
            objects = _Unlinking.start(freed, [ctx.layout.object_path(digest)
                                               for digest, _size in freed], self._live_dirs())
        # No fsync of the object directories: an object unlink lost in a crash leaves an
        # unreferenced object, which orphan collection reclaims (the catalog deletion above
        # is already durable). This halves the directory fsyncs of every deletion batch.
        return objects

    def _finish_objects(self, unlinking: _Unlinking, report: DeleteReport,
                        step: str) -> None:
        for (_digest, size), path, gone in unlinking.results():
            if isinstance(gone, OSError):
                report.failed[str(path)] = describe_os_error(gone)  # an orphan until fixed
            elif gone:
                report.objects += 1
                report.bytes += size
            self._ctx.checkpoint(f"{step}.object_deleted")

    @staticmethod
    def _log_failed(report: DeleteReport) -> None:
        if report.failed:
            log.warning("could not delete %d file(s), e.g. %s", len(report.failed),
                        next(iter(report.failed.items())))


def _eviction_order(catalog: Catalog) -> Iterator[str]:
    """Every entry id in eviction order, read in growing pages."""
    limit, seen = 4096, 0
    while True:
        rows: list[tuple[str, str]] = catalog.eviction_order(limit)
        for entry_id, _hint in rows[seen:]:
            yield entry_id
        if len(rows) < limit:
            return
        seen, limit = len(rows), limit * 4


@dataclass
class _Unlinking:
    """Files being unlinked (``unlink_many``), each with its catalog facts: (entry id,
    manifest size) for a manifest, (digest, size) for an object."""

    facts: list[tuple[str, int]]
    paths: list[Path]
    outcomes: Iterable[bool | OSError]

    @staticmethod
    def start(facts: list[tuple[str, int]], paths: list[Path],
              dirs: dirfd.DirFds) -> _Unlinking:
        """Start unlinking ``paths`` through ``dirs``, one per fact, in order."""
        return _Unlinking(facts, paths, unlink_many(paths, dirs))

    def results(self) -> Iterator[tuple[tuple[str, int], Path, bool | OSError]]:
        """(facts, path, outcome) per file, in order, each as its unlink completes."""
        return zip(self.facts, self.paths, self.outcomes, strict=True)

    def drain(self) -> None:
        """Wait for every unlink still in flight, whatever its outcome."""
        with contextlib.suppress(Exception):
            for _ in self.outcomes:
                pass


def clean_tmp(tmp_dir: Path, *, min_age: float, dry_run: bool,
              limit: int | None = None) -> DeleteReport:
    """Delete temp files whose writer is dead or that are older than ``min_age`` seconds;
    a live writer's file only past ``LIVE_WRITER_GRACE`` (only a reused pid is that old),
    so ``min_age=0`` never breaks a commit in flight. At most ``limit`` files are looked at.
    """
    report = DeleteReport(dry_run=dry_run)
    now = time.time()
    # Listed and unlinked through one descriptor of tmp/: a tmp/ swapped for a symlink
    # after the listing cannot turn an unlink into one outside the store.
    try:
        fd = dirfd.open_dir(tmp_dir)
    except OSError as exc:
        report.failed[str(tmp_dir)] = describe_os_error(exc)
        return report
    try:
        try:
            found = dirfd.listing(fd, limit)
        except OSError as exc:
            report.failed[str(tmp_dir)] = describe_os_error(exc)
            return report
        faults.checkpoint("tmp.listed")
        for n, e in enumerate(found, 1):
            _clean_tmp_entry(fd, e, os.path.join(tmp_dir, e.name), now, min_age, dry_run,
                             report)
            if n % 512 == 0:
                progress.tick()
    finally:
        os.close(fd)
    return report


def _clean_tmp_entry(fd: int, e: os.DirEntry[str], path: str, now: float, min_age: float,
                     dry_run: bool, report: DeleteReport) -> None:
    """``clean_tmp`` for one entry of the tmp/ directory open at ``fd``."""
    try:
        st = e.stat(follow_symlinks=False)
    except FileNotFoundError:
        return
    writer = tmp_writer(e.name)
    alive = writer is None or writer == os.getpid() or pid_alive(writer)
    age = clocks.age(st.st_mtime, now)  # a future mtime protects nothing
    if alive and age < max(min_age, LIVE_WRITER_GRACE):
        return
    if not dry_run:
        try:
            os.unlink(e.name, dir_fd=fd)
        except FileNotFoundError:
            return
        except OSError as exc:
            report.failed[path] = describe_os_error(exc)
            return
    report.files += 1
    report.bytes += st.st_size


# ``tmp_usage`` counts at most this many temp files: a healthy store holds a handful (one per
# write in flight), and a directory of millions must not make ``status`` look like a hung disk.
TMP_COUNT_LIMIT = 10_000


def tmp_usage(tmp_dir: Path, limit: int = TMP_COUNT_LIMIT) -> tuple[int, int, bool]:
    """(files, bytes, complete) of ``tmp_dir``, counting at most ``limit`` files: ``complete``
    is False when the listing stopped there (there are at least that many)."""
    files = size = 0
    with contextlib.suppress(OSError):  # an unreadable tmp/ is doctor's finding
        for e in dirfd.scandir(tmp_dir):
            if files >= limit:
                return files, size, False
            with contextlib.suppress(FileNotFoundError):
                size += e.stat(follow_symlinks=False).st_size
                files += 1
            if files % 512 == 0:
                progress.tick()
    return files, size, True


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
