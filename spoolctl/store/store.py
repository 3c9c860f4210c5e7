"""The spool store: one facade over commit, lookup, verified read, hints, capacity and
recovery. Its parts, one module each:

* ``publish``: the one write-temp / fsync / rename / fsync-directory sequence, used for
  objects and manifests (and reusable by a batch commit);
* ``commit``: the manifest-last commit of a batch of entries (group commit; ``put`` is a
  batch of one);
* ``gc``: garbage collection (clean released entries, evict, the deletion order, temp files);
* ``recovery``: catalog rebuild, interrupted commits, reconciling catalog and disk,
  re-admitting quarantined entries;
* ``clean``: the cron job's cleaning pass as data;
* ``facts``: one snapshot of the store's facts for status, metrics and gauges;
* ``queries`` / ``quarantining`` / ``catalog_health``: the read-only queries, moving
  entries into quarantine, and keeping the catalog open and repaired;
* ``catalog`` / ``quarantine`` / ``locks`` / ``fsio``: the index, the evidence, the
  inter-process locks and single-file I/O.

``Store`` decides what each operation locks and how catalog damage is repaired; the
parts decide what to write or delete and in which order. Each part receives a narrow
``context.PartContext``, never the store: no module below this one imports it (2520).

Contract (see docs/format.md for the on-disk format):

* ``put`` publishes objects, then the manifest, then marks the catalog row
  committed (manifest-last). A crash at any step leaves the entry complete or
  invisible; leftovers are reclaimed by ``clean_tmp`` / ``collect_orphans``.
* ``read`` returns payload bytes only after their digest matched in the same
  pass. Any defect quarantines the entry and raises ``CorruptionError``;
  callers treat it as a miss.
* Deletion (``clean_released``, ``enforce_capacity``, ``collect_orphans``)
  holds the maintenance lock exclusively; commits hold it shared. Deletion
  removes manifests first, then catalog rows, then unreferenced objects, so a
  concurrent reader sees either the whole entry or a clean miss.
* Every catalog call goes through ``run_with_catalog_repair``: if SQLite reports the
  catalog damaged, it is quarantined, rebuilt from the manifests and the call retried once.
* Operations that shed load (release, clean, eviction, orphan collection, lowering the
  max size) still work on a full disk: one that fails for lack of space deletes a piece of
  the store's reserve and retries (``reserve``, decision 1103).
* ``read_only=True`` opens a store this process may not (or must not) write: nothing is
  created, locked, touched or quarantined, and every write raises ReadOnlyError.
* With a tag key (``entry_tags``; by default from ``SPOOLCTL_TAG_KEY_FILE`` /
  ``SPOOLCTL_TAG_KEY``), every commit tags its manifest and ``manifest`` -- the one way
  every reader gets a manifest -- refuses one without a valid tag: quarantined
  (``auth_tag``) and a miss, never handed on (decision 2011).
* With a master key (``sealing``; by default from ``SPOOLCTL_MASTER_KEY_FILE`` /
  ``SPOOLCTL_MASTER_KEY`` / ``SPOOLCTL_MASTER_KEY_COMMAND``), every commit seals its objects
  under its tenant's key (``put(..., tenant=)``) and ``read`` decrypts them; an entry whose key
  is gone is a miss (KeyUnavailableError), never quarantined (decision 2800).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from spoolctl.compose import forward

from ..errors import (
    BusyError,
    ConfigError,
    CorruptionError,
    KeyUnavailableError,
    ManifestError,
    NotFoundError,
    RootError,
    SpoolError,
    StoreIOError,
)
from .catalog.health import CatalogKeeper, shedding
from .catalog.index import Catalog
from .catalog.rows import index_problem
from .commit.committer import Committer, Payload, Pending, PutOutcome, PutRequest
from .commit.inputs import check_put, known_size
from .context import Limits, PartContext, WritableGuard
from .disk import dirfd, faults
from .disk.fsio import io_error, read_manifest
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
from .disk.verify import failed_object, read_verified
from .facts import StoreFacts, collect
from .format.entry_tags import FROM_ENVIRONMENT, TagKey
from .format.keys import entry_id_for, validate_entry_id
from .format.manifest import Manifest, authenticate, canonical_json
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
from .sealing import (
    MasterKey,
    Sealer,
    TenantId,
    open_sealer,
    read_binding,
    seal_request,
    sealed_fact,
    stored_key,
)

log = logging.getLogger("spoolctl.store")

T = TypeVar("T")

DEFAULT_LOCK_TIMEOUT = 60.0
# Bounded work done inline after a commit; the rest is left to the next pass/cron.
COMMIT_EVICTION_BUDGET = 256

__all__ = ["DeleteReport", "PutOutcome", "PutRequest", "ReconcileReport", "Store"]


class Store:
    """One store root. Thread-safe; many processes may open the same root.

    Open with ``Store.open``; use as a context manager or call ``close()``.
    ``catalog``, ``layout``, ``quarantine``, ``checkpoint``, ``maintenance`` and
    ``quarantine_files`` are for the store's own operations (scrub, export, import).
    The parts it is composed of are built here and wired once (decision 2520).
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
        """Open (or with ``create`` make) the store at ``root``.

        Refuses relative or symlinked roots, non-empty unmarked directories,
        foreign or malformed markers and (unless ``allow_foreign_owner``) roots, even
        empty ones, owned by another user with a RootError. ``max_bytes`` is recorded in
        the marker. Removes temp files abandoned by dead writers, resolves interrupted
        commits when no other process is busy, keeps the reserve in place, and
        reports unknown files in ``unknown_files``.

        ``read_only``: open without writing anything (no directory, marker, catalog
        repair, lock file, lease, temp file or LRU update; corrupt entries are misses but
        stay where they are), for a store this process cannot or must not write, such as
        a cache another user wrote. Every write method then raises ReadOnlyError.

        ``tag_key``: the key that tags and authenticates entries (``entry_tags``); by
        default the operator's, from the environment (None when none is configured);
        ``None`` opens without one. A key file inside the root is refused (ConfigError).

        ``clock``: the wall clock (seconds) for last-access and commit times, ``time.time``
        unless a test injects one.

        ``master_key``: encryption at rest (``sealing``, decision 2800); by default from the
        environment (None: off); a key file inside the root is refused (ConfigError).

        ``upgrade``: a writable open brings a store an older spoolctl wrote to this one's
        format (its catalog schema, the hint log, the marker's ``requires``; decision
        3050). ``False`` (a command that only reads): such a store is opened read-only
        instead, so reading never changes it.
        """
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
        if sealer is not None:  # SPS2 keys made before decision 2831: mark the store now
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

    def maintenance(self, *, exclusive: bool, what: str, wait: bool = True):
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

    # -- commit -----------------------------------------------------------------------

    def put(
        self,
        *,
        kind: str,
        namespace: str,
        key: str,
        objects: Mapping[str, Payload],
        meta: Mapping[str, Any] | None = None,
        index: Mapping[str, Any] | None = None,
        supersedes: str | None = None,
        evict: bool = True,
        tenant: str | TenantId | None = None,
    ) -> Manifest:
        """Commit one entry (manifest-last) and return its manifest.

        If the entry already exists it is returned as is (and revived if it was
        released): a key names one content. ``supersedes`` is recorded and that
        entry released in the same catalog transaction. Raises StoreIOError on
        a disk failure (nothing partial is visible), CapacityError if the entry
        alone exceeds the store's low watermark, BusyError on lock timeout.
        ``evict=False`` skips the commit-time capacity check, for an owner (the vLLM
        connector) that must withdraw entries from its peers before deleting them.
        Bad arguments raise ConfigError / InvalidIdError before anything is written
        (``inputs.check_put``); a streamed payload that grows past the size budget raises
        CapacityError while it streams, leaving nothing on disk.
        ``tenant``: on an encrypted store, whose keys seal the entry (None: the default
        tenant); the entry is then found only with the same tenant (``lookup``). A
        ``sealing.TenantId`` keeps ``key`` as given (named by ``TenantNames.chunk_key``).
        """
        request = PutRequest(kind, namespace, key, objects, meta, index, supersedes, tenant)
        check_put(**request.__dict__)
        request = seal_request(self.sealer, request)
        entry_id = check_put(**request.__dict__)
        self._writable("committing an entry")
        outcome = self._commit([Pending(entry_id, request=request)], evict)[0]
        if outcome.error is not None:
            raise outcome.error
        assert outcome.manifest is not None
        return outcome.manifest

    def put_many(self, requests: Iterable[PutRequest], *, evict: bool = True
                 ) -> list[PutOutcome]:
        """Commit many entries together (group commit) and return one outcome per request,
        in order.

        The entries are made durable with one round of flushes per step of the commit
        (``commit``): the same protocol and crash guarantees as ``put``, for each entry.
        Per entry, all or nothing: an entry whose arguments are bad (ConfigError,
        InvalidIdError), that does not fit (CapacityError) or whose objects cannot be
        written is refused -- ``outcome.error`` says why and nothing of it is visible --
        and the others are committed. A failure shared by the batch (lock timeout, a
        directory fsync, the catalog) raises BusyError / StoreIOError; entries whose
        manifest was not yet published stay invisible. Commit-time eviction runs once,
        after the batch (see ``put``). Callers bound a batch's size: staged payloads stay
        referenced until the batch is durable.
        """
        requests = list(requests)
        pending: list[Pending] = []
        for r in requests:
            try:
                if not isinstance(r, PutRequest):
                    raise ConfigError(f"put_many takes PutRequest items, got {type(r).__name__}",
                                      fix="pass PutRequest(kind=..., namespace=..., key=..., "
                                          "objects=...)")
                check_put(**r.__dict__)
                r = seal_request(self.sealer, r)
                pending.append(Pending(check_put(**r.__dict__), request=r))
            except SpoolError as exc:
                pending.append(Pending("", outcome=PutOutcome("", "failed", error=exc)))
        self._writable("committing entries")
        return self._commit(pending, evict)

    def _commit(self, pending: list[Pending], evict: bool) -> list[PutOutcome]:
        first_try = True

        def commit() -> None:
            nonlocal first_try
            if not first_try:
                # The catalog was rebuilt mid-commit and the batch runs again: a streamed
                # payload was consumed by the first try and cannot be read twice.
                for p in pending:
                    if p.outcome is None and p.request and any(
                            known_size(v) is None for v in p.request.objects.values()):
                        p.fail(StoreIOError("the catalog was repaired during this commit; a "
                                            "streamed payload cannot be read twice",
                                            path=self.root, fix="commit the entry again"))
            first_try = False
            with self.maintenance(exclusive=False, what="committing entries"):
                self._committer.commit([p for p in pending if p.outcome is None])
        if any(p.outcome is None for p in pending):
            self.run_with_catalog_repair(commit)
        if evict and self.max_bytes is not None and self.totals().bytes > self.max_bytes:
            with contextlib.suppress(BusyError):
                self.enforce_capacity(budget=COMMIT_EVICTION_BUDGET + len(pending), wait=False)
        outcomes = [p.outcome for p in pending]
        assert all(o is not None for o in outcomes), "every entry of a batch has an outcome"
        return outcomes  # type: ignore[return-value]

    def commit_prebuilt(self, pending: list[Pending], given: dict[str, Path]) -> None:
        """Commit entries whose manifests were built, and objects staged in ``tmp/`` and
        verified, elsewhere (the import: ``import_commit``); sets each one's outcome.

        ``given`` (digest -> staged file) is consumed. An entry already committed is
        reported present, not revived. Raises as ``put_many`` does for a shared failure."""
        self._writable("importing entries")

        def commit() -> None:
            with self.maintenance(exclusive=False, what="importing entries"):
                self._committer.commit([p for p in pending if p.outcome is None],
                                       given=given, revive=False)
        self.run_with_catalog_repair(commit)

    # -- lookup and read ----------------------------------------------------------------

    def entry_id(self, kind: str, namespace: str, key: str, *,
                 tenant: str | TenantId | None = None) -> str:
        return entry_id_for(kind, namespace, self._stored_key(key, tenant))

    def _stored_key(self, key: str, tenant: str | TenantId | None) -> str:
        """The key an entry of ``tenant`` is stored under (``sealing.seal_request``)."""
        if self.sealer is None:
            seal_request(None, PutRequest("", "", "", {}, tenant=tenant))  # refuses a tenant
            return key
        return stored_key(self.sealer, tenant, key)

    def lookup(self, kind: str, namespace: str, key: str, *, touch: bool = True,
               tenant: str | TenantId | None = None) -> Manifest | None:
        """The live manifest for ``key`` (of ``tenant`` on an encrypted store), or None (a
        miss). Never raises on corruption: a bad manifest is quarantined and reported as a
        miss."""
        entry_id = self.entry_id(kind, namespace, key, tenant=tenant)
        if not self.live([entry_id]):
            return None
        try:
            manifest = self.manifest(entry_id)
        except (NotFoundError, CorruptionError):
            return None
        if touch and not self.read_only:
            self.touch([entry_id])
        return manifest

    live = forward(Queries.live, "_queries")
    live_keys = forward(Queries.live_keys, "_queries")

    def next_generation(self, name: str) -> int:
        """Advance and return a counter persisted in the catalog.

        Used as a restart epoch: every caller gets a larger number than any earlier
        caller on this root; the value is at least the time in milliseconds, so it keeps
        growing across a catalog rebuild (unless the clock was set back)."""
        self._writable("advancing a generation counter")
        return self.run_with_catalog_repair(lambda: self.catalog.next_generation(name))

    def touch(self, entry_ids: Iterable[str]) -> None:
        """Move the LRU clock of ``entry_ids`` (cheap: skipped when recent; a no-op on a
        read-only store)."""
        if self.read_only:
            return
        ids = list(entry_ids)
        with contextlib.suppress(BusyError):
            self.run_with_catalog_repair(lambda: self.catalog.touch(ids, self.clock()))

    def manifest(self, entry_id: str) -> Manifest:
        """Load and validate the manifest of ``entry_id``.

        Raises NotFoundError if there is none, ManifestError (after quarantining
        the entry) if it is unreadable or invalid, or -- with a tag key -- if its tag does
        not authenticate it (reason ``auth_tag``).
        """
        validate_entry_id(entry_id)
        path = self.layout.manifest_path(entry_id)
        try:
            manifest = read_manifest(path, entry_id)
            if self.tag_key is not None:
                authenticate(self.tag_key, manifest, path)
            return manifest
        except FileNotFoundError:
            raise NotFoundError(f"no entry {entry_id}", path=self.root,
                                fix="list entries with `spoolctl ls`") from None
        except ManifestError as exc:
            if not self.read_only:
                self.quarantine_entry(entry_id, exc.reason, exc.message)
            raise

    def read(self, manifest: Manifest, name: str, *, into: memoryview | None = None) -> memoryview:
        """Return object ``name`` of ``manifest``, verified against its digest in the same pass.

        On damage (a digest or size mismatch, a missing object, anything but a regular
        file in its place) the entry is quarantined and CorruptionError raised (a miss for
        the caller), with the reason every reader gives (``verify.classify``). If the entry
        was deleted by maintenance meanwhile, NotFoundError is raised instead (also a miss);
        an object that cannot be read (permissions, I/O) raises StoreIOError, nothing moved.
        """
        ref = manifest.object(name)
        path = self.layout.object_path(ref.digest)
        sealed = sealed_fact(manifest.index)
        try:
            if sealed is not None:  # one pass: the AEAD tag is the check (decision 2800)
                if self.sealer is None:
                    raise KeyUnavailableError(f"entry {manifest.entry_id} is encrypted and no "
                                              "master key is configured", path=self.root,
                                              fix="configure the master key (docs/runbook.md)")
                return self.sealer.open(path, ref.size, into,
                                        binding=read_binding(manifest, name))
            return read_verified(path, digest=ref.digest, size=ref.size, into=into)
        except KeyUnavailableError as exc:
            if exc.erased and not self.read_only:  # crypto-erased: out of reuse, for `clean`
                with contextlib.suppress(SpoolError):
                    self.release(manifest.entry_id)
            raise
        except (OSError, CorruptionError) as exc:
            raise failed_object(self, manifest.entry_id, name, ref.digest, path, exc,
                                found_by="read").error from exc

    def read_all(self, manifest: Manifest) -> dict[str, memoryview]:
        """Every object of ``manifest``, verified (see ``read``)."""
        return {ref.name: self.read(manifest, ref.name) for ref in manifest.objects}

    def verify(self, entry_id: str) -> Manifest:
        """Re-read and verify the manifest and every object of ``entry_id`` now.

        Returns the manifest if healthy; raises NotFoundError or CorruptionError
        (the entry is then quarantined). An encrypted entry's objects are checked against
        their names, the digests of their ciphertext, like scrub does: no key needed, the
        same answer with or without one, and an entry whose key is gone is still found
        (decision 2800, "Scrub"; issue 33 item 6).
        """
        manifest = self.manifest(entry_id)
        sealed = sealed_fact(manifest.index) is not None
        for ref in manifest.objects:
            if not sealed:
                self.read(manifest, ref.name)
                continue
            path = self.layout.object_path(ref.digest)
            try:
                read_verified(path, digest=ref.digest, size=ref.size)
            except (OSError, CorruptionError) as exc:
                raise failed_object(self, manifest.entry_id, ref.name, ref.digest, path, exc,
                                    found_by="read").error from exc
        return manifest

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

    def clean_released(self, *, dry_run: bool = False, also: Iterable[str] = ()) -> DeleteReport:
        """Delete every released entry and the objects no other entry references.

        Entries held for a remote delete (index ``remote_pending``) are skipped, as
        they are by eviction: their record is what lets ``clean --genai`` retry.
        ``also`` (dry run only): retained entries the same plan releases first."""
        return self._deleting("cleaning released entries",
                              lambda: self._gc.clean_released(dry_run, also), dry_run=dry_run)

    def delete_released(self, entry_ids: Iterable[str]) -> DeleteReport:
        """Delete those of ``entry_ids`` that are still released (a controller's own
        released entries at ``close()``); an entry revived by a later commit is kept."""
        ids = [validate_entry_id(e) for e in entry_ids]
        return self._deleting("deleting released entries",
                              lambda: self._gc.delete_if_released(ids))

    def enforce_capacity(
        self, *, dry_run: bool = False, budget: int | None = None, wait: bool = True,
        before: Iterable[str] = (),
    ) -> DeleteReport:
        """If over ``max_bytes``, evict released entries first, then least recently used,
        down to 90% of the maximum. ``budget`` bounds the entries evicted in one call.
        ``before`` (dry run only): entries an earlier step of the same plan deletes."""
        if self.max_bytes is None:
            return DeleteReport(dry_run=dry_run)
        return self._deleting("capacity maintenance",
                              lambda: self._gc.evict(dry_run, budget, before),
                              dry_run=dry_run, wait=wait)

    def clean_tmp(
        self, *, min_age: float = DEFAULT_ORPHAN_AGE, dry_run: bool = False
    ) -> DeleteReport:
        """Delete temp files whose writer is dead, or that are older than ``min_age``
        seconds and whose writer is not a live process of this host (``gc.clean_tmp``)."""
        if not dry_run:
            self._writable("cleaning temp files")
        return clean_tmp(self.layout.tmp, min_age=min_age, dry_run=dry_run)

    def collect_orphans(
        self, *, min_age: float = DEFAULT_ORPHAN_AGE, dry_run: bool = False
    ) -> ReconcileReport:
        """Reconcile catalog and disk under the exclusive lock, then delete objects that no
        manifest references and that are older than ``min_age`` seconds.

        Manifests missing from the catalog are indexed (or quarantined if invalid),
        catalog rows whose manifest is gone are dropped, unknown files are reported.
        """
        return self._deleting("collecting orphans",
                              lambda: self._recovery.reconcile(min_age, dry_run), dry_run=dry_run)

    def _deleting(self, what: str, fn: Callable[[], T], *, dry_run: bool = False,
                  wait: bool = True) -> T:
        """Run ``fn`` (a deletion or repair of ``gc`` / ``recovery``) under the exclusive
        maintenance lock, through the catalog repair; a real run (not ``dry_run``) needs a
        writable store and may spend the reserve (it frees space)."""
        def run() -> T:
            with self.maintenance(exclusive=True, wait=wait, what=what):
                return fn()
        if dry_run:
            return self.run_with_catalog_repair(run)
        self._writable(what)
        return self._shedding(lambda: self.run_with_catalog_repair(run))

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

    def set_max_bytes(self, max_bytes: int | None) -> None:
        """Record a new max size in the marker (works on a full disk: lowering the max
        size is how an operator sheds load)."""
        from .disk.root import write_marker

        self._writable("setting the max size")
        wanted = replace(self.marker, max_bytes=max_bytes)
        try:
            marker = self._shedding(lambda: write_marker(self.layout, wanted))
        except OSError as exc:
            raise io_error(exc, "writing the store marker", self.layout.marker) from exc
        self.limits.marker = marker

    # -- quarantine (``quarantining``; re-admission needs recovery and the lock) -------

    quarantine_entry = forward(EntryQuarantine.entry, "_quarantining")
    quarantine_files = forward(EntryQuarantine.files, "_quarantining")

    def quarantine_items(self) -> list[QuarantineItem]:
        return self.quarantine.items()

    def restore_quarantined(self, item_id: str) -> Manifest:
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
