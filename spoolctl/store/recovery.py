"""Recovery: bringing the catalog back in line with the files on disk.

The manifests are the truth and the catalog is derived from them, so every repair walks
the manifests:

* ``index_all``: fill a new, empty catalog from every manifest (a rebuild; every hint
  comes back as retain, which loses nothing);
* ``resolve_pending``: finish or roll back commits a crash interrupted (a pending row
  whose manifest is durable is marked committed, any other is deleted);
* ``reconcile``: index manifests the catalog lacks, drop rows whose manifest is gone,
  delete objects no manifest references once they are older than a cutoff, and report
  files that do not belong in the store;
* ``readmit``: move a quarantined entry back once it verifies again.

A manifest that does not decode is quarantined on the way. Locking is the caller's job:
``Store`` holds the exclusive maintenance lock around each of these.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import CorruptionError, ManifestError, QuarantineReason
from .fsio import read_manifest, read_verified
from .gc import DeleteReport, GarbageCollector
from .manifest import Manifest
from .root import KNOWN_TOP

if TYPE_CHECKING:
    from .catalog import Catalog
    from .publish import Publisher
    from .quarantine import QuarantineItem
    from .store import Store

_OBJ_RE = re.compile(r"[0-9a-f]{64}\.obj")
_MAN_RE = re.compile(r"[0-9a-f]{64}\.json")


@dataclass
class ReconcileReport:
    """What ``collect_orphans`` found and did."""

    indexed: int = 0
    dropped_rows: int = 0
    quarantined: int = 0
    orphan_objects: DeleteReport = field(default_factory=DeleteReport)
    young_orphans: int = 0
    unknown_files: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "indexed": self.indexed, "dropped_rows": self.dropped_rows,
            "quarantined": self.quarantined, "orphans": self.orphan_objects.to_json(),
            "young_orphans": self.young_orphans, "unknown_files": self.unknown_files[:100],
        }


class Recovery:
    """Repairs of one store (see the module docstring); the caller holds the lock."""

    def __init__(self, store: Store, gc: GarbageCollector):
        self._store = store
        self._gc = gc

    # -- walking the manifests ---------------------------------------------------------

    def manifest_files(self) -> Iterator[Path]:
        """Every well-named regular file under ``manifests/<aa>/``, in fan-out order."""
        for fan in sorted(os.scandir(self._store.layout.manifests), key=lambda e: e.name):
            if not fan.is_dir(follow_symlinks=False):
                continue
            with os.scandir(fan.path) as it:
                for e in it:
                    if _MAN_RE.fullmatch(e.name) and e.is_file(follow_symlinks=False):
                        yield Path(e.path)

    def has_manifests(self) -> bool:
        for fan in os.scandir(self._store.layout.manifests):
            if fan.is_dir(follow_symlinks=False):
                with os.scandir(fan.path) as it:
                    if any(_MAN_RE.fullmatch(e.name) for e in it):
                        return True
        return False

    def decode_found(self, path: Path) -> Manifest | None:
        """Decode a manifest found by a scan; quarantine it (and return None) if bad."""
        entry_id = path.name[:-5]
        try:
            return read_manifest(path, entry_id)
        except ManifestError as exc:
            self._store.quarantine_files(entry_id, exc.reason, exc.message,
                                         [(path, "manifest")])
            return None
        except FileNotFoundError:
            return None

    # -- repairs -----------------------------------------------------------------------

    def index_all(self, catalog: Catalog) -> None:
        """Index every valid manifest on disk into ``catalog`` (a rebuild)."""
        for path in self.manifest_files():
            manifest = self.decode_found(path)
            if manifest is not None:
                catalog.index_manifest(manifest, path.stat().st_size)

    def resolve_pending(self) -> None:
        """Finish or roll back commits interrupted by a crash."""
        store = self._store
        for entry_id in store.catalog.pending():
            path = store.layout.manifest_path(entry_id)
            manifest = self.decode_found(path) if path.exists() else None
            if manifest is not None:
                store.catalog.mark_committed(entry_id, manifest.supersedes)
            else:
                self._gc.delete_entries([entry_id], "clean")

    def reconcile(self, min_age: float, dry_run: bool) -> ReconcileReport:
        store = self._store
        catalog, layout = store.catalog, store.layout
        report = ReconcileReport()
        report.orphan_objects.dry_run = dry_run
        if not dry_run:
            self.resolve_pending()
        indexed = catalog.all_entry_ids()
        on_disk: set[str] = set()
        for path in self.manifest_files():
            entry_id = path.name[:-5]
            on_disk.add(entry_id)
            if entry_id in indexed or dry_run:
                continue
            manifest = self.decode_found(path)
            if manifest is None:
                report.quarantined += 1
            else:
                catalog.index_manifest(manifest, path.stat().st_size)
                report.indexed += 1
        report.unknown_files += self._unknown_in(layout.manifests, _MAN_RE)
        gone = sorted(indexed - on_disk)
        if gone and not dry_run:
            freed = catalog.delete_entries(gone)
            for digest, _size in freed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(layout.object_path(digest))
        report.dropped_rows = len(gone)
        known = catalog.all_digests()
        now = time.time()
        for fan in os.scandir(layout.objects):
            if not fan.is_dir(follow_symlinks=False):
                continue
            for e in os.scandir(fan.path):
                if not _OBJ_RE.fullmatch(e.name) or e.name[:-4] in known:
                    continue
                st = e.stat(follow_symlinks=False)
                if now - st.st_mtime < min_age:
                    report.young_orphans += 1
                    continue
                report.orphan_objects.objects += 1
                report.orphan_objects.bytes += st.st_size
                if not dry_run:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)
        report.unknown_files += self._unknown_in(layout.objects, _OBJ_RE)
        return report

    def readmit(self, item: QuarantineItem, entry_id: str, publisher: Publisher) -> Manifest:
        """Move a quarantined entry back if, and only if, its manifest and every object
        verify now: objects first, then the manifest (manifest-last, as in a commit).

        Raises CorruptionError (nothing moved) if anything still fails. The caller holds
        the maintenance lock shared (this adds, like a commit) and removes the item after.
        """
        layout = self._store.layout
        src = item.path / f"{entry_id}.json"
        try:
            manifest = read_manifest(src, entry_id)
        except FileNotFoundError:
            raise CorruptionError("the item has no manifest to restore",
                                  reason=QuarantineReason.MANIFEST_IO, path=src) from None
        moves = []
        for ref in manifest.objects:
            in_item = item.path / f"{ref.digest}.obj"
            in_store = layout.object_path(ref.digest)
            candidate = in_item if in_item.exists() else in_store
            try:
                read_verified(candidate, digest=ref.digest, size=ref.size)
            except (OSError, CorruptionError) as exc:
                raise CorruptionError(f"object {ref.name} still fails: {exc}",
                                      reason=QuarantineReason.PAYLOAD_DIGEST,
                                      path=candidate) from None
            if candidate == in_item:
                moves.append((in_item, in_store))
        for a, b in moves:
            publisher.publish(a, b, what=None)
        final = layout.manifest_path(entry_id)
        publisher.publish(src, final, what=None)
        self._store.catalog.index_manifest(manifest, final.stat().st_size,
                                           last_access=time.time())
        return manifest

    # -- files that do not belong --------------------------------------------------------

    @staticmethod
    def _unknown_in(parent: Path, pattern: re.Pattern[str]) -> list[str]:
        out = []
        for fan in os.scandir(parent):
            if not fan.is_dir(follow_symlinks=False) or len(fan.name) != 2:
                out.append(fan.path)
                continue
            for e in os.scandir(fan.path):
                if not pattern.fullmatch(e.name) or not e.name.startswith(fan.name) or \
                        not e.is_file(follow_symlinks=False):
                    out.append(e.path)
        return out

    def unknown_top_level(self) -> list[str]:
        return sorted(name for name in os.listdir(self._store.root) if name not in KNOWN_TOP)
