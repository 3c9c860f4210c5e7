"""The spool store: one facade over commit, lookup, verified read, hints, capacity and
recovery, composed of role objects it builds and wires once:

* ``writes.Writes``: ``put``, ``put_many`` and the import's ``commit_prebuilt``;
* ``reads.Reads``: entry ids, ``lookup``, ``lookup_many``, ``manifest``, ``read``,
  ``verify``, ``touch``;
* ``upkeep.Upkeep``: deletion, eviction, temp files, orphans, max size, re-admission;
* ``queries.Queries``: the read-only catalog queries;
* below them the committer, ``gc``, ``recovery``, the quarantine and the catalog keeper,
  each given a narrow ``context.PartContext``, never the store: nothing below this module
  imports it.

Contract (the on-disk format: docs/format.md):

* ``put`` publishes objects, then the manifest, then marks the catalog row committed: a
  crash leaves the entry complete or invisible.
* ``read`` returns payload bytes only after their digest matched in the same pass; any
  defect quarantines the entry and raises ``CorruptionError`` (a miss for the caller).
* Deletion holds the maintenance lock exclusively, commits hold it shared; deletion removes
  manifests, then catalog rows, then unreferenced objects.
* Every catalog call goes through ``run_with_catalog_repair``: a damaged catalog is
  quarantined, rebuilt from the manifests and the call retried once.
* Operations that shed load work on a full disk: they spend the store's reserve.
* ``read_only=True``: nothing is created, locked, touched or quarantined; every write raises
  ReadOnlyError.
* With a tag key every manifest is tagged and ``manifest`` refuses one without a valid tag
  (quarantined as ``auth_tag``); with a master key objects are sealed per tenant and an entry
  whose key is gone is a miss (KeyUnavailableError), never quarantined.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

from spoolctl.compose import forward

from ..errors import ConfigError, CorruptionError, RootError
from .catalog.health import CatalogKeeper, shedding
from .catalog.index import Catalog
from .catalog.rows import index_problem
from .commit.committer import Committer, PutOutcome, PutRequest
from .context import Limits, PartContext, WritableGuard
from .delegation import delegate
from .disk import dirfd, faults
from .disk.locks import OwnerInfo, OwnerLease, hold_gated, read_owner, try_hold_gated
from .disk.publish import Publisher
from .disk.reserve import Reserve
from .disk.root import (
    FEATURE_HINTS_LOG,
    FEATURE_SEALED_V2,
    FEATURE_SEALED_V3,
    Marker,
    StorePaths,
    check_root_path,
    create_or_adopt,
    read_marker,
    require_feature,
)
from .facts import StoreFacts, collect
from .format.entry_tags import FROM_ENVIRONMENT, TagKey
from .format.keys import validate_entry_id
from .format.manifest import canonical_json
from .maintain.clean import CLEAN_STEPS, CleanReport, run_clean
from .maintain.gc import (
    DEFAULT_ORPHAN_AGE,
    TMP_COUNT_LIMIT,
    DeleteReport,
    GarbageCollector,
    clean_tmp,
)
from .maintain.quarantine import Quarantine, QuarantineItem
from .maintain.quarantining import EntryQuarantine
from .maintain.recovery import ReconcileReport, Recovery
from .queries import Queries
from .reads import Reads
from .sealing import MasterKey, Sealer, open_sealer
from .upkeep import Upkeep
from .writes import Writes

log = logging.getLogger("spoolctl.store")

T = TypeVar("T")

DEFAULT_LOCK_TIMEOUT = 60.0

__all__ = ["DeleteReport", "PutOutcome", "PutRequest", "ReconcileReport", "Store"]


class Store:
    """One store root. Thread-safe; many processes may open the same root.

    Open with ``Store.open``; use as a context manager or call ``close()``.
    ``catalog``, ``layout``, ``quarantine``, ``checkpoint``, ``maintenance`` and
    ``quarantine_files`` are for the store's own operations (scrub, export, import).
    """

    def __init__(self, layout: StorePaths, marker: Marker, *, lock_timeout: float,
                 read_only: bool = False, tag_key: TagKey | None = None,
                 clock: Callable[[], float] = time.time, sealer: Sealer | None = None):
        self.layout = layout
        self.tag_key = tag_key
        self.sealer = sealer
        # Wall-clock seconds for the LRU clock and commit times (last access, created);
        # injectable so that tests order entries without sleeping.
        self.clock = clock
        self.limits = Limits(marker, lock_timeout)
        self.read_only = read_only
        self.reserve = Reserve(layout.state)
        self.quarantine = Quarantine(layout.quarantine, layout.tmp)
        self.unknown_files: list[str] = []
        self.checkpoint = faults.checkpoint
        # The parts call these hooks, which follow a test's swap of ``checkpoint``/``clock``.
        hook: Callable[[str], None] = lambda name: self.checkpoint(name)  # noqa: E731
        self._writable = WritableGuard(layout.root, read_only)
        self._catalogs = CatalogKeeper(
            layout, read_only=read_only, evidence=self.quarantine,
            exclusive_lock=lambda what: self.maintenance(exclusive=True, what=what),
            has_manifests=lambda: self._recovery.has_manifests(),
            index_all=lambda catalog: self._recovery.index_all(catalog))
        self._quarantining = EntryQuarantine(layout, self._catalogs.current, self.quarantine,
                                             hook, self._writable)
        ctx = PartContext(layout, lambda: self._catalogs.catalog, hook, self._quarantining,
                          self.limits, self._writable, lambda: self.clock(), tag_key,
                          key_available=None if sealer is None else sealer.key_available)
        self._publisher = Publisher(layout.root, layout.tmp, hook)
        self._committer = Committer(ctx, self._publisher)
        self._gc = GarbageCollector(ctx)
        self._recovery = Recovery(ctx, self._gc)
        self._queries = Queries(layout, lambda: self._catalogs.catalog,
                                self.run_with_catalog_repair)
        self._wire_roles()

    def _wire_roles(self) -> None:
        """Build the role objects; their callbacks go through ``self`` so that a test's
        swap of a store method is followed."""
        repair, shed = self.run_with_catalog_repair, self._shedding
        self._writes = Writes(
            self._committer, self.sealer, self._writable, self.limits, self.layout.root,
            repair=repair,
            maintenance=lambda what: self.maintenance(exclusive=False, what=what),
            over_capacity=lambda: self.totals().bytes > (self.max_bytes or 0),
            evict=lambda budget: self.enforce_capacity(budget=budget, wait=False))
        self._reads = Reads(
            self.layout, read_only=self.read_only, tag_key=self.tag_key, sealer=self.sealer,
            catalog=lambda: self.catalog, clock=lambda: self.clock(), repair=repair,
            quarantining=self._quarantining, live=lambda ids: self.live(ids),
            release=lambda entry_id: self.release(entry_id))
        self._upkeep = Upkeep(
            self.layout, self.limits, self._writable, gc=self._gc, recovery=self._recovery,
            publisher=self._publisher, quarantine=self.quarantine, repair=repair,
            shedding=shed, maintenance=self.maintenance)

    # -- opening --------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        *,
        create: bool = False,
        max_bytes: int | None = None,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        allow_foreign_owner: bool = False,
        read_only: bool = False,
        tag_key: TagKey | None = FROM_ENVIRONMENT,
        clock: Callable[[], float] = time.time,
        master_key: MasterKey | None = FROM_ENVIRONMENT,
        upgrade: bool = True,
    ) -> Store:
        """Open (or with ``create`` make) the store at ``root`` and return it.

        ``max_bytes`` is recorded in the marker. ``read_only``: write nothing (every write
        then raises ReadOnlyError). ``tag_key`` / ``master_key``: by default from the
        environment, None for none. ``clock``: wall-clock seconds for access and commit
        times. ``upgrade``: a writable open brings an older format to this one; False
        opens such a store read-only instead.

        Cleans dead writers' temp files, resolves interrupted commits when alone, keeps the
        reserve, and lists unknown files in ``unknown_files``. Raises RootError for a
        relative, symlinked, foreign, malformed or (unless ``allow_foreign_owner``) another
        user's root; ConfigError for a key file inside the root, denied permissions, or
        ``read_only`` with ``create`` / ``max_bytes``."""
        path = check_root_path(root)
        if tag_key is FROM_ENVIRONMENT:
            tag_key = TagKey.from_environment()
        if tag_key is not None:
            tag_key.check_outside(path)
        if master_key is FROM_ENVIRONMENT:
            master_key = MasterKey.from_environment()
        if master_key is not None:
            master_key.check_outside(path)
        if not (read_only or create or upgrade) and older_format(path):
            read_only = True
        if read_only and (create or max_bytes is not None):
            raise ConfigError("a read-only open cannot create a store or set its max size",
                              fix="drop create/max_bytes, or open it writable")
        try:
            layout, marker = create_or_adopt(path, create=create, max_bytes=max_bytes,
                                             allow_foreign_owner=allow_foreign_owner,
                                             read_only=read_only)
        except PermissionError as exc:
            raise ConfigError("permission denied opening the store", path=exc.filename or path,
                              fix="run as the store's owner or fix its permissions") from None
        sealer = open_sealer(layout.state, layout.tmp, lock_timeout=lock_timeout,
                             read_only=read_only, master=master_key,
                             on_wide=lambda: require_feature(layout, FEATURE_SEALED_V2),
                             on_bound=lambda: require_feature(layout, FEATURE_SEALED_V3))
        store = cls(layout, marker, lock_timeout=lock_timeout, read_only=read_only,
                    tag_key=tag_key, clock=clock, sealer=sealer)
        if read_only:
            store._catalogs.open_read_only()
            store.unknown_files = store._recovery.unknown_top_level()
            return store
        if sealer is not None:  # a keyring with wide keys from before the marker said so
            store._shedding(sealer.keyring.mark_wide)
        try:  # on a full disk too: the reserve makes room; a read command never rebuilds it
            store._shedding(lambda: store._catalogs.open(repair=upgrade))
        except CorruptionError:
            with contextlib.suppress(Exception):
                store.close()
            raise
        store._shedding(store._upgrade)
        store.reserve.ensure()
        # Dead writers' files, a bounded number per open: `clean --tmp` reclaims any number.
        clean_tmp(layout.tmp, min_age=float("inf"), dry_run=False, limit=TMP_COUNT_LIMIT)
        with try_hold_gated(store._maint_lock, store._maint_gate) as alone:
            if alone:
                try:
                    store._recovery.resolve_pending()
                except sqlite3.DatabaseError as exc:  # left for the next maintenance pass
                    log.warning("could not resolve interrupted commits: %s", exc)
        store.unknown_files = store._recovery.unknown_top_level()
        for name in store.unknown_files:
            log.warning("unknown file in store root %s: %s", layout.root, name)
        return store

    def _upgrade(self) -> None:
        """Bring a store an older spoolctl wrote to this format (a writable open): the hint
        log written from the catalog's hints, then the marker made to require it, so every
        older spoolctl refuses the store from then on. A crash between the two leaves the
        store as old as it was: the next writable open writes the log again."""
        hints = self.catalog.hints.path
        if FEATURE_HINTS_LOG in self.marker.requires and os.path.lexists(hints):
            return
        self.run_with_catalog_repair(lambda: self.catalog.seed_hints())
        faults.checkpoint("upgrade.hints_seeded")  # crash tests: before the marker says so
        self.limits.marker = require_feature(self.layout, FEATURE_HINTS_LOG)

    @property
    def root(self) -> Path:
        return self.layout.root

    @property
    def marker(self) -> Marker:
        return self.limits.marker

    @property
    def max_bytes(self) -> int | None:
        return self.limits.max_bytes

    @property
    def lock_timeout(self) -> float:
        return self.limits.lock_timeout

    @lock_timeout.setter
    def lock_timeout(self, seconds: float) -> None:
        self.limits.lock_timeout = seconds

    @property
    def catalog(self) -> Catalog:
        """The open catalog (a repair replaces it: ask for it on each use)."""
        return self._catalogs.catalog

    def run_with_catalog_repair(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (catalog work); on catalog damage rebuild the catalog and run it once
        more (``catalog_health.CatalogKeeper``)."""
        return self._catalogs.run_with_catalog_repair(fn)

    def _shedding(self, fn: Callable[[], T]) -> T:
        """Run ``fn``, which frees space, deleting the reserve piece by piece while it fails
        for lack of space (``catalog_health.shedding``)."""
        return shedding(self.reserve, self.root, fn)

    @property
    def _maint_gate(self) -> Path:
        return self.layout.state / "maintenance.gate"

    @property
    def _maint_lock(self) -> Path:
        return self.layout.state / "maintenance.lock"

    def maintenance(self, *, exclusive: bool, what: str, wait: bool = True
                    ) -> AbstractContextManager[None]:
        """The maintenance lock (shared: commits; exclusive: deletions and repairs),
        writer-preferring; waits up to ``lock_timeout`` (or not at all) then BusyError."""
        return hold_gated(self._maint_lock, self._maint_gate, exclusive=exclusive,
                          timeout=self.lock_timeout if wait else 0, what=what)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._catalogs.close() and not self.read_only and \
                self.reserve.count < self.reserve.most:
            # The last connection's close deleted SQLite's -wal/-shm files: take that
            # room back into the reserve before another program does.
            self.reserve.ensure()

    # -- commit (``writes``) and lookup and read (``reads``) ----------------------------

    put = delegate(Writes.put, "_writes")
    put_many = delegate(Writes.put_many, "_writes")
    commit_prebuilt = delegate(Writes.commit_prebuilt, "_writes")
    entry_id = delegate(Reads.entry_id, "_reads")
    lookup = delegate(Reads.lookup, "_reads")
    lookup_many = delegate(Reads.lookup_many, "_reads")
    manifest = delegate(Reads.manifest, "_reads")
    read = delegate(Reads.read, "_reads")
    read_all = delegate(Reads.read_all, "_reads")
    verify = delegate(Reads.verify, "_reads")
    touch = delegate(Reads.touch, "_reads")
    live = forward(Queries.live, "_queries")
    live_keys = forward(Queries.live_keys, "_queries")

    def next_generation(self, name: str) -> int:
        """Advance and return a counter persisted in the catalog.

        Used as a restart epoch: every caller gets a larger number than any earlier
        caller on this root; the value is at least the time in milliseconds, so it keeps
        growing across a catalog rebuild (unless the clock was set back)."""
        self._writable("advancing a generation counter")
        return self.run_with_catalog_repair(lambda: self.catalog.next_generation(name))

    # -- hints ---------------------------------------------------------------------------

    def release(self, entry_id: str) -> bool:
        """Mark ``entry_id`` released: out of reuse at once, bytes deleted by cleanup.
        Returns False if there is no such committed entry. Works on a full disk (the
        reserve makes room for the catalog write)."""
        validate_entry_id(entry_id)
        self._writable("releasing an entry")

        def release() -> bool:
            return self.run_with_catalog_repair(
                lambda: self.catalog.set_hint(entry_id, "release", self.clock()))
        return self._shedding(release)

    def update_index(self, entry_id: str, changes: Mapping[str, Any]) -> bool:
        """Merge ``changes`` into the catalog copy of the entry's index (None deletes a key).

        For mutable facts of immutable entries, such as a hosted cache's new expire
        time or ``remote_pending`` (see ``clean_released``). Catalog-only, like hints:
        a catalog rebuild restores the manifest's index. False if there is no entry.
        """
        validate_entry_id(entry_id)
        self._writable("updating an entry's index")
        try:
            canonical_json(dict(changes))
        except (TypeError, ValueError):
            raise ConfigError("index changes must be finite JSON values",
                              fix="pass strings, numbers, booleans, lists, dicts or None") from None
        problem = index_problem({k: v for k, v in changes.items() if v is not None})
        if problem is not None:
            raise ConfigError(problem, fix="expire_time is unix seconds; remote_pending a bool")
        return self.run_with_catalog_repair(
            lambda: self.catalog.update_index(entry_id, dict(changes)))

    # -- maintenance (what to delete: gc; what to repair: recovery) -----------------------

    clean_released = delegate(Upkeep.clean_released, "_upkeep")
    delete_released = delegate(Upkeep.delete_released, "_upkeep")
    enforce_capacity = delegate(Upkeep.enforce_capacity, "_upkeep")
    clean_tmp = delegate(Upkeep.clean_tmp, "_upkeep")
    collect_orphans = delegate(Upkeep.collect_orphans, "_upkeep")
    set_max_bytes = delegate(Upkeep.set_max_bytes, "_upkeep")
    restore_quarantined = delegate(Upkeep.restore_quarantined, "_upkeep")

    def clean(self, steps: Iterable[str] = CLEAN_STEPS, *,
              min_age: float = DEFAULT_ORPHAN_AGE, dry_run: bool = False,
              also_released: Iterable[str] = ()) -> CleanReport:
        """The cleaning pass (``spoolctl clean``): ``steps`` of ``clean.CLEAN_STEPS`` in
        their fixed order, reported step by step; ``dry_run`` only plans, and reports
        exactly what the run would delete (``also_released``: retained entries the caller
        releases before a real run, counted by the dry run's ``released`` step)."""
        return run_clean(self, steps, min_age=min_age, dry_run=dry_run,
                         also_released=also_released)

    # -- ownership and size ------------------------------------------------------------

    def owner(self) -> OwnerInfo | None:
        return read_owner(self.layout.state / "owner.lock", self.layout.state / "owner.json")

    def acquire_owner_lease(self, role: str) -> OwnerLease | None:
        """Take the owner lease (non-blocking); None if another live process holds it."""
        self._writable("taking the owner lease")
        lease = OwnerLease(self.layout.state / "owner.lock", self.layout.state / "owner.json", role)
        return lease if lease.try_acquire() else None

    # -- quarantine (``quarantining``; re-admission needs recovery and the lock) -------

    quarantine_entry = forward(EntryQuarantine.entry, "_quarantining")
    quarantine_files = forward(EntryQuarantine.files, "_quarantining")

    def quarantine_items(self) -> list[QuarantineItem]:
        return self.quarantine.items()

    # -- queries (``queries``; catalog only) --------------------------------------------

    def facts(self) -> StoreFacts:
        """One snapshot of everything status, metrics and gauges report (``facts``)."""
        return collect(self)

    totals = forward(Queries.totals, "_queries")
    by_kind = forward(Queries.by_kind, "_queries")
    released = forward(Queries.released, "_queries")
    entries = forward(Queries.entries, "_queries")
    malformed_rows = forward(Queries.malformed_rows, "_queries")
    malformed_count = forward(Queries.malformed_count, "_queries")
    row = forward(Queries.row, "_queries")
    resolve = forward(Queries.resolve, "_queries")
    tmp_usage = forward(Queries.tmp_usage, "_queries")


def older_format(root: Path) -> bool:
    """Whether the store at ``root`` is in an older spoolctl's format (its marker does not
    require the hint log); False when there is no valid marker (the open reports that)."""
    try:
        dirfd.guard(root, os.lstat(root))  # another user's root: read its marker by descriptor
        return FEATURE_HINTS_LOG not in read_marker(StorePaths(root)).requires
    except (RootError, OSError):
        return False
