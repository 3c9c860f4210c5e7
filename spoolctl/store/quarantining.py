"""The store's quarantine operations (a part of ``Store``, kept in its own module).

Moving an entry's files into a quarantine item drops its catalog row first; re-admitting
one requires that it verifies again (``Recovery.readmit``). Mixed into ``Store``, whose
attributes (``catalog``, ``layout``, ``quarantine``, ``checkpoint``, the publisher and the
recovery part) these methods use.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError, QuarantineReason
from .keys import validate_entry_id
from .manifest import Manifest
from .quarantine import QuarantineItem

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("spoolctl.store")


class Quarantining:
    """``Store``'s quarantine methods (see the module docstring)."""

    def quarantine_entry(
        self: Store, entry_id: str, reason: QuarantineReason, detail: str,
        *, bad_digests: Iterable[str] = (),
    ) -> Path:
        """Remove ``entry_id`` from the catalog and move its manifest (and the objects
        named in ``bad_digests``) into a new quarantine item."""
        self._writable("quarantining an entry")
        files = [(self.layout.manifest_path(entry_id), "manifest")]
        files += [(self.layout.object_path(d), "object") for d in bad_digests]
        return self.quarantine_files(entry_id, reason, detail, files)

    def quarantine_files(self: Store, entry_id: str | None, reason: QuarantineReason, detail: str,
                         files: list[tuple[Path, str]]) -> Path:
        """Drop ``entry_id``'s catalog row (if any) and move ``files`` ((path, role) pairs)
        into a new quarantine item."""
        kind = None
        if entry_id is not None and self._catalog is not None:
            with contextlib.suppress(sqlite3.DatabaseError):
                row = self.catalog.get(entry_id)
                kind = row.kind if row else None
                self.catalog.delete_entries([entry_id])
        self.checkpoint("quarantine.catalog_deleted")
        item = self.quarantine.add(reason, detail, files, entry_id=entry_id, kind=kind,
                                   checkpoint=self.checkpoint)
        log.warning("quarantined %s: %s", item.name, reason.value)
        return item

    def quarantine_items(self: Store) -> list[QuarantineItem]:
        return self.quarantine.items()

    def restore_quarantined(self: Store, item_id: str) -> Manifest:
        """Re-admit a quarantined entry if, and only if, it now verifies.

        Raises CorruptionError (nothing moved) if its manifest or objects still fail, and
        NotFoundError if an object it needs is gone (reclaimed after the quarantine).
        """
        self._writable("restoring from quarantine")
        item = self.quarantine.get(item_id)
        if item.entry_id is None:
            raise ConfigError(f"quarantine item {item_id} holds no entry", path=item.path,
                              fix="inspect it with `spoolctl quarantine show`; purge when done")
        entry_id = validate_entry_id(item.entry_id)
        with self.maintenance(exclusive=False, what="restoring from quarantine"):
            manifest = self._recovery.readmit(item, entry_id, self._publisher)
        self.quarantine.remove(item)
        return manifest
