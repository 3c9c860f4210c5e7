"""The local prompt-cache controller engine, shared by the PyTorch, MLX and mlx-vlm controllers.

Everything but the framework and the entry format lives here, once: the in-memory
LRU, single-flight of concurrent identical ``prepare`` calls (``flight.py``),
cross-process single-flight (a lock per key stripe under the store's ``state/``),
disk lookups with verification and quarantine, base selection and incremental
prefill, commit, release, ``close()``, the target of ``generate`` (``targets.py``)
and its usage. What an entry is -- key, prompt rendering, manifest fields, bytes,
continuation -- is the controller's ``EntryFormat`` (``entry_format.py``); the
framework is the format's backend (``contract.KVBackend`` for plain KV caches). The
controller is composed of parts (decision 2520): ``entry_io`` (its entries in the store:
lookups, verified loads, bases, commits), ``handle_book`` (its calls and handles); and it
uses ``store_open`` (the store and its size limit), ``model_params`` and ``plan_rules``.

Guarantees:

* Same parameters -> same entry (id = kind + backend-identity namespace + key),
  served from memory, else from disk.
* A stored cache is used only if its manifest identity, token ids, prefix
  digests and payload digests all verify, and its tokens are a prefix of the
  prompt. Anything else is a miss (quarantined when the bytes are bad): the
  request runs cold (``cache_read_tokens = 0``), never raises, never yields
  tokens a cold run would not.
* ``read_only`` params -- and every call of a controller opened with
  ``read_only=True`` -- never write to the store (no entry, no lock file, no LRU
  clock update, no quarantine); they use exact hits only, else an empty handle that
  ``generate`` still accepts (the query runs cold).
* ``params.model`` is normalised to the controller's ``model_id`` (any spelling of the
  model directory's path is the same key); another model is a ConfigError.
* Usage is per call and honest (``usage.py``, decision 1701).
* Store trouble while writing (full disk, busy lock) never fails ``prepare``:
  the cache is still served from memory, just not persisted.
* A disk that does not answer costs ``prepare`` at most one deadline (``deadlines``: a
  lookup 0.5 s, an object read or a commit 5 s, the connector's defaults): past it the
  entry is a miss, and until the disk answers again the controller runs without its store
  (cold prefills served from memory, nothing read, locked or written).
* Default log lines never name an entry, a digest or a store path (``logsafe``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from spoolctl.compose import forward
from spoolctl.store import (
    ConfigError,
    Manifest,
    SpoolError,
    Store,
    hold,
    refuse_encrypted,
    validate_entry_id,
)

from ..contract import CacheHandle, CachePrepareParams, GenerateResult, KVBackend
from ..flight import PrepareFlights
from ..logsafe import reason
from ..options import strict_options
from ..targets import ref_of
from .deadlines import DEFAULT_LOOKUP_DEADLINE_S, DEFAULT_READ_DEADLINE_S, StoreDeadlines
from .entry_format import FORMAT, EntryFormat, KVEntryFormat, Loaded, Plan
from .entry_io import EntryIO
from .handle_book import HandleBook
from .model_params import normalize_params
from .model_state import UnidentifiedModel
from .plan_rules import same_params, snapshot_plan
from .store_open import default_max_bytes
from .store_open import open_store as _open_store
from .tenancy import SealedFormat, Tenancy
from .tokens import TokenPrefix
from .usage import ControllerStats, PrepareWork
from .use import CacheUse, UseContext

log = logging.getLogger("spoolctl.controllers")

LOCAL_KINDS = frozenset({"pytorch", "mlx"})
DEFAULT_MEMORY_ENTRIES = 4
DEFAULT_LOCK_TIMEOUT = 600.0
LOCK_STRIPES = 256  # lock files per store: bounded, and two keys rarely share one

__all__ = ["DEFAULT_LOCK_TIMEOUT", "DEFAULT_MEMORY_ENTRIES", "FORMAT", "LOCK_STRIPES",
           "ControllerStats", "GenerateResult", "KVBackend", "LocalCacheController"]


@strict_options
class LocalCacheController:
    """A ``PromptCacheController`` for in-process inference, generic over a backend and
    its entry format.

    ``backend``: a ``KVBackend``, whose entries are ``KVEntryFormat``'s, or the backend
    of ``entry_format`` (the VLM controller passes its ``VlmEntryFormat``). ``root``: a
    store root path, an open ``Store`` (not closed by this controller), or None for a
    managed temporary store that ``close()`` removes entirely. ``memory_entries``: how
    many loaded caches stay in memory (LRU). ``max_bytes``: the size limit of a store
    this controller creates (default: ``default_max_bytes``); the limit of an existing
    store is its owner's (``spoolctl init --max-size``), and another value here is a
    ConfigError, never a silent rewrite (decision 2104).
    ``lock_timeout``: how long ``prepare`` waits for another process preparing the same
    key stripe before giving up and returning an empty handle (run cold).
    ``read_only``: open an existing store for reading only (e.g. a cache another user
    wrote): exact hits only, nothing written, ``release``/``import_cache`` refused.
    ``tenant``: on a store with encryption at rest (a master key configured), the tenant
    whose data key seals this controller's entries; only that tenant's entries are found
    (None: the default tenant). On a store without encryption a tenant is a ConfigError
    (``tenancy.py``, decision 2810).
    ``lookup_deadline`` / ``read_deadline``: how long a lookup (catalog and manifest) / an
    object read or a commit may take before the disk counts as not answering (``deadlines``).
    ``generate``, ``restore``, ``import_cache`` and friends are ``local_use.CacheUse``'s,
    a part this controller is composed of and forwards to (decision 2520).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # every controller's own calls refuse an unknown keyword by name, not by TypeError
        super().__init_subclass__(**kwargs)
        strict_options(cls)

    def __init__(
        self,
        backend: KVBackend | Any,
        root: str | os.PathLike[str] | Store | None = None,
        *,
        max_bytes: int | None = None,
        memory_entries: int = DEFAULT_MEMORY_ENTRIES,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        entry_format: EntryFormat | None = None,
        read_only: bool = False,
        tenant: str | None = None,
        lookup_deadline: float = DEFAULT_LOOKUP_DEADLINE_S,
        read_deadline: float = DEFAULT_READ_DEADLINE_S,
    ):
        if getattr(backend, "kind", None) not in LOCAL_KINDS:
            raise ConfigError(f"unsupported backend kind {getattr(backend, 'kind', None)!r}",
                              fix=f"use a backend of kind {' or '.join(sorted(LOCAL_KINDS))}")
        if not isinstance(memory_entries, int) or memory_entries < 0:
            raise ConfigError("memory_entries must be an integer >= 0",
                              fix="pass 0 to keep nothing loaded")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes <= 0):
            # checked before any directory or marker exists: a bad limit never lands on disk
            raise ConfigError(f"max_bytes must be a positive number of bytes, not {max_bytes!r}",
                              fix="pass e.g. max_bytes=20 << 30, or leave it out for the "
                                  "default")
        if not isinstance(read_only, bool):
            raise ConfigError(f"read_only must be True or False, not {read_only!r}",
                              fix="pass read_only=True or leave it out")
        self._deadlines = StoreDeadlines(lookup_deadline_s=lookup_deadline,
                                         read_deadline_s=read_deadline)
        self.backend = backend
        self.format: EntryFormat = entry_format or KVEntryFormat(backend)
        self.kind: str = self.format.kind
        self.identity = self.format.identity
        self.namespace = self.format.namespace
        self.memory_entries = memory_entries
        self.lock_timeout = lock_timeout
        self.read_only = read_only
        self._managed: Path | None = None
        self._owns_store = True
        if isinstance(root, Store):
            self._store = root
            self._owns_store = False
        elif root is None:
            if read_only:
                raise ConfigError("a read-only controller needs an existing store",
                                  fix="pass root= the store directory to read")
            self._managed = Path(tempfile.mkdtemp(prefix="spoolctl-controller-"))
            self._store = Store.open(str(self._managed), create=True,
                                     max_bytes=max_bytes if max_bytes is not None
                                     else default_max_bytes(self._managed))
        else:
            self._store = _open_store(root, max_bytes=max_bytes, read_only=read_only)
        try:
            if self._store.sealer is not None and entry_format is not None and \
                    not hasattr(entry_format, "sealed_meta"):
                # A format of its own must name the prompt-derived meta it keeps (mlx-vlm:
                # image digests, decision 2821) to be sealed; one that does not fails closed.
                refuse_encrypted(self._store, f"the {self.format.label} controller")
            self._tenancy = Tenancy(self._store, tenant, self.kind,
                                    sealed_meta=getattr(self.format, "sealed_meta", ()),
                                    sealed_layout=getattr(self.format, "sealed_layout", ()))
        except SpoolError:
            if self._owns_store:
                self._store.close()
            if self._managed is not None:
                shutil.rmtree(self._managed, ignore_errors=True)
            raise
        if self._tenancy.active:
            self.format = SealedFormat(self.format, self._tenancy)  # type: ignore[assignment]
        self._lock = threading.Condition(threading.RLock())
        self._flights = PrepareFlights(self._lock)
        self._memory: OrderedDict[str, Loaded] = OrderedDict()
        self._released: set[str] = set()
        # Bases superseded by a strict extension whose release waits until no live handle
        # holds them (decision 2100; the handles are the book's).
        self._superseded: dict[str, str] = {}
        self._closed = False
        self._warned_bypass = False
        self._stats = ControllerStats()
        self._book = HandleBook(self._lock)
        self._entries = EntryIO(store=self._store, deadlines=self._deadlines,
                                tenancy=self._tenancy, entry_format=self.format, kind=self.kind,
                                identity=self.identity, read_only=self.read_only,
                                count=self._count, lock=self._lock, memory=self._memory)
        self._use = CacheUse(UseContext(
            format=self.format, check_open=self._check_open,
            check_writable=self._check_writable, normalize=self._normalize,
            prepare=self.prepare, known=self._book.known, take_work=self._book.take_work,
            loaded=self._loaded, record_query=self.record_query,
            store_imported=self._store_imported))

    generate = forward(CacheUse.generate, "_use")
    prompt_tokens = forward(CacheUse.prompt_tokens, "_use")
    prefix_tokens = forward(CacheUse.prefix_tokens, "_use")
    restore = forward(CacheUse.restore, "_use")
    import_cache = forward(CacheUse.import_cache, "_use")

    @property
    def store(self) -> Store:
        """The controller's store (ConfigError once the controller is closed)."""
        self._check_open()
        return self._store

    @property
    def model_id(self) -> str:
        """The model identity that ``params.model`` is normalised to: an explicit
        ``model_id`` given to the backend, else its resolved model directory."""
        return str(getattr(self.backend, "model_id", None) or self.identity.get("model", ""))

    # -- context manager / lifecycle ------------------------------------------------------

    def __enter__(self) -> LocalCacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for in-flight prepares, delete this controller's released entries, drop
        loaded caches, and remove a managed store entirely. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._flights.wait_idle()
            # Handles of a closed controller serve nothing: every deferred base goes now.
            pending = sorted(self._superseded)
            self._superseded.clear()
            self._book.drop_holders()
        for base_id in pending:
            self._release_superseded(base_id)
        with self._lock:
            released = sorted(self._released)
            self._released.clear()
            self._memory.clear()
        self._book.forget_calls()
        try:
            if self._managed is None and released and not self._entries.on_disk(
                    lambda: self._store.delete_released(released),
                    self._deadlines.read_deadline_s)[0]:
                log.warning("released entries not deleted at close: the store's disk does "
                            "not answer (`spoolctl clean` removes them)")
        except SpoolError as exc:  # bytes stay released; `spoolctl clean` removes them
            log.warning("could not delete released entries at close: %s", reason(exc))
        finally:
            if self._owns_store:
                self._store.close()
            if self._managed is not None:
                shutil.rmtree(self._managed, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("the controller is closed (its store too)",
                              fix="use the controller inside its `with` block, or create a "
                                  "new one")

    def _check_writable(self, what: str) -> None:
        self._check_open()
        if self.read_only:
            raise ConfigError(f"this controller is read-only: it does not {what}",
                              fix="open the controller without read_only=True")

    def record_query(self) -> None:
        """Count one query served (statistics only)."""
        self._count(queries=1)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return asdict(self._stats)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    # -- params ----------------------------------------------------------------------------

    def _normalize(self, params: Any) -> CachePrepareParams:
        """``params`` for this controller (``model_params.normalize_params``)."""
        return normalize_params(params, model_id=self.model_id, read_only=self.read_only,
                                model_path=getattr(self.backend, "model_path", None))

    # -- prepare ---------------------------------------------------------------------------

    def entry_id(self, params: CachePrepareParams) -> str:
        """The store entry id ``params`` map to with this backend."""
        return self.format.entry_id(self._normalize(params))

    def _plan(self, params: CachePrepareParams) -> Plan | None:
        return self.format.plan(params)

    def _prefix_of(self, manifest: Manifest) -> TokenPrefix:
        return self.format.check(self._tenancy.open_meta(manifest)[0], None)

    def prepare(self, params: CachePrepareParams) -> CacheHandle:
        """Return a handle to a cache of the cacheable prefix of ``params``.

        Memory hit, else disk hit, else incremental prefill from the best base, else
        cold prefill (committed unless ``read_only``). No cacheable prefix (or a
        ``read_only`` miss) gives the empty handle, which ``generate`` accepts (it runs
        cold). Raises only ConfigError for bad parameters (or a closed controller);
        store and cache defects become misses.
        """
        self._check_open()
        params = self._normalize(params)
        if self._superseded:
            self._settle()
        try:
            plan = self._plan(params)
        except UnidentifiedModel as exc:
            self._bypass(exc)
            return self._book.stamp(params, CacheHandle.empty(), None)
        if plan is None:
            return self._book.stamp(params, CacheHandle.empty(), None)
        with self._lock:
            self._check_open()
            self._stats.prepares += 1
            loaded = self._memory.get(plan.entry_id)
            if loaded is not None and loaded.prefix == plan.prefix:
                self._memory.move_to_end(plan.entry_id)
                self._stats.memory_hits += 1
                handle = self._book.stamp(params, self._handle(plan, source="memory"),
                                          PrepareWork(memory=len(plan.prefix)))
                touch = not (params.read_only or self.read_only) and \
                    self._book.due_touch(plan.entry_id)
            else:
                handle = None
                flight = self._flights.join(plan.entry_id, params.read_only)
                if not flight.leader:
                    self._stats.coalesced += 1
        if handle is not None:
            if touch:  # outside the lock: a catalog write
                try:
                    self._entries.on_disk(lambda: self._store.touch([plan.entry_id]),
                                  self._deadlines.lookup_deadline_s)
                except SpoolError as exc:  # the LRU clock is a hint; the hit stands
                    log.debug("memory hit not recorded in the catalog: %s", reason(exc))
            return handle
        if not flight.leader:
            shared = self._flights.wait(flight)
            # The leader's prefill, taken from memory: this call read it, wrote nothing.
            return self._book.stamp(params, shared,
                                    PrepareWork(memory=shared.cached_tokens) if shared else None)
        return self._flights.lead(flight,
                                  lambda: self._book.stamp(params, *self._prepare_slow(plan)))

    def _bypass(self, exc: UnidentifiedModel) -> None:
        """Count a prepare that runs without the cache: the model is in a state its backend
        cannot name, so no entry is its (said once per controller)."""
        with self._lock:
            self._stats.bypassed += 1
            first = not self._warned_bypass
            self._warned_bypass = True
        log.log(logging.WARNING if first else logging.DEBUG,
                "%s: running without the cache, nothing reused or written (said once per "
                "controller; stats()['bypassed'] counts them)", exc.message)

    # -- supersession: only strict extensions, only once nobody holds the base --------------

    def _settle(self) -> None:
        """Release the superseded bases that no live handle holds any more."""
        with self._lock:
            ready = [b for b in self._superseded if not self._book.held(b)]
            for base_id in ready:
                del self._superseded[base_id]
        for base_id in ready:
            self._release_superseded(base_id)

    def _release_superseded(self, base_id: str) -> None:
        with self._lock:
            self._memory.pop(base_id, None)
            self._released.add(base_id)
        try:
            self._store.release(base_id)
        except SpoolError as exc:  # it stays retained: LRU or `spoolctl clean` reclaims it
            log.warning("a superseded base was not released: %s", reason(exc))

    def _handle(self, plan: Plan, *, source: str, written: int = 0, reused: int = 0,
                computed: int = 0, supersedes: str | None = None) -> CacheHandle:
        return CacheHandle(ref=plan.entry_id, includes=plan.params.includes(),
                           supersedes=supersedes, cached_tokens=len(plan.prefix),
                           written_tokens=written, reused_tokens=reused, source=source,
                           computed_tokens=computed)

    @contextlib.contextmanager
    def _key_lock(self, entry_id: str) -> Iterator[None]:
        # Stripes keep the number of lock files bounded (deleting a lock file someone may
        # be waiting on is unsafe, so they are never deleted).
        stripe = int(entry_id[:2], 16) % LOCK_STRIPES
        path = self._store.layout.state / f"prepare-{stripe:02x}.lock"
        with hold(path, exclusive=True, timeout=self.lock_timeout, what="preparing a cache"):
            yield

    def _prepare_slow(self, plan: Plan) -> tuple[CacheHandle, PrepareWork | None]:
        if plan.params.read_only:
            loaded = self._entries.load_exact(plan, touch=False)
            if loaded is None:
                return CacheHandle.empty(), None
            self._remember(plan, loaded)
            return self._handle(plan, source="disk"), PrepareWork(disk=len(plan.prefix))
        # A hit needs no lock; and a disk that did not answer is not waited on for one
        # (the lock file is on it): the prepare goes on without the store.
        loaded = self._entries.load_exact(plan, touch=True)
        if loaded is not None:
            self._remember(plan, loaded)
            return self._handle(plan, source="disk"), PrepareWork(disk=len(plan.prefix))
        try:
            if self._deadlines.down:
                return self._prepare_locked(plan)  # every store call is skipped at once
            with self._key_lock(plan.entry_id):
                return self._prepare_locked(plan)
        except SpoolError as exc:
            if isinstance(exc, ConfigError):
                raise
            log.warning("prepare fell back to a cold run: %s", reason(exc))
            return CacheHandle.empty(), None

    def _prepare_locked(self, plan: Plan) -> tuple[CacheHandle, PrepareWork | None]:
        total = len(plan.prefix)
        loaded = self._entries.load_exact(plan, touch=True)
        if loaded is not None:
            self._remember(plan, loaded)
            return self._handle(plan, source="disk"), PrepareWork(disk=total)
        rows = self._entries.relatives(plan) if self.format.bases else []
        if any(same_params(index, plan) for _, _, index in rows):
            # The same params were stored under another rendering: the prompt moved (a
            # template that renders the date). A miss of its own kind, never a quarantine.
            self._count(prefix_moved=1)
            log.info("the rendered prompt prefix changed since it was cached (e.g. a date "
                     "in the chat template): a miss, prefilling it again")
        based = self._entries.from_base(plan, rows) if rows else None
        base_where, extends = "", False
        if based is not None:
            cache, keep, base_id, base_where, extends = based
            suffix = list(plan.prefix.tokens[keep:])
            try:
                if suffix:
                    cache = self.format.extend(cache, suffix)
                source, computed, reused = "incremental", len(suffix), keep
            except Exception as exc:  # a base the model cannot extend: start over cold
                log.warning("incremental prefill on a base failed, prefilling cold: %s",
                            reason(exc))
                based = None
        if based is None:
            cache = self._prefill_with_snapshot(plan)
            base_id, source, computed, reused = None, "cold", total, 0
        if not self._still(plan):  # switched mid-prefill: a cache of no one model state
            log.warning("the model changed during a prefill (adapters switched?): that cache "
                        "is dropped and the query runs cold")
            return CacheHandle.empty(), None
        # Only a base this entry strictly extends is superseded; a sibling that shares a
        # shorter prefix (the system message) stays (decision 2100). A base a live handle
        # of this controller holds is released later, once nobody holds it.
        supersedes = base_id if extends and computed > 0 else None
        with self._lock:
            deferred = supersedes is not None and self._book.held(supersedes)
        persisted = self._commit(plan, cache, None if deferred else supersedes)
        self._remember(plan, Loaded(cache, plan.prefix))
        written = computed if persisted else 0
        with self._lock:
            if source == "cold":
                self._stats.cold_prefills += 1
            else:
                self._stats.incremental_prefills += 1
            self._stats.tokens_written += written
            self._stats.tokens_reused += reused
            if supersedes is not None and persisted:
                if deferred:
                    self._superseded[supersedes] = plan.entry_id
                else:
                    # The commit released the base (supersedes); ours to delete at close.
                    self._released.add(supersedes)
                    self._memory.pop(supersedes, None)
        work = PrepareWork(memory=reused if base_where == "memory" else 0,
                           disk=reused if base_where == "disk" else 0,
                           computed=computed, written=written)
        return self._handle(plan, source=source, written=written, reused=reused,
                            computed=computed,
                            supersedes=supersedes if persisted else None), work

    def _prefill_with_snapshot(self, plan: Plan) -> Any:
        """A cold prefill of ``plan``; for caches that cannot be cut back it runs through the
        instructions first and commits that state as an entry of its own (a snapshot that
        later prefills extend and never supersede), then extends a copy."""
        snap = snapshot_plan(self.format, plan)
        if snap is None:
            return self.format.prefill(plan)
        try:
            # No key lock of its own (a second stripe lock could wait on the one held):
            # a put of an entry that exists is a no-op, so racing writers are harmless.
            done, known = self._entries.on_disk(lambda: self._store.lookup(
                self.kind, snap.namespace, snap.key, touch=False, tenant=self._tenancy.tenant),
                self._deadlines.lookup_deadline_s)
            head = self.format.prefill(snap)
            if done and known is None and self._still(snap):
                self._commit(snap, head, None, snapshot=True)
            self._remember(snap, Loaded(head, snap.prefix))
            if getattr(self.format, "extends_by_token", False):
                # The model continues a state one token at a time (transformers' Mamba):
                # a second cold forward of the whole prefix is far cheaper than that.
                return self.format.prefill(plan)
            rest = list(plan.prefix.tokens[len(snap.prefix):])
            return self.format.extend(self.format.clone(head), rest)
        except (SpoolError, ValueError, RuntimeError) as exc:
            if isinstance(exc, ConfigError):
                raise
            log.warning("instructions snapshot skipped: %s", reason(exc))
            return self.format.prefill(plan)

    def _still(self, plan: Plan) -> bool:
        """Whether the model is still in the state ``plan`` was made in (formats whose model
        cannot change always are)."""
        still = getattr(self.format, "still", None)
        return bool(still(plan)) if callable(still) else True

    def _commit(self, plan: Plan, cache: Any, base_id: str | None, *,
                snapshot: bool = False) -> bool:
        if not self._entries.commit(plan, cache, base_id, snapshot=snapshot):
            return False
        with self._lock:
            # A commit revives an entry this controller had released earlier.
            self._released.discard(plan.entry_id)
        return True

    def _remember(self, plan: Plan, loaded: Loaded) -> None:
        with self._lock:
            self._book.know(plan.entry_id, plan.params)
            if self.memory_entries == 0:
                return
            self._memory[plan.entry_id] = loaded
            self._memory.move_to_end(plan.entry_id)
            while len(self._memory) > self.memory_entries:
                self._memory.popitem(last=False)

    def _store_imported(self, params: CachePrepareParams, plan: Plan, cache: Any
                        ) -> CacheHandle:
        """Commit ``cache`` (checked and copied by ``import_cache``) as ``plan``'s entry,
        keep it loaded, and return its handle (``source="import"``)."""
        with self._key_lock(plan.entry_id):
            persisted = self._commit(plan, cache, None)
        self._remember(plan, Loaded(cache, plan.prefix))
        written = len(plan.prefix) if persisted else 0
        return self._book.stamp(params, self._handle(plan, source="import", written=written),
                                None)

    # -- loading ------------------------------------------------------------------------

    def _loaded(self, handle: CacheHandle,
                params: CachePrepareParams) -> tuple[Loaded | None, bool]:
        """The loaded cache of ``handle`` (memory, else reloaded from disk when it was
        evicted) and whether it was reloaded; (None, False) if it is gone."""
        with self._lock:
            loaded = self._memory.get(handle.ref)
        if loaded is not None:
            return loaded, False
        try:
            plan = self._plan(params)
        except UnidentifiedModel:
            return None, False
        if plan is None or plan.entry_id != handle.ref:
            return None, False
        loaded = self._entries.load_exact(plan, touch=not params.read_only)
        if loaded is None:  # released, deleted or corrupt meanwhile
            return None, False
        self._remember(plan, loaded)
        return loaded, True

    # -- release -------------------------------------------------------------------------

    def release(self, ref: str | CacheHandle) -> None:
        """Hint that an entry (a handle, or its ``ref``) is no longer needed: out of reuse
        at once (memory and store); its bytes are deleted by ``close()`` or store
        maintenance. Releasing an empty handle does nothing."""
        ref = ref_of(ref)
        if ref is None:
            return
        validate_entry_id(ref)
        self._check_writable("release entries")
        with self._lock:
            # Params stay known so generate(handle) still works (cold) after a release.
            self._memory.pop(ref, None)
            self._released.add(ref)
        try:
            self._store.release(ref)
        except SpoolError as exc:
            if isinstance(exc, ConfigError):
                raise
            log.warning("a release was not recorded: %s", reason(exc))
