"""Moving an entry's files into quarantine: a part of ``Store``.

``EntryQuarantine`` drops the entry's catalog row first, then moves its manifest (and the
objects named bad) into a new quarantine item. Every part that finds damage quarantines
through this one object.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import QuarantineReason

if TYPE_CHECKING:
    from ..catalog.index import Catalog
    from ..disk.root import StorePaths
    from .quarantine import Quarantine

log = logging.getLogger("spoolctl.store")


class EntryQuarantine:
    """Quarantines entries of one store. ``catalog`` returns the open catalog, or None
    while a repair has it closed (the files are still moved)."""

    def __init__(self, layout: StorePaths, catalog: Callable[[], Catalog | None],
                 evidence: Quarantine, checkpoint: Callable[[str], None],
                 writable: Callable[[str], None]):
        self._layout = layout
        self._catalog = catalog
        self._evidence = evidence
        self._checkpoint = checkpoint
        self._writable = writable

    def entry(self, entry_id: str, reason: QuarantineReason, detail: str,
              *, bad_digests: Iterable[str] = ()) -> Path:
        """Remove ``entry_id`` from the catalog and move its manifest (and the objects
        named in ``bad_digests``) into a new quarantine item."""
        self._writable("quarantining an entry")
        files = [(self._layout.manifest_path(entry_id), "manifest")]
        files += [(self._layout.object_path(d), "object") for d in bad_digests]
        return self.files(entry_id, reason, detail, files)

    def files(self, entry_id: str | None, reason: QuarantineReason, detail: str,
              files: list[tuple[Path, str]]) -> Path:
        """Drop ``entry_id``'s catalog row (if any) and move ``files`` ((path, role) pairs)
        into a new quarantine item."""
        kind = None
        catalog = self._catalog()
        if entry_id is not None and catalog is not None:
            with contextlib.suppress(sqlite3.DatabaseError):
                row = catalog.get(entry_id)
                kind = row.kind if row else None
                catalog.delete_entries([entry_id])
        self._checkpoint("quarantine.catalog_deleted")
        item = self._evidence.add(reason, detail, files, entry_id=entry_id, kind=kind,
                                  checkpoint=self._checkpoint)
        log.warning("quarantined %s: %s", item.name, reason.value)
        return item
