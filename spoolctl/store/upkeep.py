"""The store's maintenance: deleting released entries, capacity eviction, temp files and
orphans (``gc`` / ``recovery`` decide what), each under the exclusive maintenance lock and
able to spend the reserve on a full disk; the max size; re-admitting quarantined entries."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import TypeVar

from ..errors import ConfigError
from .context import CatalogWork, Limits, WritableGuard
from .disk.fsio import io_error
from .disk.publish import Publisher
from .disk.root import StorePaths, write_marker
from .format.keys import validate_entry_id
from .format.manifest import Manifest
from .maintain.gc import DEFAULT_ORPHAN_AGE, DeleteReport, GarbageCollector, clean_tmp
from .maintain.quarantine import Quarantine
from .maintain.recovery import ReconcileReport, Recovery

T = TypeVar("T")

Maintenance = Callable[..., AbstractContextManager[object]]


class Upkeep:
    """The maintenance role of one store. ``repair`` runs catalog work through the catalog
    repair; ``shedding`` runs work that frees space, spending the reserve on a full disk;
    ``maintenance(exclusive=, what=, wait=)`` is the maintenance lock."""

    def __init__(self, layout: StorePaths, limits: Limits, writable: WritableGuard, *,
                 gc: GarbageCollector, recovery: Recovery, publisher: Publisher,
                 quarantine: Quarantine, repair: CatalogWork,
                 shedding: CatalogWork, maintenance: Maintenance):
        self._layout = layout
        self._limits = limits
        self._writable = writable
        self._gc = gc
        self._recovery = recovery
        self._publisher = publisher
        self._quarantine = quarantine
        self._repair = repair
        self._shedding = shedding
        self._maintenance = maintenance

    def clean_released(self, *, dry_run: bool = False, also: Iterable[str] = ()) -> DeleteReport:
        """Delete every released entry and the objects no other entry references; entries
        held for a remote delete (index ``remote_pending``) are skipped. ``also`` (dry run
        only): retained entries the same plan releases first."""
        return self._deleting(
            "cleaning released entries", lambda: self._gc.clean_released(dry_run, also),
            dry_run=dry_run)

    def delete_released(self, entry_ids: Iterable[str]) -> DeleteReport:
        """Delete those of ``entry_ids`` that are still released; an entry revived by a
        later commit is kept."""
        ids = [validate_entry_id(e) for e in entry_ids]
        return self._deleting("deleting released entries",
                              lambda: self._gc.delete_if_released(ids))

    def enforce_capacity(
        self, *, dry_run: bool = False, budget: int | None = None, wait: bool = True,
        before: Iterable[str] = (),
    ) -> DeleteReport:
        """If over ``max_bytes``, evict released entries first, then least recently used,
        down to 90% of the maximum. ``budget`` bounds the entries evicted in one call;
        ``wait=False`` raises BusyError at once when the lock is held. ``before`` (dry run
        only): entries an earlier step of the same plan deletes."""
        if self._limits.max_bytes is None:
            return DeleteReport(dry_run=dry_run)
        return self._deleting(
            "capacity maintenance", lambda: self._gc.evict(dry_run, budget, before),
            dry_run=dry_run, wait=wait)

    def clean_tmp(
        self, *, min_age: float = DEFAULT_ORPHAN_AGE, dry_run: bool = False
    ) -> DeleteReport:
        """Delete temp files whose writer is dead, or that are older than ``min_age``
        seconds and whose writer is not a live process of this host."""
        if not dry_run:
            self._writable("cleaning temp files")
        return clean_tmp(self._layout.tmp, min_age=min_age, dry_run=dry_run)

    def collect_orphans(
        self, *, min_age: float = DEFAULT_ORPHAN_AGE, dry_run: bool = False
    ) -> ReconcileReport:
        """Reconcile catalog and disk (index manifests the catalog lacks or quarantine them,
        drop rows whose manifest is gone, report unknown files), then delete objects no
        manifest references that are older than ``min_age`` seconds."""
        return self._deleting(
            "collecting orphans", lambda: self._recovery.reconcile(min_age, dry_run),
            dry_run=dry_run)

    def _deleting(self, what: str, fn: Callable[[], T], *, dry_run: bool = False,
                  wait: bool = True) -> T:
        """Run ``fn`` under the exclusive maintenance lock, through the catalog repair; a
        real run needs a writable store and may spend the reserve (it frees space)."""
        def run() -> T:
            with self._maintenance(exclusive=True, wait=wait, what=what):
                return fn()
        if dry_run:
            return self._repair(run)
        self._writable(what)
        return self._shedding(lambda: self._repair(run))

    def set_max_bytes(self, max_bytes: int | None) -> None:
        """Record a new max size in the marker (works on a full disk: lowering the max size
        is how an operator sheds load). Raises StoreIOError when the marker cannot be
        written."""
        self._writable("setting the max size")
        wanted = replace(self._limits.marker, max_bytes=max_bytes)
        try:
            marker = self._shedding(lambda: write_marker(self._layout, wanted))
        except OSError as exc:
            raise io_error(exc, "writing the store marker", self._layout.marker) from exc
        self._limits.marker = marker

    def restore_quarantined(self, item_id: str) -> Manifest:
        """Re-admit a quarantined entry if, and only if, it now verifies. Raises
        CorruptionError (nothing moved) if it still fails, NotFoundError if an object it
        needs is gone, ConfigError if the item holds no entry."""
        self._writable("restoring from quarantine")
        item = self._quarantine.get(item_id)
        if item.entry_id is None:
            raise ConfigError(f"quarantine item {item_id} holds no entry", path=item.path,
                              fix="inspect it with `spoolctl quarantine show`; purge when done")
        entry_id = validate_entry_id(item.entry_id)
        with self._maintenance(exclusive=False, what="restoring from quarantine"):
            manifest = self._recovery.readmit(item, entry_id, self._publisher)
        self._quarantine.remove(item)
        return manifest
