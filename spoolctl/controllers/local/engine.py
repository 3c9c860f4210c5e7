"""The local prompt-cache controller engine, shared by the PyTorch, MLX and mlx-vlm controllers.

Everything but the framework and the entry format lives here once: the in-memory LRU,
single-flight of identical ``prepare`` calls (in-process and across processes), verified
disk lookups, base selection, incremental prefill, commit, release and ``close()``. What an
entry is belongs to the controller's ``EntryFormat``; the engine is composed of parts
(``entry_io``, ``handle_book``, ``build``, ``use``) and forwards to them.

Guarantees:

* Same parameters -> same entry, served from memory, else from disk.
* A stored cache is used only if its identity, token ids and digests verify and its tokens
  are a prefix of the prompt; anything else is a miss (bad bytes quarantined): the request
  runs cold, never raises, never yields tokens a cold run would not.
* ``read_only`` never writes to the store; it uses exact hits only.
* Store trouble while writing never fails ``prepare``; a disk that does not answer costs
  at most one deadline, then the controller runs without its store until it answers.
* Default log lines never name an entry, a digest or a store path (``logsafe``).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from spoolctl.compose import forward
from spoolctl.store import (
    ConfigError,
    SpoolError,
    Store,
    refuse_encrypted,
    validate_entry_id,
)

from ..contract import CacheHandle, CachePrepareParams, GenerateResult, KVBackend
from ..flight import PrepareFlights
from ..logsafe import reason
from ..options import strict_options
from ..targets import ref_of
from .build import LOCK_STRIPES, BuildContext, EntryBuilder
from .deadlines import DEFAULT_LOOKUP_DEADLINE_S, DEFAULT_READ_DEADLINE_S, StoreDeadlines
from .entry_format import FORMAT, EntryFormat, KVEntryFormat, Loaded, Plan
from .entry_io import EntryIO
from .handle_book import HandleBook
from .model_params import normalize_params
from .model_state import UnidentifiedModel
from .store_open import default_max_bytes
from .store_open import open_store as _open_store
from .tenancy import SealedFormat, Tenancy
from .usage import ControllerStats, PrepareWork
from .use import CacheUse, UseContext

log = logging.getLogger("spoolctl.controllers")

LOCAL_KINDS = frozenset({"pytorch", "mlx"})
DEFAULT_MEMORY_ENTRIES = 4
DEFAULT_LOCK_TIMEOUT = 600.0

__all__ = ["DEFAULT_LOCK_TIMEOUT", "DEFAULT_MEMORY_ENTRIES", "FORMAT", "LOCK_STRIPES",
           "ControllerStats", "GenerateResult", "KVBackend", "LocalCacheController"]


@strict_options
class LocalCacheController:
    """A ``PromptCacheController`` for in-process inference, generic over a backend and
    its entry format.

    ``backend``: a ``KVBackend`` (entries are ``KVEntryFormat``'s), or the backend of
    ``entry_format``. ``root``: a store path, an open ``Store`` (left open), or None for a
    managed temporary store that ``close()`` removes. ``memory_entries``: loaded caches kept
    (LRU). ``max_bytes``: the limit of a store this controller creates; another value for
    an existing store is a ConfigError. ``lock_timeout``: how long ``prepare`` waits for
    another process on the same key stripe before running cold. ``read_only``: exact hits
    only, nothing written, ``release`` / ``import_cache`` refused. ``tenant``: on an
    encrypted store, the tenant whose key seals the entries (ConfigError on a plain store).
    ``lookup_deadline`` / ``read_deadline``: when the disk counts as not answering.
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
                # image digests) to be sealed; one that does not fails closed.
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
        # holds them (the handles are the book's).
        self._superseded: dict[str, str] = {}
        self._closed = False
        self._warned_bypass = False
        self._stats = ControllerStats()
        self._book = HandleBook(self._lock)
        self._entries = EntryIO(store=self._store, deadlines=self._deadlines,
                                tenancy=self._tenancy, entry_format=self.format, kind=self.kind,
                                identity=self.identity, read_only=self.read_only,
                                count=self._count, lock=self._lock, memory=self._memory)
        self._build = EntryBuilder(BuildContext(
            format=self.format, entries=self._entries, store=self._store,
            deadlines=self._deadlines, tenancy=self._tenancy, kind=self.kind, lock=self._lock,
            book=self._book, stats=self._stats, memory=self._memory, released=self._released,
            superseded=self._superseded, count=self._count,
            lock_timeout=lambda: self.lock_timeout, memory_entries=lambda: self.memory_entries))
        self._use = CacheUse(UseContext(
            format=self.format, check_open=self._check_open,
            check_writable=self._check_writable, normalize=self._normalize,
            prepare=self.prepare, known=self._book.known, take_work=self._book.take_work,
            loaded=self._loaded, record_query=self.record_query,
            store_imported=self._build.store_imported))

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
    def deadlines(self) -> StoreDeadlines:
        """The lookup / read deadlines of this controller's store calls."""
        return self._deadlines

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
        self._build.close()  # the checkpoints still waiting are written (outside the lock)
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
                handle = self._book.stamp(params, self._build.handle(plan, source="memory"),
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
                                  lambda: self._book.stamp(params, *self._build.prepare_slow(plan)))

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

    # -- loading ------------------------------------------------------------------------

    def _loaded(self, handle: CacheHandle,
                params: CachePrepareParams) -> tuple[Loaded | None, bool]:
        """The loaded cache of ``handle`` (memory, else reloaded from disk when it was
        evicted) and whether it was reloaded; (None, False) if it is gone or empty."""
        if handle.ref is None:
            return None, False
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
        self._build.remember(plan, loaded)
        return loaded, True

    # -- release -------------------------------------------------------------------------

    def release(self, ref: str | CacheHandle) -> None:
        """Hint that an entry (a handle, or its ``ref``) is no longer needed: out of reuse
        at once (memory and store); its bytes are deleted by ``close()`` or store
        maintenance. Releasing an empty handle does nothing."""
        entry_id = ref_of(ref)
        if entry_id is None:
            return
        validate_entry_id(entry_id)
        self._check_writable("release entries")
        with self._lock:
            # Params stay known so generate(handle) still works (cold) after a release.
            self._memory.pop(entry_id, None)
            self._released.add(entry_id)
        try:
            self._store.release(entry_id)
        except SpoolError as exc:
            if isinstance(exc, ConfigError):
                raise
            log.warning("a release was not recorded: %s", reason(exc))
