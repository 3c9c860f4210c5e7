"""The local prompt-cache controller engine, shared by the PyTorch and MLX controllers.

Everything but the framework lives here, once: key derivation, namespaces,
token prefixes, base selection and incremental prefill, the in-memory LRU,
coalescing of concurrent identical ``prepare`` calls (threads), cross-process
single-flight (a lock per key stripe under the store's ``state/``), release,
``close()`` and usage. A backend (``KVBackend``) only tokenizes, prefills,
trims, generates and turns its KV cache into bytes and back.

Guarantees:

* Same parameters -> same entry (id = kind + backend-identity namespace +
  ``CachePrepareParams.key()``), served from memory, else from disk.
* A stored cache is used only if its manifest identity, token ids, prefix
  digests and payload digests all verify, and its tokens are a prefix of the
  prompt. Anything else is a miss (quarantined when the bytes are bad): the
  request runs cold (``cache_read_tokens = 0``), never raises, never yields
  tokens a cold run would not.
* ``read_only`` params never write to the store (no entry, no lock file, no
  LRU clock update); they use exact hits only, else an empty handle.
* Store trouble while writing (full disk, busy lock) never fails ``prepare``:
  the cache is still served from memory, just not persisted.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from spoolctl.store import (
    ConfigError,
    CorruptionError,
    Manifest,
    NotFoundError,
    QuarantineReason,
    SpoolError,
    Store,
    entry_id_for,
    validate_entry_id,
)
from spoolctl.store.locks import hold

from .contract import CacheHandle, CachePrepareParams, Usage, render_segments
from .tokens import TokenPrefix, common_prefix_tokens, namespace_for, rank_bases

log = logging.getLogger("spoolctl.controllers")

FORMAT = "spoolctl-local-kv/v1"
LOCAL_KINDS = frozenset({"pytorch", "mlx"})
DEFAULT_MEMORY_ENTRIES = 4
DEFAULT_LOCK_TIMEOUT = 600.0
LOCK_STRIPES = 256  # lock files per store: bounded, and two keys rarely share one
MAX_BASE_TRIES = 3
MAX_KNOWN_PARAMS = 4096  # refs whose params generate(handle) can look up


def _safe(exc: BaseException) -> str:
    """What a default (WARNING) log line may say about ``exc``.

    Never an entry id or a store path: entry ids and object digests are derived from the
    prompt, and logs travel further than the store (see docs/SECURITY.md). A SpoolError's
    message carries no path (that is in ``exc.path``); other text is clipped.
    """
    if isinstance(exc, SpoolError):
        return exc.message
    return str(exc)[:200]


class _TransientReadError(Exception):
    """The store could not read an entry right now (I/O, busy): not the entry's fault."""


@runtime_checkable
class KVBackend(Protocol):
    """What a framework adapter provides. All token ids are plain ``int``.

    * ``kind``: the store entry kind ("pytorch" | "mlx").
    * ``identity()``: model id/path + revision/weights digest, dtype, device, framework
      versions. Hashed into the namespace and written to every manifest; two backends
      whose caches are not interchangeable must differ here.
    * ``tokenize_segments(segments)``: one id list per text segment (no special tokens
      except, at most, a BOS at the start of the first segment).
    * ``new_cache()``: an empty cache.
    * ``prefill(cache, tokens)``: extend ``cache`` (empty, loaded or trimmed) by ``tokens``
      (non-empty) and return it.
    * ``trim(cache, keep_tokens)``: keep the first ``keep_tokens`` (0 < keep <= length) and
      return the cache (may be the same object, modified).
    * ``serialize(cache, token_count)``: ``(objects, layout)``, the payload objects (name ->
      bytes) and a JSON-able layout description for ``deserialize``. Never pickle.
    * ``deserialize(objects, layout, token_count)``: a cache covering exactly
      ``token_count`` tokens; raise ``SpoolError`` or ``ValueError`` on ANY mismatch with the
      loaded model (layer count, heads, head dim, dtype, length...).
    * ``generate(cache, cached_tokens, prompt_tokens, max_new_tokens)``: greedy decode.
      ``prompt_tokens`` is the whole prompt; ``cache`` (or None) covers its first
      ``cached_tokens`` (always < len(prompt_tokens)). Must leave ``cache`` unchanged
      (clone first if decoding extends it in place) and return only the new token ids.

    Optional: ``clone(cache)`` (default ``copy.deepcopy``), ``decode(tokens) -> str``.
    """

    kind: str

    def identity(self) -> dict[str, str]: ...

    def tokenize_segments(self, segments: list[str]) -> list[list[int]]: ...

    def new_cache(self) -> Any: ...

    def prefill(self, cache: Any, tokens: list[int]) -> Any: ...

    def trim(self, cache: Any, keep_tokens: int) -> Any: ...

    def serialize(
        self, cache: Any, token_count: int
    ) -> tuple[dict[str, bytes | memoryview], dict]: ...

    def deserialize(
        self, objects: dict[str, memoryview], layout: dict, token_count: int
    ) -> Any: ...

    def generate(
        self, cache: Any | None, cached_tokens: int, prompt_tokens: list[int], max_new_tokens: int
    ) -> list[int]: ...


