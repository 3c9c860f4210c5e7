"""``GoogleGenAICacheController``: Gemini API / Vertex AI context caching on the spool store.

* ``prepare`` / ``aprepare``: a live cache for ``params.key()`` from memory, else from the
  store (confirmed with one ``caches.get``), else one ``caches.create`` recorded in the
  store (``kind="genai"``); identical concurrent prepares share one create; ``read_only``
  never creates; a cache about to expire is extended with one PATCH.
* ``release``: the server resource is deleted at once (billed per hour); a failed delete
  stays released with ``remote_pending`` for ``clean_remote``, logged, never raised.
* ``close``: waits for in-flight prepares, deletes the caches it created.
* ``generate`` / ``agenerate``: ``generate_content`` with ``cached_content``, sending only
  what the cache does not hold; the target rule is ``targets.resolve_target``.

Server errors are one-line SpoolErrors; an unreadable record is a miss. The logic is written
once as generators yielding their I/O (``io``), run by ``drive_sync`` / ``drive_async``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from google import genai

from spoolctl.compose import forward
from spoolctl.store import (
    ConfigError,
    NotFoundError,
    SpoolError,
    Store,
)

from ..contract import CacheHandle, CachePrepareParams, GenerateResult
from ..flight import Flight, PrepareFlights
from ..logsafe import reason
from ..options import strict_options
from ..targets import hosted as _hosted
from ..targets import ref_of as _ref_of
from ..targets import refuse_foreign, resolve_target
from .book import GenaiBook, GenaiStats
from .generate import Query, agenerate_with_cache, generate_with_cache, with_max_tokens
from .io import Local, Remote, Step, drive_async, drive_sync, iter_one, target_of
from .records import (
    DEFAULT_TTL,
    KIND,
    GenaiRecord,
    cache_request,
    parse_ttl,
    store_key,
    to_unix,
    validate_name,
)
from .tenant import GenaiTenant

log = logging.getLogger("spoolctl.genai")

__all__ = ["GenaiStats", "GenerateResult", "GoogleGenAICacheController", "Query",
           "agenerate_with_cache", "generate_with_cache", "target_of"]


@strict_options
class GoogleGenAICacheController:
    """Context caches on the Gemini API or Vertex AI, recorded in a spool store.

    ``client`` is a ``google.genai.Client`` (``vertexai=True`` for Vertex AI, where
    resource names stay ``projects/P/locations/L/cachedContents/ID``). ``store`` is an
    open ``Store`` (left open at close) or a root path (opened with ``create=True``
    and closed at close). ``ttl`` is ``"<seconds>s"``. ``clock`` returns unix seconds
    (injectable for tests). ``tenant``: on an encrypted store, the tenant whose records
    these are (keyed per tenant, found by that tenant only; ``GenaiTenant``).
    """

    def __init__(
        self,
        client: genai.Client,
        store: Store | str | os.PathLike[str],
        *,
        ttl: str = DEFAULT_TTL,
        display_name: str = "spoolctl",
        min_remaining: float = 60.0,
        verify_store_hits: bool = True,
        clock: Callable[[], float] = time.time,
        tenant: str | None = None,
    ):
        self.ttl = ttl
        self.ttl_seconds = parse_ttl(ttl)
        if not 0 <= min_remaining < self.ttl_seconds:
            raise ConfigError(f"min_remaining {min_remaining} must be >= 0 and below the TTL "
                              f"({ttl})", fix="lower min_remaining or raise the TTL")
        if not isinstance(display_name, str) or len(display_name) > 96:
            raise ConfigError("display_name must be a string of at most 96 characters",
                              fix="shorten it (the server appends nothing)")
        self.client = client
        self.target = target_of(client)
        self.namespace = self.target.namespace()
        self.display_name = display_name
        self.min_remaining = float(min_remaining)
        self.verify_store_hits = verify_store_hits
        self.clock = clock
        self._owns_store = not isinstance(store, Store)
        self.store: Store = store if isinstance(store, Store) else \
            Store.open(os.fspath(store), create=True)
        try:
            self._tenant = GenaiTenant(self.store, tenant)
        except SpoolError:
            if self._owns_store:
                self.store.close()
            raise
        self._book = GenaiBook(self.store, self.namespace, clock)
        self._lock = self._book.lock
        self._flights = PrepareFlights(self._lock)
        self._closing = False
        self._closed = False

    record_query = forward(GenaiBook.record_query, "_book")
    stats = forward(GenaiBook.stats, "_book")
    sweep_expired = forward(GenaiBook.sweep_expired, "_book")

    # -- context management ----------------------------------------------------------------

    def __enter__(self) -> GoogleGenAICacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> GoogleGenAICacheController:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- prepare -----------------------------------------------------------------------------

    def prepare(self, params: CachePrepareParams) -> CacheHandle:
        """The handle of a live cache for ``params`` (created if needed, unless read_only);
        the empty handle when nothing can be cached. SpoolError (one line) when the server
        refuses or fails the create."""
        request = cache_request(_hosted(params))
        if request is None:
            return CacheHandle.empty()
        ckey = self._tenant.key(params)
        joined = self._join(ckey, params.read_only)
        if isinstance(joined, CacheHandle):
            handle = joined
        elif not joined.leader:
            handle = self._flights.wait(joined)
        else:
            handle = self._flights.lead(joined, lambda: drive_sync(
                self.client, self._prepare_steps(params, ckey, request)))
        return self._book.remember(params, handle)

    async def aprepare(self, params: CachePrepareParams) -> CacheHandle:
        """``prepare`` for asyncio (``client.aio``); coalesces with threads and tasks alike."""
        request = cache_request(_hosted(params))
        if request is None:
            return CacheHandle.empty()
        ckey = self._tenant.key(params)
        joined = self._join(ckey, params.read_only)
        if isinstance(joined, CacheHandle):
            handle = joined
        elif not joined.leader:
            handle = await self._flights.await_(joined)
        else:
            handle = await self._flights.alead(joined, lambda: drive_async(
                self.client, self._prepare_steps(params, ckey, request)))
        return self._book.remember(params, handle)

    def _join(self, ckey: str, read_only: bool) -> CacheHandle | Flight:
        """A memory hit, or this caller's place in the flight of ``ckey``."""
        with self._lock:
            if self._closing:
                raise ConfigError("the genai cache controller is closed",
                                  fix="create a new controller")
            rec = self._book.memory.get(ckey)
            if rec is not None and rec.remaining(self.clock()) > self.min_remaining:
                self._book.counts.memory_hits += 1
                return _handle(rec, "memory")
            flight = self._flights.join(ckey, read_only)
            if not flight.leader:
                self._book.counts.coalesced += 1
            return flight

    def _prepare_steps(self, params: CachePrepareParams, ckey: str,
                       request: dict[str, Any]) -> Step:
        now = self.clock()
        yield Local(lambda: self.sweep_expired(now))
        with self._lock:
            rec = self._book.memory.get(ckey)
        source = "memory"
        if rec is None:
            rec = yield Local(lambda: self._book.find_in_store(ckey, now))
            source = "store"
            if rec is not None and self.verify_store_hits:
                rec = yield from self._confirm(rec)
        if rec is not None and rec.remaining(now) <= self.min_remaining and not params.read_only:
            rec = yield from self._extend(rec)
        if rec is not None:
            with self._lock:
                self._book.memory[ckey] = rec
                if source == "store":
                    self._book.counts.disk_hits += 1
                else:
                    self._book.counts.memory_hits += 1
            return _handle(rec, "disk" if source == "store" else "memory")
        if params.read_only:
            return CacheHandle.empty()
        config = {"ttl": self.ttl, "display_name": self.display_name, **request}
        cc = yield Remote("create", {"model": params.model, "config": config},
                           "creating a cached content", self.target.describe())
        rec = self._record_of(cc, params, ckey)
        try:
            if not self._tenant.lost:  # a lost master key: served from memory, deleted at close
                yield Local(lambda: self.store.put(
                    kind=KIND, namespace=self.namespace, key=rec.store_key(), objects={},
                    meta=rec.meta(), index=rec.index(), tenant=self._tenant.tenant))
        except SpoolError:
            # Unrecorded caches would be billed with nothing to find them by: undo.
            try:
                yield Remote("delete", {"name": rec.name}, "deleting an unrecorded cache",
                              rec.name)
            except SpoolError as exc:
                log.warning("could not record or delete cache %s: %s", rec.name, reason(exc))
            raise
        with self._lock:
            self._book.memory[ckey] = rec
            self._book.created[rec.name] = rec.entry_id
            self._book.counts.creates += 1
        return _handle(rec, "cold")

    def _record_of(self, cc: Any, params: CachePrepareParams, ckey: str) -> GenaiRecord:
        now = self.clock()
        name = validate_name(cc.name)
        tokens = cc.usage_metadata.total_token_count if cc.usage_metadata else None
        return GenaiRecord(
            entry_id=self._tenant.entry_id(self.namespace, store_key(ckey, name)),
            name=name, model=cc.model or params.require_model(), key=ckey,
            display_name=cc.display_name or "",
            create_time=to_unix(cc.create_time) or now,
            expire_time=to_unix(cc.expire_time) or now + self.ttl_seconds,
            token_count=int(tokens or 0), includes=params.includes(), target=self.target)

    def _confirm(self, rec: GenaiRecord) -> Step:
        """Check a store record against the server; None (and the record released) if gone."""
        try:
            cc = yield Remote("get", {"name": rec.name}, "checking a cached content", rec.name)
        except NotFoundError:
            yield Local(lambda: self._book.forget(rec, "gone on the server"))
            return None
        expire = to_unix(cc.expire_time)
        if expire is not None and expire != rec.expire_time:
            yield Local(lambda: self.store.update_index(rec.entry_id, {"expire_time": expire}))
            rec = _replace(rec, expire_time=expire)
        return rec

    def _extend(self, rec: GenaiRecord) -> Step:
        """PATCH the TTL of a cache about to expire; None if it is already gone."""
        try:
            cc = yield Remote("update", {"name": rec.name, "config": {"ttl": self.ttl}},
                               "extending a cached content", rec.name)
        except NotFoundError:
            yield Local(lambda: self._book.forget(rec, "gone on the server"))
            return None
        expire = to_unix(cc.expire_time) or self.clock() + self.ttl_seconds
        yield Local(lambda: self.store.update_index(rec.entry_id, {"expire_time": expire}))
        with self._lock:
            self._book.counts.extends += 1
        return _replace(rec, expire_time=expire)

    # -- expiry ---------------------------------------------------------------------------

    def extend(self, ref: str, ttl: str | None = None) -> float:
        """Give cache ``ref`` a new TTL (default: the controller's). Returns the new expiry."""
        seconds_ttl = ttl or self.ttl
        parse_ttl(seconds_ttl)
        rec = self._book.lookup_name(validate_name(ref))
        if rec is None:
            raise NotFoundError(f"no live cache {ref} in this controller's store",
                                path=self.store.root, fix="prepare() it first")
        cc = drive_sync(self.client, iter_one(Remote("update", {"name": ref,
                                                          "config": {"ttl": seconds_ttl}},
                                               "extending a cached content", ref)))
        expire = to_unix(cc.expire_time) or self.clock() + parse_ttl(seconds_ttl)
        self.store.update_index(rec.entry_id, {"expire_time": expire})
        with self._lock:
            if rec.key in self._book.memory:
                self._book.memory[rec.key] = _replace(rec, expire_time=expire)
            self._book.counts.extends += 1
        return expire

    # -- release / close ---------------------------------------------------------------------

    def release(self, ref: str | CacheHandle) -> None:
        """Delete cache ``ref`` (or a handle's) on the server now and mark its record
        released; an empty handle does nothing.

        A server failure is logged in one line and recorded (``remote_pending``,
        ``remote_error``); the record stays released for ``clean_remote`` to retry.
        """
        name = _ref_of(ref)
        if name is not None:
            drive_sync(self.client, self._release_steps(validate_name(name)))

    async def arelease(self, ref: str | CacheHandle) -> None:
        name = _ref_of(ref)
        if name is not None:
            await drive_async(self.client, self._release_steps(validate_name(name)))

    def _release_steps(self, name: str) -> Step:
        rec = yield Local(lambda: self._book.lookup_name(name))
        if rec is None:
            log.debug("release of unknown genai cache %s ignored", name)
            return None
        with self._lock:
            memory = self._book.memory
            if memory.get(rec.key) is not None and memory[rec.key].name == name:
                del memory[rec.key]
            self._book.params.pop(name, None)

        def mark() -> None:
            # Held before released, so no cleanup can drop the record in between.
            self.store.update_index(rec.entry_id, {"remote_pending": True})
            self.store.release(rec.entry_id)
        yield Local(mark)
        if rec.expire_time <= self.clock():
            yield Local(lambda: self._book.settled(rec, None))
            return None
        try:
            yield Remote("delete", {"name": name}, "deleting a cached content", name)
        except NotFoundError:
            pass  # already gone: the goal is met
        except SpoolError as exc:
            failure = str(exc)[:300]
            yield Local(lambda: self.store.update_index(rec.entry_id, {"remote_error": failure}))
            with self._lock:
                self._book.counts.delete_failures += 1
            log.warning("%s", failure)
            return None
        yield Local(lambda: self._book.settled(rec, "deleted"))
        return None

    def _begin_close(self, timeout: float | None) -> list[str] | None:
        with self._lock:
            if self._closed:
                return None
            self._closing = True
            if not self._flights.wait_idle(timeout):
                log.warning("closing with %d prepare(s) still in flight", len(self._flights))
            return list(self._book.created)

    def _end_close(self) -> None:
        with self._lock:
            done, self._book.released_ok = self._book.released_ok, []
            self._closed = True
        try:
            if done:
                self.store.delete_released(done)
        except SpoolError as exc:  # records stay released; `spoolctl clean` removes them
            log.warning("could not delete released genai records at close: %s", reason(exc))
        finally:
            if self._owns_store:
                self.store.close()

    def close(self, timeout: float | None = None) -> None:
        """Wait for in-flight prepares, delete every cache this controller created, and
        remove the records of those deleted. Idempotent."""
        names = self._begin_close(timeout)
        if names is None:
            return
        try:
            for name in names:
                try:
                    self.release(name)
                except SpoolError as exc:  # a store failure: keep closing the others
                    log.warning("could not release %s at close: %s", name, reason(exc))
        finally:
            self._end_close()

    async def aclose(self, timeout: float | None = None) -> None:
        names = await asyncio.to_thread(self._begin_close, timeout)
        if names is None:
            return
        try:
            for name in names:
                try:
                    await self.arelease(name)
                except SpoolError as exc:
                    log.warning("could not release %s at close: %s", name, reason(exc))
        finally:
            await asyncio.to_thread(self._end_close)

    # -- generate ------------------------------------------------------------------------------

    def _belongs(self, handle: CacheHandle, params: CachePrepareParams) -> bool:
        """Whether ``handle`` is the cache ``params`` map to: by the params it was prepared
        for here, else by its record (memory, then the store)."""
        if handle.ref is None:
            return True
        known = self._book.known(handle.ref)
        if known is not None:
            return known.key() == params.key()
        if self._tenant.lost:
            return False  # nothing of the store is this controller's to trust
        try:
            rec = self._book.lookup_name(handle.ref)
        except SpoolError as exc:
            log.warning("could not look up a cache handle, running cold: %s", reason(exc))
            return False
        return rec is not None and rec.key == self._tenant.key(params)

    def generate(self, target: CachePrepareParams | CacheHandle, prompt: Query = "", *,
                 params: CachePrepareParams | None = None,
                 config: Mapping[str, Any] | None = None,
                 max_new_tokens: int | None = None) -> GenerateResult:
        """``generate_content`` after the whole prompt (instructions, data, tools, then
        ``prompt``), sending only what the cache does not hold. ``target``: params or a
        handle, resolved by ``targets.resolve_target`` (a handle of other params runs
        cold). A cache gone on the server re-runs the request cold."""
        query, handle = resolve_target(target, params, self._book.known_handle)
        _hosted(query)
        if handle is None:
            handle = self.prepare(query)
        else:
            handle = refuse_foreign(handle, self._belongs(handle, query), log)
        cfg = with_max_tokens(config, max_new_tokens)
        try:
            result = generate_with_cache(self.client, query, handle, prompt, config=cfg)
        except NotFoundError as exc:
            if not handle:
                raise
            log.warning("%s; rerunning cold", exc)
            self._book.drop_handle(handle)
            result = generate_with_cache(self.client, query, CacheHandle.empty(), prompt,
                                         config=cfg)
        return self._book.count_usage(result)

    async def agenerate(self, target: CachePrepareParams | CacheHandle, prompt: Query = "", *,
                        params: CachePrepareParams | None = None,
                        config: Mapping[str, Any] | None = None,
                        max_new_tokens: int | None = None) -> GenerateResult:
        """``generate`` for asyncio (``client.aio.models``)."""
        query, handle = resolve_target(target, params, self._book.known_handle)
        _hosted(query)
        if handle is None:
            handle = await self.aprepare(query)
        else:
            belongs = await asyncio.to_thread(self._belongs, handle, query)
            handle = refuse_foreign(handle, belongs, log)
        cfg = with_max_tokens(config, max_new_tokens)
        try:
            result = await agenerate_with_cache(self.client, query, handle, prompt, config=cfg)
        except NotFoundError as exc:
            if not handle:
                raise
            log.warning("%s; rerunning cold", exc)
            self._book.drop_handle(handle)
            result = await agenerate_with_cache(self.client, query, CacheHandle.empty(),
                                                prompt, config=cfg)
        return self._book.count_usage(result)

def _replace(rec: GenaiRecord, **changes: Any) -> GenaiRecord:
    return dataclasses.replace(rec, **changes)


def _handle(rec: GenaiRecord, source: str) -> CacheHandle:
    """``source``: "memory", "disk" (the store's record), "cold" (created now)."""
    reused = source != "cold"
    return CacheHandle(ref=rec.name, includes=rec.includes, cached_tokens=rec.token_count,
                       written_tokens=0 if reused else rec.token_count,
                       reused_tokens=rec.token_count if reused else 0, source=source)
