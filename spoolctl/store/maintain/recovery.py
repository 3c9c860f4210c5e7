"""Recovery: bringing the catalog back in line with the manifests (the truth) on disk.

* ``index_all``: fill an empty catalog from every manifest (a rebuild);
* ``resolve_pending``: finish or roll back commits a crash interrupted;
* ``reconcile``: index missing manifests, drop rows whose manifest is gone, delete old
  unreferenced objects, report files that do not belong;
* ``readmit``: move a quarantined entry back once it verifies again.

A manifest that does not decode is quarantined on the way. A directory that cannot be
read is reported (``ReconcileReport.unreadable``) and nothing under it is taken for gone.
The caller holds the maintenance lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import CorruptionError, ManifestError, NotFoundError, QuarantineReason, RootError
from ..catalog.rows import parse_index, valid_facts
from ..disk import dirfd
from ..disk.fsio import (
    SpecialFileError,
    describe_os_error,
    in_page_cache,
    prefetch,
    read_manifest,
    read_manifest_sized,
)
from ..disk.root import FEATURE_HINTS_LOG, KNOWN_TOP, read_marker
from ..disk.verify import classify, verify_object
from ..format import clocks
from ..format.manifest import Manifest
from .gc import DeleteReport, GarbageCollector

if TYPE_CHECKING:
    from ..catalog.index import Catalog
    from ..context import PartContext
    from ..disk.publish import Publisher
    from .quarantine import QuarantineItem

_OBJ_RE = re.compile(r"[0-9a-f]{64}\.obj")
_MAN_RE = re.compile(r"[0-9a-f]{64}\.json")
# Fan-out directories a rebuild asks into the page cache ahead of the one it reads: reads
# of a cold store wait on the disk, and a few in flight keep it busy.
REBUILD_AHEAD = 1
# Files of a fan-out directory looked at first: all in the page cache -> no prefetch.
PREFETCH_SAMPLE = 3


@dataclass
class ReconcileReport:
    """What ``collect_orphans`` found and did."""

    indexed: int = 0
    dropped_rows: int = 0
    quarantined: int = 0
    orphan_objects: DeleteReport = field(default_factory=DeleteReport)
    young_orphans: int = 0
    unknown_files: list[str] = field(default_factory=list)
    repaired_rows: int = 0
    unreadable: dict[str, str] = field(default_factory=dict)  # directory -> reason

    def to_json(self) -> dict[str, Any]:
        return {
            "indexed": self.indexed, "dropped_rows": self.dropped_rows,
            "quarantined": self.quarantined, "orphans": self.orphan_objects.to_json(),
            "young_orphans": self.young_orphans, "unknown_files": self.unknown_files[:100],
            "repaired_rows": self.repaired_rows, "unreadable": dict(self.unreadable),
        }


class Recovery:
    """Repairs of one store (see the module docstring); the caller holds the lock."""

    def __init__(self, ctx: PartContext, gc: GarbageCollector):
        self._ctx = ctx
        self._gc = gc

    # -- walking the manifests ---------------------------------------------------------

    def manifest_files(self, unreadable: dict[str, str] | None = None) -> Iterator[Path]:
        """Every well-named file (regular or not) under ``manifests/<aa>/``, in fan-out
        order; a directory that cannot be read is added to ``unreadable`` and skipped."""
        unreadable = {} if unreadable is None else unreadable
        for fan in _scan(self._ctx.layout.manifests, unreadable, sort=True):
            if fan.is_dir(follow_symlinks=False):
                for e in _manifest_entries(Path(fan.path), unreadable):
                    yield Path(e.path)

    def has_manifests(self) -> bool:
        for fan in _scan(self._ctx.layout.manifests, {}):
            if fan.is_dir(follow_symlinks=False) and \
                    any(_MAN_RE.fullmatch(e.name) for e in _scan(Path(fan.path), {})):
                return True
        return False

    def decode_found(self, path: Path) -> Manifest | None:
        """Decode a manifest found by a scan; quarantine it (and return None) if bad."""
        try:
            return read_manifest(path, path.name[:-5])
        except (ManifestError, SpecialFileError, FileNotFoundError) as exc:
            self._quarantine_undecodable(path, exc)
            return None

    def _quarantine_undecodable(self, path: Path, exc: OSError | ManifestError) -> None:
        """Quarantine the manifest at ``path`` that failed with ``exc`` (nothing if it is
        simply gone)."""
        if isinstance(exc, FileNotFoundError):
            return
        if isinstance(exc, SpecialFileError):
            exc = ManifestError(f"manifest is not a regular file ({exc.kind})",
                                reason=QuarantineReason.MANIFEST_IO, path=path)
        assert isinstance(exc, ManifestError)
        self._ctx.quarantine.files(path.name[:-5], exc.reason, exc.message,
                                   [(path, "manifest")])

    # -- repairs -----------------------------------------------------------------------

    def index_all(self, catalog: Catalog) -> int:
        """Index every valid manifest on disk into ``catalog``, replacing what it holds, in
        one transaction; return how many were indexed. Undecodable manifests are
        quarantined; hints come from the hint log where the marker requires it.
        The next fan-outs are prefetched; decoding stays on this thread (helper threads
        contend for the interpreter lock)."""
        return catalog.load(self._decoded(), hints=self._kept_hints(catalog))

    def _kept_hints(self, catalog: Catalog) -> dict[str, str]:
        try:
            kept = FEATURE_HINTS_LOG in read_marker(self._ctx.layout).requires
        except RootError:
            kept = False
        return catalog.hints.read() if kept else {}

    def _decoded(self) -> Iterator[list[tuple[Manifest, int]]]:
        """(manifest, size) of every valid manifest, a fan-out directory per batch."""
        fans = [Path(f.path) for f in _scan(self._ctx.layout.manifests, {}, sort=True)
                if f.is_dir(follow_symlinks=False)]
        ahead = [_prefetch_fan(fan) for fan in fans[:REBUILD_AHEAD + 1]]
        for i in range(len(fans)):
            found = ahead.pop(0)
            if i + REBUILD_AHEAD + 1 < len(fans):
                ahead.append(_prefetch_fan(fans[i + REBUILD_AHEAD + 1]))
            batch: list[tuple[Manifest, int]] = []
            for path, result in _read_fan(found):
                if isinstance(result, tuple):
                    batch.append(result)
                else:
                    self._quarantine_undecodable(Path(path), result)
            yield batch

    def resolve_pending(self) -> None:
        """Finish or roll back commits interrupted by a crash."""
        ctx = self._ctx
        pending: list[str] = ctx.catalog().pending()
        for entry_id in pending:
            path = ctx.layout.manifest_path(entry_id)
            manifest = self.decode_found(path) if path.exists() else None
            if manifest is not None:
                ctx.catalog().mark_committed(entry_id, manifest.supersedes)
            else:
                self._gc.delete_entries([entry_id], "clean")

    def reconcile(self, min_age: float, dry_run: bool) -> ReconcileReport:
        ctx = self._ctx
        catalog, layout = ctx.catalog(), ctx.layout
        report = ReconcileReport()
        report.orphan_objects.dry_run = dry_run
        if not dry_run:
            self.resolve_pending()
        indexed = catalog.all_entry_ids()
        on_disk: set[str] = set()
        for path in self.manifest_files(report.unreadable):
            entry_id = path.name[:-5]
            on_disk.add(entry_id)
            if entry_id in indexed or dry_run:
                continue
            manifest = self.decode_found(path)
            if manifest is None:
                report.quarantined += 1
            else:
                catalog.index_manifest(manifest, path.lstat().st_size)
                report.indexed += 1
        report.unknown_files += self._unknown_in(layout.manifests, _MAN_RE)
        # A manifest fan-out that could not be listed hides its entries: never take them
        # for gone (that would drop their rows and delete their objects).
        hidden = {Path(p).name for p in report.unreadable if Path(p).parent == layout.manifests}
        hidden_all = str(layout.manifests) in report.unreadable
        gone = sorted(e for e in indexed - on_disk
                      if not hidden_all and (not isinstance(e, str) or e[:2] not in hidden))
        if gone and not dry_run:
            freed: list[tuple[str, int]] = catalog.delete_entries(gone)
            for digest, _size in freed:
                with contextlib.suppress(OSError):  # left an orphan: reclaimed below or later
                    dirfd.unlink(layout.object_path(digest))
        report.dropped_rows = len(gone)
        if not dry_run:
            report.repaired_rows = self.repair_rows()
        self._collect_objects(report, catalog.all_digests(), min_age, dry_run)
        report.unknown_files += self._unknown_in(layout.objects, _OBJ_RE)
        return report

    def _collect_objects(self, report: ReconcileReport, known: set[str], min_age: float,
                         dry_run: bool) -> None:
        """Delete unreferenced objects older than ``min_age`` (count the younger ones)."""
        now = time.time()
        for fan in _scan(self._ctx.layout.objects, report.unreadable):
            if not fan.is_dir(follow_symlinks=False):
                continue
            # Listed and unlinked through the fan-out's descriptor: one swapped for a
            # symlink after the listing never turns an unlink into one elsewhere.
            try:
                fd = dirfd.open_dir(fan.path)
            except OSError as exc:
                report.unreadable[fan.path] = describe_os_error(exc)
                continue
            try:
                self._collect_fan(fd, fan.path, report, known, now, min_age, dry_run)
            finally:
                os.close(fd)

    @staticmethod
    def _collect_fan(fd: int, fan: str, report: ReconcileReport, known: set[str],
                     now: float, min_age: float, dry_run: bool) -> None:
        """``_collect_objects`` for the fan-out directory open at ``fd``."""
        try:
            found = dirfd.listing(fd)
        except OSError as exc:
            report.unreadable[fan] = describe_os_error(exc)
            return
        for e in found:
            if not _OBJ_RE.fullmatch(e.name) or e.name[:-4] in known:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if clocks.age(st.st_mtime, now) < min_age:  # a future mtime protects nothing
                report.young_orphans += 1
                continue
            if not dry_run:
                try:
                    os.unlink(e.name, dir_fd=fd)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    report.orphan_objects.failed[os.path.join(fan, e.name)] = \
                        describe_os_error(exc)
                    continue
            report.orphan_objects.objects += 1
            report.orphan_objects.bytes += st.st_size

    def repair_rows(self, limit: int = 10_000) -> int:
        """Re-index malformed catalog rows from their manifests, keeping the well-formed
        catalog-only facts; drop rows whose manifest is gone. Returns how many rows were
        repaired or dropped."""
        ctx = self._ctx
        catalog = ctx.catalog()
        done = 0
        malformed: list[tuple[Any, str]] = catalog.malformed(limit)
        for entry_id, _why in malformed:
            raw = catalog.raw_row(entry_id)
            named = isinstance(entry_id, str) and _MAN_RE.fullmatch(f"{entry_id}.json")
            path = ctx.layout.manifests / str(entry_id)[:2] / f"{entry_id}.json"
            manifest = self.decode_found(path) if named and os.path.lexists(path) else None
            if manifest is None:
                catalog.delete_entries([entry_id])  # no manifest: nothing to keep
                done += 1
                continue
            hint, index_json = raw if raw else ("retain", None)
            try:
                kept = parse_index(index_json)
            except ValueError:
                loaded = None
                with contextlib.suppress(ValueError, TypeError, RecursionError):
                    loaded = json.loads(index_json) if isinstance(index_json, str) else None
                if isinstance(loaded, dict):
                    kept = valid_facts(loaded)
                else:
                    # The catalog-only facts are lost (a remote delete may be owed): keep
                    # the entry retained, so nothing is deleted on a guess; an expiring
                    # record is settled by its owner once it has expired.
                    kept, hint = {}, "retain"
            catalog.index_manifest(manifest, path.lstat().st_size,
                                   hint=hint if hint in ("retain", "release") else "retain",
                                   last_access=time.time(),
                                   index={**dict(manifest.index), **kept})
            done += 1
        return done

    def readmit(self, item: QuarantineItem, entry_id: str, publisher: Publisher) -> Manifest:
        """Move a quarantined entry back if its manifest and every object verify now:
        objects first, then the manifest (as a commit does). CorruptionError or
        NotFoundError (nothing moved) otherwise. The caller holds the maintenance lock
        shared and removes the item after."""
        layout = self._ctx.layout
        src = item.path / f"{entry_id}.json"
        purge = f"purge it with `spoolctl quarantine purge {item.item_id} --yes`"
        try:
            manifest = read_manifest(src, entry_id)
        except FileNotFoundError:
            raise CorruptionError("the item has no manifest to restore",
                                  reason=QuarantineReason.MANIFEST_IO, path=src,
                                  fix=purge) from None
        except OSError as exc:
            raise CorruptionError(f"the item's manifest is unreadable: {describe_os_error(exc)}",
                                  reason=QuarantineReason.MANIFEST_IO, path=src,
                                  fix=purge) from None
        moves = []
        for ref in manifest.objects:
            in_item = item.path / f"{ref.digest}.obj"
            in_store = layout.object_path(ref.digest)
            candidate = in_item if os.path.lexists(in_item) else in_store
            try:
                verify_object(candidate, digest=ref.digest, size=ref.size)
            except (OSError, CorruptionError) as exc:
                failure = classify(exc, ref.name)
                if failure.missing:
                    # Orphan collection reclaimed a healthy sibling after the quarantine (only
                    # the bad object is kept as evidence): the entry cannot come back whole.
                    raise NotFoundError(
                        f"entry {entry_id[:16]} can no longer be restored: its object "
                        f"{ref.name} was reclaimed after the entry was quarantined",
                        fix=purge) from None
                if failure.reason is None:  # not damage: it may verify once it can be read
                    raise CorruptionError(f"{failure.detail}; cannot be read",
                                          reason=QuarantineReason.PAYLOAD_MISSING,
                                          path=candidate, fix="fix its permissions "
                                          "(`spoolctl doctor`) and retry") from None
                raise CorruptionError(f"{failure.detail} (still fails)",
                                      reason=failure.reason, path=candidate, fix=purge) from None
            if candidate == in_item:
                moves.append((in_item, in_store))
        for a, b in moves:
            publisher.publish(a, b, what=None)
        final = layout.manifest_path(entry_id)
        publisher.publish(src, final, what=None)
        self._ctx.catalog().index_manifest(manifest, final.stat().st_size,
                                           last_access=time.time())
        return manifest

    # -- files that do not belong --------------------------------------------------------

    @staticmethod
    def _unknown_in(parent: Path, pattern: re.Pattern[str]) -> list[str]:
        out = []
        for fan in _scan(parent, {}):
            if not fan.is_dir(follow_symlinks=False) or len(fan.name) != 2:
                out.append(fan.path)
                continue
            for e in _scan(Path(fan.path), {}):
                if not pattern.fullmatch(e.name) or not e.name.startswith(fan.name) or \
                        not e.is_file(follow_symlinks=False):
                    out.append(e.path)
        return out

    def unknown_top_level(self) -> list[str]:
        return sorted(name for name in dirfd.listdir(self._ctx.root) if name not in KNOWN_TOP)


def _prefetch_fan(fan: Path) -> list[dirfd.DirEntryLike]:
    """The well-named manifest files of fan-out ``fan``, each asked into the page cache
    unless a sample of them is there already."""
    found = _manifest_entries(fan, {})
    if all(in_page_cache(e.path) for e in found[:PREFETCH_SAMPLE]):
        return found
    for e in found:
        prefetch(e.path)
    return found


def _read_fan(found: list[dirfd.DirEntryLike]
              ) -> Iterator[tuple[str, tuple[Manifest, int] | OSError | ManifestError]]:
    """Read and decode the manifest files ``found``: (path, (manifest, size)) or (path,
    the error to quarantine it for)."""
    for e in found:
        # the entry's own path string: a Path per manifest costs ~10% of a warm rebuild
        try:
            yield e.path, read_manifest_sized(e.path, e.name[:-5])
        except (ManifestError, SpecialFileError, FileNotFoundError) as exc:
            yield e.path, exc


def _manifest_entries(fan: Path, unreadable: dict[str, str]) -> list[dirfd.DirEntryLike]:
    """The well-named files of the manifest fan-out directory ``fan`` (regular or not;
    never a directory or a symlink); ``unreadable`` as for ``_scan``."""
    return [e for e in _scan(fan, unreadable) if _MAN_RE.fullmatch(e.name)
            and not e.is_dir(follow_symlinks=False) and not e.is_symlink()]


def _scan(directory: Path, unreadable: dict[str, str], *,
          sort: bool = False) -> list[dirfd.DirEntryLike]:
    """The entries of ``directory``; [] (and ``unreadable[directory] = reason``) if it
    cannot be listed."""
    try:
        found = dirfd.scandir(directory)
    except FileNotFoundError:
        return []
    except OSError as exc:
        unreadable[str(directory)] = describe_os_error(exc)
        return []
    return sorted(found, key=lambda e: e.name) if sort else found