@dataclass
class ControllerStats:
    """Counters of one controller (``stats()``)."""

    queries: int = 0
    prepares: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    coalesced: int = 0
    cold_prefills: int = 0
    incremental_prefills: int = 0
    tokens_written: int = 0
    tokens_reused: int = 0
    load_failures: int = 0
    commit_failures: int = 0


@dataclass(frozen=True)
class GenerateResult:
    """Output of ``generate``: new token ids, their text (if the backend decodes), usage,
    and the handle that was used."""

    tokens: list[int]
    usage: Usage
    handle: CacheHandle
    text: str | None = None


@dataclass(frozen=True)
class _Plan:
    params: CachePrepareParams
    key: str
    entry_id: str
    prefix: TokenPrefix
    group: str
    elements: tuple[str, ...]
    lead_segments: int


@dataclass
class _Loaded:
    cache: Any
    prefix: TokenPrefix


class LocalCacheController:
    """A ``PromptCacheController`` for in-process inference, generic over a ``KVBackend``.

    ``root``: a store root path, an open ``Store`` (not closed by this controller), or
    None for a managed temporary store that ``close()`` removes entirely.
    ``memory_entries``: how many loaded caches stay in memory (LRU).
    ``lock_timeout``: how long ``prepare`` waits for another process preparing the same
    key stripe before giving up and returning an empty handle (run cold).
    """

    # The manifest format this controller writes and accepts, and how a rejection names it
    # (a subclass with its own entry format overrides both).
    entry_format = FORMAT
    entry_noun = "a local KV cache entry"

    def __init__(
        self,
        backend: KVBackend,
        root: str | Path | Store | None = None,
        *,
        max_bytes: int | None = None,
        memory_entries: int = DEFAULT_MEMORY_ENTRIES,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    ):
        if getattr(backend, "kind", None) not in LOCAL_KINDS:
            raise ConfigError(f"unsupported backend kind {getattr(backend, 'kind', None)!r}",
                              fix=f"use a backend of kind {' or '.join(sorted(LOCAL_KINDS))}")
        if memory_entries < 0:
            raise ConfigError("memory_entries must be >= 0", fix="pass 0 to keep nothing loaded")
        self.backend = backend
        self.kind: str = backend.kind
        self.identity = dict(backend.identity())
        self.namespace = namespace_for(self.kind, self.identity)
        self.memory_entries = memory_entries
        self.lock_timeout = lock_timeout
        self._managed: Path | None = None
        self._owns_store = True
        if isinstance(root, Store):
            self.store = root
            self._owns_store = False
        elif root is None:
            self._managed = Path(tempfile.mkdtemp(prefix="spoolctl-controller-"))
            self.store = Store.open(str(self._managed), create=True, max_bytes=max_bytes)
        else:
            self.store = Store.open(str(root), create=True, max_bytes=max_bytes)
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._memory: OrderedDict[str, _Loaded] = OrderedDict()
        self._params: OrderedDict[str, CachePrepareParams] = OrderedDict()
        self._inflight: dict[tuple[str, bool], Future[CacheHandle]] = {}
        self._active = 0
        self._released: set[str] = set()
        self._closed = False
        self._stats = ControllerStats()

    # -- context manager / lifecycle ------------------------------------------------------

    def __enter__(self) -> LocalCacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Wait for in-flight prepares, delete this controller's released entries, drop
        loaded caches, and remove a managed store entirely. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._active:
                self._idle.wait()
            released = sorted(self._released)
            self._released.clear()
            self._memory.clear()
            self._params.clear()
        try:
            if self._managed is None and released:
                self.store.delete_released(released)
        except SpoolError as exc:  # bytes stay released; `spoolctl clean` removes them
            log.warning("could not delete released entries at close: %s", _safe(exc))
        finally:
            if self._owns_store:
                self.store.close()
            if self._managed is not None:
                shutil.rmtree(self._managed, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("the controller is closed", fix="create a new controller")

    def record_query(self) -> None:
        """Count one query served (statistics only)."""
        with self._lock:
            self._stats.queries += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return asdict(self._stats)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    # -- prepare ---------------------------------------------------------------------------

    def entry_id(self, params: CachePrepareParams) -> str:
        """The store entry id ``params`` map to with this backend."""
        return entry_id_for(self.kind, self.namespace, params.key())

    def prepare(self, params: CachePrepareParams) -> CacheHandle:
        """Return a handle to a cache of the cacheable prefix of ``params``.

        Memory hit, else disk hit, else incremental prefill from the best base, else
        cold prefill (committed unless ``read_only``). No cacheable prefix (or a
        ``read_only`` miss) gives the empty handle. Raises only ConfigError for bad
        parameters (or a closed controller); store and cache defects become misses.
        """
        if not isinstance(params, CachePrepareParams):
            raise ConfigError(f"prepare() takes CachePrepareParams, not {type(params).__name__}",
                              fix="build CachePrepareParams(model=..., instructions=[...])")
        self._check_open()
        plan = self._plan(params)
        if plan is None:
            return CacheHandle.empty()
        flight = (plan.entry_id, params.read_only)
        with self._lock:
            self._check_open()
            self._stats.prepares += 1
            loaded = self._memory.get(plan.entry_id)
            if loaded is not None and loaded.prefix == plan.prefix:
                self._memory.move_to_end(plan.entry_id)
                self._stats.memory_hits += 1
                self._know(plan.entry_id, params)
                return self._handle(plan, source="memory")
            future = self._inflight.get(flight)
            leader = future is None
            if leader:
                future = Future()
                self._inflight[flight] = future
                self._active += 1
        if not leader:
            handle = future.result()
            self._count(coalesced=1)
            # The leader did the work; this caller wrote and reused nothing itself.
            return replace(handle, written_tokens=0, reused_tokens=0,
                           source="coalesced" if handle else handle.source)
        try:
            handle = self._prepare_slow(plan)
            future.set_result(handle)
            return handle
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            with self._lock:
                del self._inflight[flight]
                self._active -= 1
                self._idle.notify_all()

    def _plan(self, params: CachePrepareParams) -> _Plan | None:
        segments = render_segments(params, include_volatile=False)
        if not segments:
            return None
        ids = self.backend.tokenize_segments(segments)
        if len(ids) != len(segments):
            raise ConfigError("the backend returned the wrong number of token lists",
                              fix="fix the backend's tokenize_segments()")
        prefix = TokenPrefix.from_segments(ids)
        if not len(prefix):
            return None
        key = params.key()
        return _Plan(params=params, key=key,
                     entry_id=entry_id_for(self.kind, self.namespace, key), prefix=prefix,
                     group=params.group_hash(), elements=tuple(params.element_hashes()),
                     lead_segments=1 if params.tools else 0)

    def _handle(self, plan: _Plan, *, source: str, written: int = 0, reused: int = 0,
                supersedes: str | None = None) -> CacheHandle:
        return CacheHandle(ref=plan.entry_id, includes=plan.params.includes(),
                           supersedes=supersedes, cached_tokens=len(plan.prefix),
                           written_tokens=written, reused_tokens=reused, source=source)

    @contextlib.contextmanager
    def _key_lock(self, entry_id: str) -> Iterator[None]:
        # Stripes keep the number of lock files bounded (deleting a lock file someone may
        # be waiting on is unsafe, so they are never deleted).
        stripe = int(entry_id[:2], 16) % LOCK_STRIPES
        path = self.store.layout.state / f"prepare-{stripe:02x}.lock"
        with hold(path, exclusive=True, timeout=self.lock_timeout, what="preparing a cache"):
            yield

    def _prepare_slow(self, plan: _Plan) -> CacheHandle:
        params = plan.params
        if params.read_only:
            loaded = self._load_exact(plan, touch=False)
            if loaded is None:
                return CacheHandle.empty()
            self._remember(plan, loaded)
            return self._handle(plan, source="disk")
        try:
            with self._key_lock(plan.entry_id):
                return self._prepare_locked(plan)
        except SpoolError as exc:
            if isinstance(exc, ConfigError):
                raise
            log.warning("prepare fell back to a cold run: %s", _safe(exc))
            return CacheHandle.empty()

    def _prepare_locked(self, plan: _Plan) -> CacheHandle:
        loaded = self._load_exact(plan, touch=True)
        if loaded is not None:
            self._remember(plan, loaded)
            return self._handle(plan, source="disk")
        based = self._from_base(plan)
        if based is not None:
            cache, keep, base_id = based
            suffix = list(plan.prefix.tokens[keep:])
            try:
                if suffix:
                    cache = self.backend.prefill(cache, suffix)
                source, written, reused = "incremental", len(suffix), keep
            except Exception as exc:  # a base the model cannot extend: start over cold
                log.warning("incremental prefill on a base failed, prefilling cold: %s",
                            _safe(exc))
                based = None
        if based is None:
            cache = self.backend.prefill(self.backend.new_cache(), list(plan.prefix.tokens))
            base_id, source, written, reused = None, "cold", len(plan.prefix), 0
        persisted = self._commit(plan, cache, base_id)
        self._remember(plan, _Loaded(cache, plan.prefix))
        with self._lock:
            if source == "cold":
                self._stats.cold_prefills += 1
            else:
                self._stats.incremental_prefills += 1
            self._stats.tokens_written += written
            self._stats.tokens_reused += reused
            if base_id is not None and persisted:
                # The commit released the base (supersedes); it is ours to delete at close.
                self._released.add(base_id)
                self._memory.pop(base_id, None)
        return self._handle(plan, source=source, written=written, reused=reused,
                            supersedes=base_id if persisted else None)

    def _commit(self, plan: _Plan, cache: Any, base_id: str | None) -> bool:
        n = len(plan.prefix)
        try:
            objects, layout = self.backend.serialize(cache, n)
        except Exception as exc:  # the cache still serves this process from memory
            log.warning("cache could not be serialized, not persisted: %s", exc)
            self._count(commit_failures=1)
            return False
        meta = {"format": self.entry_format, "identity": self.identity, "layout": layout,
                "model": plan.params.model, "lead_segments": plan.lead_segments,
                "includes": plan.params.includes().to_json(), **plan.prefix.to_meta()}
        index = {"group": plan.group, "elements": list(plan.elements), "tokens": n}
        try:
            self.store.put(kind=self.kind, namespace=self.namespace, key=plan.key,
                           objects=objects, meta=meta, index=index, supersedes=base_id)
        except SpoolError as exc:
            # A full disk or a busy store must not fail the request: serve from memory.
            log.warning("cache not persisted (%s); serving it from memory", _safe(exc))
            self._count(commit_failures=1)
            return False
        with self._lock:
            # A commit revives an entry this controller had released earlier.
            self._released.discard(plan.entry_id)
        return True

    def _remember(self, plan: _Plan, loaded: _Loaded) -> None:
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
        self._params[ref] = params
        self._params.move_to_end(ref)
        while len(self._params) > MAX_KNOWN_PARAMS:
            self._params.popitem(last=False)

    # -- loading ------------------------------------------------------------------------

    def _load_exact(self, plan: _Plan, *, touch: bool) -> _Loaded | None:
        try:
            manifest = self.store.lookup(self.kind, self.namespace, plan.key, touch=touch)
        except SpoolError as exc:
            log.warning("cache lookup failed, treating as a miss: %s", _safe(exc))
            return None
        if manifest is None:
            return None
        loaded = self._load_manifest(manifest, expect=plan.prefix,
                                     quarantine=not plan.params.read_only)
        if loaded is not None:
            self._count(disk_hits=1)
        return loaded

    def _prefix_of(self, manifest: Manifest) -> TokenPrefix:
        meta = manifest.meta
        if meta.get("format") != self.entry_format:
            raise ValueError(f"not {self.entry_noun} (format {str(meta.get('format'))[:40]!r})")
        if meta.get("identity") != self.identity:
            raise ValueError("model identity in the manifest does not match the loaded model")
        if not isinstance(meta.get("layout"), dict):
            raise ValueError("manifest has no layout")
        return TokenPrefix.from_meta(meta)

    def _load_manifest(self, manifest: Manifest, *, expect: TokenPrefix | None,
                       quarantine: bool = True) -> _Loaded | None:
        """Verify and deserialize an entry; None (after quarantining bad entries) on any
        defect. ``expect``: the exact token prefix the entry must hold."""
        try:
            prefix = self._prefix_of(manifest)
            if expect is not None and prefix != expect:
                raise ValueError("cached token ids differ from the prompt's")
            try:
                objects = self.store.read_all(manifest)
            except (CorruptionError, NotFoundError):
                raise
            except SpoolError as exc:
                raise _TransientReadError(exc) from exc
            # Any error from here on, SpoolError included, is a defect of the entry itself
            # (its bytes verified but do not fit this model): quarantine it, so the next
            # prepare rebuilds it instead of missing on it forever.
            cache = self.backend.deserialize(objects, dict(manifest.meta["layout"]), len(prefix))
            return _Loaded(cache, prefix)
        except (CorruptionError, NotFoundError) as exc:
            # The store has already quarantined a corrupt entry; a deleted one is a miss.
            log.warning("cache entry unusable, treated as a miss: %s", _safe(exc))
            log.debug("unusable entry: %s (%s)", manifest.entry_id, exc)
        except _TransientReadError as exc:  # I/O trouble: a miss, the entry may be fine later
            log.warning("cache entry unreadable, treated as a miss: %s", _safe(exc.__cause__))
        except Exception as exc:  # any mismatch inside the payload or its description
            log.warning("cache entry rejected, treated as a miss: %s", _safe(exc))
            log.debug("rejected entry: %s", manifest.entry_id)
            if quarantine:
                with contextlib.suppress(SpoolError):
                    self.store.quarantine_entry(manifest.entry_id,
                                                QuarantineReason.MANIFEST_VALIDATION,
                                                f"{self.kind} cache rejected: {str(exc)[:300]}")
        self._count(load_failures=1)
        with self._lock:
            self._memory.pop(manifest.entry_id, None)
        return None

    def _clone(self, cache: Any) -> Any:
        clone = getattr(self.backend, "clone", None)
        return clone(cache) if clone is not None else copy.deepcopy(cache)

    def _from_base(self, plan: _Plan) -> tuple[Any, int, str] | None:
        """Best retained base: load it, trim it to the common token prefix. None if no
        usable base (any failure falls back to a cold prefill)."""
        try:
            rows = self.store.entries(kind=self.kind, namespace=self.namespace, hint="retain")
        except SpoolError as exc:
            log.warning("base selection skipped: %s", _safe(exc))
            return None
        candidates = rank_bases([(r.entry_id, r.key, r.index) for r in rows],
                                group=plan.group, elements=plan.elements,
                                exclude=plan.entry_id, lead_segments=plan.lead_segments)
        for cand in candidates[:MAX_BASE_TRIES]:
            with self._lock:
                in_memory = self._memory.get(cand.entry_id)
            if in_memory is not None:
                keep = common_prefix_tokens(in_memory.prefix, plan.prefix)
                if keep == 0:
                    continue
                cache, base_len = self._clone(in_memory.cache), len(in_memory.prefix)
            else:
                try:
                    manifest = self.store.lookup(self.kind, self.namespace, cand.key,
                                                 touch=False)
                except SpoolError:
                    continue
                if manifest is None:
                    continue
                try:
                    keep = common_prefix_tokens(self._prefix_of(manifest), plan.prefix)
                except ValueError:
                    keep = -1  # bad meta: _load_manifest below rejects and quarantines it
                if keep == 0:
                    continue
                loaded = self._load_manifest(manifest, expect=None)
                if loaded is None:
                    continue
                cache, base_len = loaded.cache, len(loaded.prefix)
            try:
                if keep < base_len:
                    cache = self.backend.trim(cache, keep)
            except Exception as exc:
                log.warning("could not trim a base: %s", _safe(exc))
                continue
            return cache, keep, cand.entry_id
        return None

    # -- release -------------------------------------------------------------------------

    def release(self, ref: str) -> None:
        """Hint that ``ref`` is no longer needed: out of reuse at once (memory and store);
        its bytes are deleted by ``close()`` or store maintenance."""
        validate_entry_id(ref)
        self._check_open()
        with self._lock:
            # Params stay known so generate(handle) still works (cold) after a release.
            self._memory.pop(ref, None)
            self._released.add(ref)
        try:
            self.store.release(ref)
        except SpoolError as exc:
            if isinstance(exc, ConfigError):
                raise
            log.warning("a release was not recorded: %s", _safe(exc))

    # -- generate ----------------------------------------------------------------------------

    def generate(
        self,
        target: CachePrepareParams | CacheHandle,
        prompt: str = "",
        max_new_tokens: int = 32,
        *,
        params: CachePrepareParams | None = None,
    ) -> GenerateResult:
        """Greedy-generate after the full prompt: every instruction and data element of the
        params (volatile ones included), then ``prompt`` as a last segment.

        ``target`` is the params (prepared here) or a handle from this controller's
        ``prepare`` (an empty handle needs ``params=``). The cache is used only if its
        tokens are a prefix of the prompt; if using it fails, the request is re-run cold
        (``usage.cache_read_tokens = 0``).
        """
        self._check_open()
        if max_new_tokens < 1:
            raise ConfigError("max_new_tokens must be >= 1", fix="ask for at least one token")
        written = 0
        if isinstance(target, CachePrepareParams):
            params = target
            handle = self.prepare(params)
            written = handle.written_tokens
        elif isinstance(target, CacheHandle):
            handle = target
            if handle.ref is not None:
                with self._lock:
                    params = self._params.get(handle.ref, params)
            if params is None:
                raise ConfigError("this handle was not prepared by this controller",
                                  fix="pass the CachePrepareParams (or params=) instead")
        else:
            raise ConfigError(f"generate() takes params or a handle, not {type(target).__name__}",
                              fix="pass CachePrepareParams or a CacheHandle")
        segments = render_segments(params, include_volatile=True)
        if prompt:
            segments.append(prompt)
        if not segments:
            raise ConfigError("the prompt is empty", fix="pass instructions, data or a prompt")
        prompt_tokens = [t for seg in self.backend.tokenize_segments(segments) for t in seg]
        if not prompt_tokens:
            raise ConfigError("the prompt tokenizes to nothing", fix="pass a non-empty prompt")
        cache, cached = self._cache_for(handle, params, prompt_tokens)
        try:
            out = self.backend.generate(cache, cached, prompt_tokens, max_new_tokens)
        except Exception as exc:
            if cache is None:
                raise
            log.warning("generation from the cache failed, rerunning cold: %s", exc)
            cache, cached = None, 0
            out = self.backend.generate(None, 0, prompt_tokens, max_new_tokens)
        self.record_query()
        usage = Usage(prompt_tokens=len(prompt_tokens), completion_tokens=len(out),
                      cache_read_tokens=cached, cache_write_tokens=written)
        decode = getattr(self.backend, "decode", None)
        text = decode(out) if decode is not None else None
        return GenerateResult(tokens=list(out), usage=usage, handle=handle, text=text)

    def _cache_for(self, handle: CacheHandle, params: CachePrepareParams,
                   prompt_tokens: list[int]) -> tuple[Any | None, int]:
        if handle.ref is None:
            return None, 0
        with self._lock:
            loaded = self._memory.get(handle.ref)
        if loaded is None:  # evicted from memory (or memory_entries=0): reload from disk
            plan = self._plan(params)
            if plan is None or plan.entry_id != handle.ref:
                return None, 0
            loaded = self._load_exact(plan, touch=not params.read_only)
            if loaded is None:  # released, deleted or corrupt meanwhile: run cold
                return None, 0
            self._remember(plan, loaded)
        return self._fit(loaded, prompt_tokens)

    def _fit(self, loaded: _Loaded, prompt_tokens: list[int]) -> tuple[Any | None, int]:
        """The cache and how many prompt tokens it covers, keeping at least one prompt
        token uncached (decoding needs the logits of the last prompt token)."""
        if not loaded.prefix.is_prefix_of(prompt_tokens):
            return None, 0
        cached = len(loaded.prefix)
        if cached < len(prompt_tokens):
            return loaded.cache, cached
        keep = len(prompt_tokens) - 1
        if keep <= 0:
            return None, 0
        try:
            return self.backend.trim(self._clone(loaded.cache), keep), keep
        except Exception as exc:
            log.warning("could not trim the cache for this prompt: %s", exc)
            return None, 0
