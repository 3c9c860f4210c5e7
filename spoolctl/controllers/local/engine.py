"""The local prompt-cache controller engine, shared by the PyTorch, MLX and mlx-vlm controllers.

Everything but the framework and the entry format lives here, once: the in-memory
LRU, single-flight of concurrent identical ``prepare`` calls (``flight.py``),
cross-process single-flight (a lock per key stripe under the store's ``state/``),
disk lookups with verification and quarantine, base selection and incremental
prefill, commit, release, ``close()``, the target of ``generate`` (``targets.py``)
and its usage. What an entry is -- key, prompt rendering, manifest fields, bytes,
continuation -- is the controller's ``EntryFormat`` (``entry_format.py``); the
framework is the format's backend (``contract.KVBackend`` for plain KV caches).

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
import dataclasses
import inspect
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from spoolctl.compose import forward
from spoolctl.store import MARKER as ROOT_MARKER
from spoolctl.store import (
    ConfigError,
    CorruptionError,
    Manifest,
    NotFoundError,
    QuarantineReason,
    SpoolError,
    Store,
    hold,
    refuse_encrypted,
    validate_entry_id,
)

from ..contract import CacheHandle, CachePrepareParams, GenerateResult, KVBackend
from ..flight import PrepareFlights
from ..logsafe import reason
from ..targets import ref_of
from .deadlines import DEFAULT_LOOKUP_DEADLINE_S, DEFAULT_READ_DEADLINE_S, StoreDeadlines
from .entry_format import FORMAT, EntryFormat, KVEntryFormat, Loaded, Plan
from .tenancy import SealedFormat, Tenancy
from .tokens import TokenPrefix, common_prefix_tokens, rank_bases
from .usage import ControllerStats, PrepareWork
from .use import CacheUse, UseContext

log = logging.getLogger("spoolctl.controllers")

LOCAL_KINDS = frozenset({"pytorch", "mlx"})
DEFAULT_MEMORY_ENTRIES = 4
DEFAULT_LOCK_TIMEOUT = 600.0
LOCK_STRIPES = 256  # lock files per store: bounded, and two keys rarely share one
MAX_BASE_TRIES = 3
#: A store a controller creates without ``max_bytes`` is bounded: a tenth of its
#: filesystem, at most 64 GiB, at least 1 GiB where the filesystem has 2 (decision 2104).
#: How often a memory hit moves an entry's LRU clock in the catalog (seconds; decision 2120).
MEMORY_TOUCH_INTERVAL = 60.0
DEFAULT_MAX_FRACTION = 10
DEFAULT_MAX_CAP = 64 << 30
DEFAULT_MAX_FLOOR = 1 << 30
MAX_KNOWN_PARAMS = 4096  # refs / prepare calls whose params generate(handle) can look up
#: One sequence for every controller of the process, so a handle of another controller
#: never matches a prepare call of this one.
_PREPARE_IDS = itertools.count(1)

__all__ = ["DEFAULT_LOCK_TIMEOUT", "DEFAULT_MEMORY_ENTRIES", "FORMAT", "LOCK_STRIPES",
           "ControllerStats", "GenerateResult", "KVBackend", "LocalCacheController"]


class _TransientReadError(Exception):
    """The store could not read an entry right now (I/O, busy): not the entry's fault."""


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
        self._params: OrderedDict[str, CachePrepareParams] = OrderedDict()
        self._calls: OrderedDict[int, tuple[CachePrepareParams, PrepareWork | None]] = \
            OrderedDict()
        self._released: set[str] = set()
        # Live handles of this controller by ref, and bases superseded by a strict
        # extension whose release waits until no live handle holds them (decision 2100).
        self._holders: dict[str, list[weakref.ref[CacheHandle]]] = {}
        self._superseded: dict[str, str] = {}
        self._closed = False
        self._stats = ControllerStats()
        # When this controller last moved each entry's LRU clock on a memory hit: a cache
        # served from memory for days is still "used" for the store's LRU and for
        # `spoolctl clean --unused-for` (decision 2120), at one catalog write per entry per
        # ``MEMORY_TOUCH_INTERVAL``, never one per hit.
        self._touched: dict[str, float] = {}
        self._use = CacheUse(UseContext(
            format=self.format, check_open=self._check_open,
            check_writable=self._check_writable, normalize=self._normalize,
            prepare=self.prepare, known=self._known, take_work=self._take_work,
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
            self._holders.clear()
        for base_id in pending:
            self._release_superseded(base_id)
        with self._lock:
            released = sorted(self._released)
            self._released.clear()
            self._memory.clear()
            self._params.clear()
            self._calls.clear()
        try:
            if self._managed is None and released and not self._on_disk(
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
        """``params`` for this controller: its model spelled as ``model_id`` (another
        model is refused), ``read_only`` forced on a read-only controller."""
        if not isinstance(params, CachePrepareParams):
            raise ConfigError(f"expected CachePrepareParams, not {type(params).__name__}",
                              fix="build CachePrepareParams(instructions=[...], data=[...])")
        changes: dict[str, Any] = {}
        model_id = self.model_id
        if params.model != model_id:
            if params.model is not None and not self._same_model(params.model):
                raise ConfigError(
                    f"params.model {params.model!r} is not the model this controller runs "
                    f"({model_id})", fix=f"pass model={model_id!r}, the model's directory, "
                                         "or leave model out")
            changes["model"] = model_id
        if self.read_only and not params.read_only:
            changes["read_only"] = True
        return dataclasses.replace(params, **changes) if changes else params

    def _same_model(self, name: str) -> bool:
        """Whether ``name`` spells this controller's model: its id, or a path that
        resolves to its directory (trailing slashes, ``~``, symlinks, relative paths)."""
        path = getattr(self.backend, "model_path", None)
        if path is None:
            return False
        try:
            return os.path.realpath(os.path.expanduser(name)) == os.path.realpath(path)
        except (OSError, ValueError):
            return False

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
        plan = self._plan(params)
        if plan is None:
            return self._stamp(params, CacheHandle.empty(), None)
        with self._lock:
            self._check_open()
            self._stats.prepares += 1
            loaded = self._memory.get(plan.entry_id)
            if loaded is not None and loaded.prefix == plan.prefix:
                self._memory.move_to_end(plan.entry_id)
                self._stats.memory_hits += 1
                handle = self._stamp(params, self._handle(plan, source="memory"),
                                     PrepareWork(memory=len(plan.prefix)))
                touch = self._due_touch(plan.entry_id, params.read_only)
            else:
                handle = None
                flight = self._flights.join(plan.entry_id, params.read_only)
                if not flight.leader:
                    self._stats.coalesced += 1
        if handle is not None:
            if touch:  # outside the lock: a catalog write
                try:
                    self._on_disk(lambda: self._store.touch([plan.entry_id]),
                                  self._deadlines.lookup_deadline_s)
                except SpoolError as exc:  # the LRU clock is a hint; the hit stands
                    log.debug("memory hit not recorded in the catalog: %s", reason(exc))
            return handle
        if not flight.leader:
            shared = self._flights.wait(flight)
            # The leader's prefill, taken from memory: this call read it, wrote nothing.
            return self._stamp(params, shared,
                               PrepareWork(memory=shared.cached_tokens) if shared else None)
        return self._flights.lead(flight, lambda: self._stamp(params, *self._prepare_slow(plan)))

    def _due_touch(self, entry_id: str, read_only: bool) -> bool:
        """Whether a memory hit on ``entry_id`` should move its LRU clock in the catalog
        now (at most once per ``MEMORY_TOUCH_INTERVAL`` per entry; call under the lock)."""
        if read_only or self.read_only:
            return False
        now = time.monotonic()
        if now - self._touched.get(entry_id, -MEMORY_TOUCH_INTERVAL) < MEMORY_TOUCH_INTERVAL:
            return False
        self._touched[entry_id] = now
        while len(self._touched) > MAX_KNOWN_PARAMS:
            self._touched.pop(next(iter(self._touched)))
        return True

    def _stamp(self, params: CachePrepareParams, handle: CacheHandle,
               work: PrepareWork | None) -> CacheHandle:
        """``handle`` with a new ``prepare_id``; remember the call's params and work."""
        handle = dataclasses.replace(handle, prepare_id=next(_PREPARE_IDS))
        with self._lock:
            self._calls[handle.prepare_id] = (params, work)
            while len(self._calls) > MAX_KNOWN_PARAMS:
                self._calls.popitem(last=False)
            if handle.ref is not None:
                self._know(handle.ref, params)
                self._hold(handle)
        return handle

    # -- supersession: only strict extensions, only once nobody holds the base --------------

    def _hold(self, handle: CacheHandle) -> None:
        """Remember that ``handle`` (alive while its caller keeps it) holds its ref."""
        refs = self._holders.setdefault(handle.ref, [])
        refs[:] = [r for r in refs if r() is not None]
        refs.append(weakref.ref(handle))
        if len(self._holders) > MAX_KNOWN_PARAMS:
            for ref in [r for r in self._holders if not self._held(r)]:
                del self._holders[ref]

    def _held(self, ref: str) -> bool:
        """Whether a live handle of this controller holds ``ref`` (call under the lock)."""
        refs = self._holders.get(ref)
        if not refs:
            return False
        refs[:] = [r for r in refs if r() is not None]
        return bool(refs)

    def _settle(self) -> None:
        """Release the superseded bases that no live handle holds any more."""
        with self._lock:
            ready = [b for b in self._superseded if not self._held(b)]
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
            loaded = self._load_exact(plan, touch=False)
            if loaded is None:
                return CacheHandle.empty(), None
            self._remember(plan, loaded)
            return self._handle(plan, source="disk"), PrepareWork(disk=len(plan.prefix))
        # A hit needs no lock; and a disk that did not answer is not waited on for one
        # (the lock file is on it): the prepare goes on without the store.
        loaded = self._load_exact(plan, touch=True)
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

    def _prepare_locked(self, plan: Plan) -> tuple[CacheHandle, PrepareWork]:
        total = len(plan.prefix)
        loaded = self._load_exact(plan, touch=True)
        if loaded is not None:
            self._remember(plan, loaded)
            return self._handle(plan, source="disk"), PrepareWork(disk=total)
        rows = self._relatives(plan) if self.format.bases else []
        if any(_same_params(index, plan) for _, _, index in rows):
            # The same params were stored under another rendering: the prompt moved (a
            # template that renders the date). A miss of its own kind, never a quarantine.
            self._count(prefix_moved=1)
            log.info("the rendered prompt prefix changed since it was cached (e.g. a date "
                     "in the chat template): a miss, prefilling it again")
        based = self._from_base(plan, rows) if rows else None
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
        # Only a base this entry strictly extends is superseded; a sibling that shares a
        # shorter prefix (the system message) stays (decision 2100). A base a live handle
        # of this controller holds is released later, once nobody holds it.
        supersedes = base_id if extends and computed > 0 else None
        with self._lock:
            deferred = supersedes is not None and self._held(supersedes)
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

    def _snapshot_plan(self, plan: Plan) -> Plan | None:
        """The plan of the instructions alone, where a cold prefill of ``plan`` should also
        store a snapshot there: only for caches that cannot be cut back (sliding windows,
        recurrent states), whose entries otherwise serve only prompts that extend them whole
        -- with it, one system prompt over many documents still hits (decision 2602)."""
        params = plan.params
        if getattr(self.format, "trimmable", True) or not self.format.bases or \
                not params.instructions or not params.data or params.read_only:
            return None
        try:
            snap = self.format.plan(dataclasses.replace(params, data=()))
        except (SpoolError, ValueError, TypeError):
            return None
        if snap is None or snap.entry_id == plan.entry_id or \
                not 0 < len(snap.prefix) < len(plan.prefix) or \
                not snap.prefix.is_prefix_of(list(plan.prefix.tokens)):
            return None  # e.g. a chat template that renders the instructions differently
        return snap

    def _prefill_with_snapshot(self, plan: Plan) -> Any:
        """A cold prefill of ``plan``; for caches that cannot be cut back it runs through the
        instructions first and commits that state as an entry of its own (a snapshot that
        later prefills extend and never supersede), then extends a copy."""
        snap = self._snapshot_plan(plan)
        if snap is None:
            return self.format.prefill(plan)
        try:
            # No key lock of its own (a second stripe lock could wait on the one held):
            # a put of an entry that exists is a no-op, so racing writers are harmless.
            done, known = self._on_disk(lambda: self._store.lookup(
                self.kind, snap.namespace, snap.key, touch=False, tenant=self._tenancy.tenant),
                self._deadlines.lookup_deadline_s)
            head = self.format.prefill(snap)
            if done and known is None:
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

    def _commit(self, plan: Plan, cache: Any, base_id: str | None, *,
                snapshot: bool = False) -> bool:
        if self._tenancy.lost:  # said once at open; every commit would fail the same way
            return False
        try:
            objects, layout = self.format.serialize(cache, plan)
        except Exception as exc:  # the cache still serves this process from memory
            log.warning("cache could not be serialized, not persisted: %s", reason(exc))
            self._count(commit_failures=1)
            return False
        own_meta, own_index = self.format.describe(plan)
        meta = {"format": self.format.name, "identity": self.identity, "layout": layout,
                "model": plan.params.model, "includes": plan.params.includes().to_json(),
                **own_meta, **plan.prefix.to_meta()}
        index = {"group": plan.group, "elements": list(plan.elements),
                 "tokens": len(plan.prefix), **own_index,
                 **({"snapshot": True} if snapshot else {})}
        try:
            meta, objects = self._tenancy.seal_meta(meta, objects)
            done, _ = self._on_disk(lambda: self._store.put(
                kind=self.kind, namespace=plan.namespace, key=plan.key, objects=objects,
                meta=meta, index=index, supersedes=base_id, tenant=self._tenancy.tenant),
                self._deadlines.read_deadline_s)
        except SpoolError as exc:
            # A full disk or a busy store must not fail the request: serve from memory.
            log.warning("cache not persisted (%s); serving it from memory", reason(exc))
            self._count(commit_failures=1)
            return False
        if not done:  # it completes in the background once the disk answers, or never
            return False
        with self._lock:
            # A commit revives an entry this controller had released earlier.
            self._released.discard(plan.entry_id)
        return True

    def _remember(self, plan: Plan, loaded: Loaded) -> None:
        with self._lock:
            self._know(plan.entry_id, plan.params)
            if self.memory_entries == 0:
                return
            self._memory[plan.entry_id] = loaded
            self._memory.move_to_end(plan.entry_id)
            while len(self._memory) > self.memory_entries:
                self._memory.popitem(last=False)

    def _know(self, ref: str, params: CachePrepareParams) -> None:
        """Remember which params a ref was prepared for (for ``generate(handle)``); bounded."""
        with self._lock:
            self._params[ref] = params
            self._params.move_to_end(ref)
            while len(self._params) > MAX_KNOWN_PARAMS:
                self._params.popitem(last=False)

    def _known(self, handle: CacheHandle) -> CachePrepareParams | None:
        """The params this controller prepared ``handle`` for (its own prepare call,
        else the last prepare of its ref), or None."""
        with self._lock:
            call = self._calls.get(handle.prepare_id) if handle.prepare_id else None
            if call is not None:
                return call[0]
            return self._params.get(handle.ref) if handle.ref else None

    def _take_work(self, handle: CacheHandle) -> PrepareWork | None:
        """The work of ``handle``'s prepare call if not yet reported (then it is)."""
        with self._lock:
            call = self._calls.get(handle.prepare_id) if handle.prepare_id else None
            if call is None or call[1] is None:
                return None
            self._calls[handle.prepare_id] = (call[0], None)
            return call[1]

    def _store_imported(self, params: CachePrepareParams, plan: Plan, cache: Any
                        ) -> CacheHandle:
        """Commit ``cache`` (checked and copied by ``import_cache``) as ``plan``'s entry,
        keep it loaded, and return its handle (``source="import"``)."""
        with self._key_lock(plan.entry_id):
            persisted = self._commit(plan, cache, None)
        self._remember(plan, Loaded(cache, plan.prefix))
        written = len(plan.prefix) if persisted else 0
        return self._stamp(params, self._handle(plan, source="import", written=written), None)

    # -- loading ------------------------------------------------------------------------

    def _loaded(self, handle: CacheHandle,
                params: CachePrepareParams) -> tuple[Loaded | None, bool]:
        """The loaded cache of ``handle`` (memory, else reloaded from disk when it was
        evicted) and whether it was reloaded; (None, False) if it is gone."""
        with self._lock:
            loaded = self._memory.get(handle.ref)
        if loaded is not None:
            return loaded, False
        plan = self._plan(params)
        if plan is None or plan.entry_id != handle.ref:
            return None, False
        loaded = self._load_exact(plan, touch=not params.read_only)
        if loaded is None:  # released, deleted or corrupt meanwhile
            return None, False
        self._remember(plan, loaded)
        return loaded, True

    def _load_exact(self, plan: Plan, *, touch: bool) -> Loaded | None:
        try:
            done, manifest = self._on_disk(lambda: self._store.lookup(
                self.kind, plan.namespace, plan.key, touch=touch and not self.read_only,
                tenant=self._tenancy.tenant), self._deadlines.lookup_deadline_s)
        except SpoolError as exc:
            log.warning("cache lookup failed, treating as a miss: %s", reason(exc))
            return None
        if not done or manifest is None:
            return None
        loaded = self._load_manifest(manifest, plan=plan,
                                     quarantine=not plan.params.read_only)
        if loaded is not None:
            self._count(disk_hits=1)
        return loaded

    def _load_manifest(self, manifest: Manifest, *, plan: Plan | None,
                       quarantine: bool = True) -> Loaded | None:
        """Verify and load an entry; None (after quarantining bad entries) on any defect.
        ``plan``: the plan the entry must hold exactly (None: a base, any prefix)."""
        try:
            meta: Any = manifest.meta
            objects: dict[str, Any] | None = None
            if self._tenancy.active:  # the token meta is sealed: read (and decrypt) first
                try:
                    meta, objects = self._tenancy.open_meta(manifest,
                                                            self._read_objects(manifest))
                except (CorruptionError, NotFoundError):
                    raise
                except SpoolError as exc:
                    raise _TransientReadError(exc) from exc
            prefix = self.format.check(meta, plan)
            if plan is not None and prefix != plan.prefix:
                raise ValueError("cached token ids differ from the prompt's")
            try:
                if objects is None:
                    objects = self._read_objects(manifest)
            except (CorruptionError, NotFoundError):
                raise
            except SpoolError as exc:
                raise _TransientReadError(exc) from exc
            # Any error from here on, SpoolError included, is a defect of the entry itself
            # (its bytes verified but do not fit this model): quarantine it, so the next
            # prepare rebuilds it instead of missing on it forever.
            cache = self.format.load(objects, meta, prefix, plan)
            return Loaded(cache, prefix)
        except (CorruptionError, NotFoundError) as exc:
            # The store has already quarantined a corrupt entry; a deleted one is a miss.
            log.warning("cache entry unusable, treated as a miss: %s", reason(exc))
            log.debug("unusable entry: %s (%s)", manifest.entry_id, exc)
        except _TransientReadError as exc:  # I/O trouble: a miss, the entry may be fine later
            log.warning("cache entry unreadable, treated as a miss: %s",
                        reason(exc.__cause__ or exc))
        except Exception as exc:  # any mismatch inside the payload or its description
            log.warning("cache entry rejected, treated as a miss: %s", reason(exc))
            log.debug("rejected entry: %s", manifest.entry_id)
            if quarantine and not self.read_only:
                with contextlib.suppress(SpoolError):
                    self._store.quarantine_entry(
                        manifest.entry_id, QuarantineReason.MANIFEST_VALIDATION,
                        f"{self.format.label} cache rejected: {str(exc)[:300]}")
        self._count(load_failures=1)
        with self._lock:
            self._memory.pop(manifest.entry_id, None)
        return None

    def _relatives(self, plan: Plan) -> list[tuple[str, str, Any]]:
        """``(entry id, key, catalog index)`` of the retained entries of the plan's
        namespace other than its own (the candidates for a base); [] on store trouble."""
        try:
            done, rows = self._on_disk(lambda: self._store.entries(
                kind=self.kind, namespace=plan.namespace, hint="retain"),
                self._deadlines.lookup_deadline_s)
        except SpoolError as exc:
            log.warning("base selection skipped: %s", reason(exc))
            return []
        if not done:
            return []
        return [(r.entry_id, r.key, r.index) for r in rows
                if r.entry_id != plan.entry_id and self._tenancy.own(r.index)]

    def _from_base(self, plan: Plan, rows: list[tuple[str, str, Any]]
                   ) -> tuple[Any, int, str, str, bool] | None:
        """Best retained base: load it, trim it to the common token prefix. Returns
        ``(cache, kept tokens, base id, "memory" | "disk", whether the plan extends the
        whole base)``, or None if no usable base (any failure falls back to a cold
        prefill)."""
        candidates = rank_bases(rows, group=plan.group, elements=plan.elements,
                                exclude=plan.entry_id, lead_segments=plan.lead_segments)
        # Snapshots serve many prompts: a prompt that extends one never supersedes it.
        snapshots = {entry_id for entry_id, _, index in rows
                     if hasattr(index, "get") and index.get("snapshot") is True}
        for cand in candidates[:MAX_BASE_TRIES]:
            with self._lock:
                in_memory = self._memory.get(cand.entry_id)
            if in_memory is not None:
                keep = common_prefix_tokens(in_memory.prefix, plan.prefix)
                if keep == 0 or not self._can_cut(keep, len(in_memory.prefix)):
                    continue
                cache, base_len = self.format.clone(in_memory.cache), len(in_memory.prefix)
                where = "memory"
            else:
                try:
                    done, manifest = self._on_disk(partial(
                        self._tenancy.base_manifest, plan.namespace, cand.key, cand.entry_id),
                        self._deadlines.lookup_deadline_s)
                    if not done or manifest is None:
                        continue
                    meta = self._tenancy.open_meta(manifest)[0]  # sealed: the token meta
                except SpoolError:
                    continue
                try:
                    theirs = self.format.check(meta, None)
                    keep = common_prefix_tokens(theirs, plan.prefix)
                    if not self._can_cut(keep, len(theirs)):
                        continue  # not worth reading: its state is past the shared prefix
                except ValueError:
                    keep = -1  # bad meta: _load_manifest below rejects and quarantines it
                if keep == 0:
                    continue
                loaded = self._load_manifest(manifest, plan=None)
                if loaded is None:
                    continue
                cache, base_len, where = loaded.cache, len(loaded.prefix), "disk"
            try:
                if keep < base_len:
                    cache = self.format.trim(cache, keep)
            except Exception as exc:
                log.warning("could not trim a base: %s", reason(exc))
                continue
            return cache, keep, cand.entry_id, where, \
                keep == base_len and cand.entry_id not in snapshots
        return None

    def _can_cut(self, keep: int, base_len: int) -> bool:
        """Whether a base of ``base_len`` tokens can serve a plan sharing ``keep`` of them:
        always by extension (``keep == base_len``); by cutting back only where the format's
        caches can be cut exactly (full attention; not recurrent or window-full states)."""
        return keep == base_len or getattr(self.format, "trimmable", True)

    # -- the store's disk, with deadlines (``deadlines``) ---------------------------------

    def _on_disk(self, fn: Any, deadline_s: float) -> tuple[bool, Any]:
        """``fn()`` (a store call) within ``deadline_s``: ``(True, result)``, or
        ``(False, None)`` if the disk did not answer in time or is known not to (counted
        as ``disk_down``). The store's errors are raised as ``fn`` raised them."""
        done, result = self._deadlines.call(fn, deadline_s)
        if not done:
            self._count(disk_down=1)
        return done, result

    def _read_objects(self, manifest: Manifest) -> dict[str, Any]:
        """Every object of ``manifest``, verified (``Store.read``), each read within the
        read deadline; a late one raises ``_TransientReadError`` (a miss, no quarantine)."""
        out = {}
        for ref in manifest.objects:
            done, data = self._on_disk(partial(self._store.read, manifest, ref.name),
                                       self._deadlines.read_deadline_s)
            if not done:
                raise _TransientReadError("the store's disk did not answer in time")
            out[ref.name] = data
        return out

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


def _same_params(index: Any, plan: Plan) -> bool:
    """Whether a catalog index row describes the plan's own params (same group, same
    elements): with another entry id, the same params rendered other tokens."""
    return isinstance(index, dict) and index.get("group") == plan.group \
        and index.get("elements") == list(plan.elements)


def default_max_bytes(path: str | os.PathLike[str]) -> int:
    """The size limit of a store created at ``path`` without one: a tenth of the size of
    the filesystem that holds it, at most ``DEFAULT_MAX_CAP``, at least
    ``DEFAULT_MAX_FLOOR`` (or half the filesystem, if smaller)."""
    probe = Path(os.path.abspath(os.fspath(path)))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
        total = st.f_blocks * st.f_frsize
    except OSError:
        return DEFAULT_MAX_CAP
    floor = min(DEFAULT_MAX_FLOOR, total // 2)
    return max(1, min(DEFAULT_MAX_CAP, max(total // DEFAULT_MAX_FRACTION, floor)))


def _open_store(root: str | os.PathLike[str], *, max_bytes: int | None,
                read_only: bool) -> Store:
    """Open (create) the store at ``root``; ``read_only``: open an existing store for
    reading, through the store's read-only mode where this store library has one.

    One owner of the size limit: a new store gets ``max_bytes`` (default
    ``default_max_bytes``); an existing store keeps its own, and a different
    ``max_bytes`` is refused rather than rewritten for every worker sharing the store."""
    if not read_only:
        path = os.fspath(root)
        if not os.path.lexists(os.path.join(path, ROOT_MARKER)):
            limit = max_bytes if max_bytes is not None else default_max_bytes(path)
            return Store.open(path, create=True, max_bytes=limit)
        store = Store.open(path, create=True)
        if max_bytes is not None and max_bytes != store.max_bytes:
            have = store.max_bytes
            store.close()
            raise ConfigError(
                f"this store's size limit is {have if have is not None else 'unbounded'}"
                f" bytes, not max_bytes={max_bytes}: the limit belongs to the store, not to "
                "one of the workers sharing it", path=path,
                fix=f"leave max_bytes out, or change the limit for every worker with "
                    f"`spoolctl init --root {path} --max-size {max_bytes}`")
        return store
    if "read_only" in inspect.signature(Store.open).parameters:
        return Store.open(os.fspath(root), read_only=True)
    return Store.open(os.fspath(root))
