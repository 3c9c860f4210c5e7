"""``GoogleGenAICacheController``: Gemini API / Vertex AI context caching on the spool store.

Contract (same as the local controllers, see ``contract.py``):

* ``prepare(params)`` / ``aprepare(params)``: key = ``params.key()`` (model, system
  instruction, cacheable contents, tools...). A live, unexpired cache is reused from
  memory, else from the store (confirmed with one ``caches.get``); otherwise one
  ``caches.create`` is made, recorded in the store (``kind="genai"``) and returned.
  Concurrent identical prepares (threads and asyncio tasks) share one create.
  ``read_only`` never creates. Expired records are swept first. A cache with less than
  ``min_remaining`` seconds left is extended with one PATCH.
* ``release(ref)``: the server resource is deleted at once (it is billed per hour).
  The entry is marked released; a failed delete stays released with ``remote_pending``
  for ``clean_remote`` (``spoolctl clean --genai``); logged in one line, never raised.
* ``close()``: waits for in-flight prepares, deletes its caches (and records of those deleted).
* ``generate(...)`` / ``agenerate(...)``: ``generate_content`` with
  ``cached_content=handle.ref``, leaving out what ``handle.includes`` says the
  cache holds, with ``Usage.cache_read_tokens`` from ``cached_content_token_count``.
  Which params and which cache a call runs with follows the one rule of
  ``targets.resolve_target`` (decision 1022).

Server errors become one-line SpoolErrors (``genai_records.remote_error``); a record that
cannot be read is a miss (logged), never a failed call. Logic is written once, as
generators yielding their I/O (``genai_io``), run by ``drive_sync`` / ``drive_async``;
single-flight: ``flight``; ``generate_content``: ``genai_generate``; records: ``genai_records``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from google import genai

from spoolctl.store import (
    ConfigError,
    MalformedRow,
    NotFoundError,
    SpoolError,
    Store,
    entry_id_for,
)

from ..contract import CacheHandle, CachePrepareParams, GenerateResult
from ..flight import Flight, PrepareFlights
from ..logsafe import reason
from ..options import strict_options
from ..targets import hosted as _hosted
from ..targets import ref_of as _ref_of
from ..targets import refuse_foreign, resolve_target
from ..tenant_guard import master_key_lost, refuse_tenant_without_encryption
from .generate import Query, agenerate_with_cache, generate_with_cache, with_max_tokens
from .io import Local, Remote, Step, drive_async, drive_sync, iter_one, target_of
from .records import (
    DEFAULT_TTL,
    KIND,
    GenaiRecord,
    cache_request,
    expire_of,
    index_problem,
    parse_ttl,
    store_key,
    to_unix,
    validate_name,
)

log = logging.getLogger("spoolctl.genai")

__all__ = ["GenaiStats", "GenerateResult", "GoogleGenAICacheController", "Query",
           "agenerate_with_cache", "generate_with_cache", "target_of"]


@dataclass
class GenaiStats:
    """Counters since the controller was made."""

    queries: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    creates: int = 0
    coalesced: int = 0
    extends: int = 0
    deletes: int = 0
    delete_failures: int = 0
    expired: int = 0
    cache_read_tokens: int = 0

    def to_json(self) -> dict[str, int]:
        return dict(self.__dict__)


@strict_options
class GoogleGenAICacheController:
    """Context caches on the Gemini API or Vertex AI, recorded in a spool store.

    ``client`` is a ``google.genai.Client`` (``vertexai=True`` for Vertex AI, where
    resource names stay ``projects/P/locations/L/cachedContents/ID``). ``store`` is an
    open ``Store`` (left open at close) or a root path (opened with ``create=True``
    and closed at close). ``ttl`` is ``"<seconds>s"``. ``clock`` returns unix seconds
    (injectable for tests). ``tenant``: on an encrypted store, the tenant whose records
    these are (keyed per tenant, found by that tenant only; ``_GenaiTenant``, decision 2821).
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
        self._client = client
        self.target = target_of(client)
        self.namespace = self.target.namespace()
        self.display_name = display_name
        self.min_remaining = float(min_remaining)
        self.verify_store_hits = verify_store_hits
        self.clock = clock
        self._owns_store = not isinstance(store, Store)
        self.store = Store.open(os.fspath(store), create=True) if self._owns_store else store
        try:
            self._tenant = _GenaiTenant(self.store, tenant)
        except SpoolError:
            if self._owns_store:
                self.store.close()
            raise
        self._stats = GenaiStats()
        self._params: dict[str, CachePrepareParams] = {}  # ref -> params, for generate()
        self._lock = threading.Condition()
        self._memory: dict[str, GenaiRecord] = {}  # controller key -> live record
        self._created: dict[str, str] = {}  # name -> entry id, created here, not yet deleted
        self._released_ok: list[str] = []  # entry ids deleted on the server by this controller
        self._flights = PrepareFlights(self._lock)
        self._closing = False
        self._closed = False

    # -- context management ----------------------------------------------------------------

    def __enter__(self) -> GoogleGenAICacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> GoogleGenAICacheController:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def record_query(self) -> None:
        """Count one query served (statistics only)."""
        with self._lock:
            self._stats.queries += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self._stats.to_json()

    # -- prepare -----------------------------------------------------------------------------

    def prepare(self, params: CachePrepareParams) -> CacheHandle:
        """The handle of a live cache for ``params`` (created if needed, unless read_only).

        Returns the empty handle when nothing can be cached (see ``cache_request``).
        Raises a SpoolError (one line) when the server refuses or fails the create.
        Concurrent identical prepares share one create (``flight.py``).
        """
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
                self._client, self._prepare_steps(params, ckey, request)))
        return self._remember(params, handle)

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
                self._client, self._prepare_steps(params, ckey, request)))
        return self._remember(params, handle)

    def _remember(self, params: CachePrepareParams, handle: CacheHandle) -> CacheHandle:
        if handle.ref is not None:
            with self._lock:
                self._params[handle.ref] = params
        return handle

    def _known_handle(self, handle: CacheHandle) -> CachePrepareParams | None:
        return self._known(handle.ref) if handle.ref is not None else None

    def _known(self, ref: str) -> CachePrepareParams | None:
        with self._lock:
            return self._params.get(ref)

    def _join(self, ckey: str, read_only: bool) -> CacheHandle | Flight:
        """A memory hit, or this caller's place in the flight of ``ckey``."""
        with self._lock:
            if self._closing:
                raise ConfigError("the genai cache controller is closed",
                                  fix="create a new controller")
            rec = self._memory.get(ckey)
            if rec is not None and rec.remaining(self.clock()) > self.min_remaining:
                self._stats.memory_hits += 1
                return _handle(rec, "memory")
            flight = self._flights.join(ckey, read_only)
            if not flight.leader:
                self._stats.coalesced += 1
            return flight

    def _prepare_steps(self, params: CachePrepareParams, ckey: str,
                       request: dict[str, Any]) -> Step:
        now = self.clock()
        yield Local(lambda: self.sweep_expired(now))
        with self._lock:
            rec = self._memory.get(ckey)
        source = "memory"
        if rec is None:
            rec = yield Local(lambda: self._find_in_store(ckey, now))
            source = "store"
            if rec is not None and self.verify_store_hits:
                rec = yield from self._confirm(rec)
        if rec is not None and rec.remaining(now) <= self.min_remaining and not params.read_only:
            rec = yield from self._extend(rec)
        if rec is not None:
            with self._lock:
                self._memory[ckey] = rec
                if source == "store":
                    self._stats.disk_hits += 1
                else:
                    self._stats.memory_hits += 1
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
            self._memory[ckey] = rec
            self._created[rec.name] = rec.entry_id
            self._stats.creates += 1
        return _handle(rec, "cold")

    def _record_of(self, cc: Any, params: CachePrepareParams, ckey: str) -> GenaiRecord:
        now = self.clock()
        name = validate_name(cc.name)
        tokens = cc.usage_metadata.total_token_count if cc.usage_metadata else None
        return GenaiRecord(
            entry_id=self._tenant.entry_id(self.namespace, store_key(ckey, name)),
            name=name, model=cc.model or params.model, key=ckey,
            display_name=cc.display_name or "",
            create_time=to_unix(cc.create_time) or now,
            expire_time=to_unix(cc.expire_time) or now + self.ttl_seconds,
            token_count=int(tokens or 0), includes=params.includes(), target=self.target)

    def _find_in_store(self, ckey: str, now: float) -> GenaiRecord | None:
        """The live record for ``ckey`` with the latest expiry, or None."""
        rows = [r for r in self.store.entries(kind=KIND, namespace=self.namespace, hint="retain")
                if r.index.get("key") == ckey and not r.index.get("remote_pending")
                and index_problem(r.index) is None and expire_of(r.index) > now]
        for row in sorted(rows, key=lambda r: -expire_of(r.index)):
            try:
                return GenaiRecord.from_manifest(self.store.manifest(row.entry_id), row)
            except SpoolError:  # corrupt manifests are quarantined by the store: a miss
                continue
            except MalformedRow as exc:  # one bad record is a miss, never a failed prepare
                log.warning("genai record %s skipped: %s", row.entry_id[:16], exc.reason)
                continue
        return None

    def _confirm(self, rec: GenaiRecord) -> Step:
        """Check a store record against the server; None (and the record released) if gone."""
        try:
            cc = yield Remote("get", {"name": rec.name}, "checking a cached content", rec.name)
        except NotFoundError:
            yield Local(lambda: self._forget(rec, "gone on the server"))
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
            yield Local(lambda: self._forget(rec, "gone on the server"))
            return None
        expire = to_unix(cc.expire_time) or self.clock() + self.ttl_seconds
        yield Local(lambda: self.store.update_index(rec.entry_id, {"expire_time": expire}))
        with self._lock:
            self._stats.extends += 1
        return _replace(rec, expire_time=expire)

    def _forget(self, rec: GenaiRecord, why: str) -> None:
        """Drop a record whose server resource no longer exists (nothing left to delete)."""
        log.info("genai cache %s: %s", rec.name, why)
        self.store.update_index(rec.entry_id, {"remote_pending": None})
        self.store.release(rec.entry_id)
        with self._lock:
            if self._memory.get(rec.key) is not None and self._memory[rec.key].name == rec.name:
                del self._memory[rec.key]
            if self._created.pop(rec.name, None) is not None:
                self._released_ok.append(rec.entry_id)

    # -- expiry ---------------------------------------------------------------------------

    def sweep_expired(self, now: float | None = None) -> list[str]:
        """Release the records of this controller's namespace whose caches have expired
        (the server has dropped them; nothing to delete there). Returns their names."""
        now = self.clock() if now is None else now
        swept = []
        for row in self.store.entries(kind=KIND, namespace=self.namespace):
            if index_problem(row.index) is not None or expire_of(row.index) > now:
                continue  # a malformed record is left to `spoolctl clean`'s report
            if row.hint == "retain" or row.index.get("remote_pending"):
                self.store.update_index(row.entry_id, {"remote_pending": None})
                self.store.release(row.entry_id)
                swept.append(str(row.index.get("name")))
        with self._lock:
            for ckey in [k for k, r in self._memory.items() if r.expire_time <= now]:
                del self._memory[ckey]
            for name in swept:
                entry_id = self._created.pop(name, None)
                if entry_id is not None:
                    self._released_ok.append(entry_id)
            self._stats.expired += len(swept)
        return swept

    def extend(self, ref: str, ttl: str | None = None) -> float:
        """Give cache ``ref`` a new TTL (default: the controller's). Returns the new expiry."""
        seconds_ttl = ttl or self.ttl
        parse_ttl(seconds_ttl)
        rec = self._lookup_name(validate_name(ref))
        if rec is None:
            raise NotFoundError(f"no live cache {ref} in this controller's store",
                                path=self.store.root, fix="prepare() it first")
        cc = drive_sync(self._client, iter_one(Remote("update", {"name": ref,
                                                          "config": {"ttl": seconds_ttl}},
                                               "extending a cached content", ref)))
        expire = to_unix(cc.expire_time) or self.clock() + parse_ttl(seconds_ttl)
        self.store.update_index(rec.entry_id, {"expire_time": expire})
        with self._lock:
            if rec.key in self._memory:
                self._memory[rec.key] = _replace(rec, expire_time=expire)
            self._stats.extends += 1
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
            drive_sync(self._client, self._release_steps(validate_name(name)))

    async def arelease(self, ref: str | CacheHandle) -> None:
        name = _ref_of(ref)
        if name is not None:
            await drive_async(self._client, self._release_steps(validate_name(name)))

    def _lookup_name(self, name: str) -> GenaiRecord | None:
        with self._lock:
            for rec in self._memory.values():
                if rec.name == name:
                    return rec
        for row in self.store.entries(kind=KIND, namespace=self.namespace):
            if row.index.get("name") == name:
                try:
                    return GenaiRecord.from_manifest(self.store.manifest(row.entry_id), row)
                except (SpoolError, MalformedRow):
                    return None
        return None

    def _release_steps(self, name: str) -> Step:
        rec = yield Local(lambda: self._lookup_name(name))
        if rec is None:
            log.debug("release of unknown genai cache %s ignored", name)
            return None
        with self._lock:
            if self._memory.get(rec.key) is not None and self._memory[rec.key].name == name:
                del self._memory[rec.key]
            self._params.pop(name, None)

        def mark() -> None:
            # Held before released, so no cleanup can drop the record in between.
            self.store.update_index(rec.entry_id, {"remote_pending": True})
            self.store.release(rec.entry_id)
        yield Local(mark)
        if rec.expire_time <= self.clock():
            yield Local(lambda: self._settled(rec, None))
            return None
        try:
            yield Remote("delete", {"name": name}, "deleting a cached content", name)
        except NotFoundError:
            pass  # already gone: the goal is met
        except SpoolError as exc:
            failure = str(exc)[:300]
            yield Local(lambda: self.store.update_index(rec.entry_id, {"remote_error": failure}))
            with self._lock:
                self._stats.delete_failures += 1
            log.warning("%s", failure)
            return None
        yield Local(lambda: self._settled(rec, "deleted"))
        return None

    def _settled(self, rec: GenaiRecord, deleted: str | None) -> None:
        self.store.update_index(rec.entry_id, {"remote_pending": None, "remote_error": None})
        with self._lock:
            if deleted:
                self._stats.deletes += 1
            if self._created.pop(rec.name, None) is not None:
                self._released_ok.append(rec.entry_id)

    def _begin_close(self, timeout: float | None) -> list[str] | None:
        with self._lock:
            if self._closed:
                return None
            self._closing = True
            if not self._flights.wait_idle(timeout):
                log.warning("closing with %d prepare(s) still in flight", len(self._flights))
            return list(self._created)

    def _end_close(self) -> None:
        with self._lock:
            done, self._released_ok = self._released_ok, []
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
        known = self._known(handle.ref)
        if known is not None:
            return known.key() == params.key()
        if self._tenant.lost:
            return False  # nothing of the store is this controller's to trust
        try:
            rec = self._lookup_name(handle.ref)
        except SpoolError as exc:
            log.warning("could not look up a cache handle, running cold: %s", reason(exc))
            return False
        return rec is not None and rec.key == self._tenant.key(params)

    def generate(self, target: CachePrepareParams | CacheHandle, prompt: Query = "", *,
                 params: CachePrepareParams | None = None,
                 config: Mapping[str, Any] | None = None,
                 max_new_tokens: int | None = None) -> GenerateResult:
        """``generate_content`` after the whole prompt: the params' instructions, data
        (volatile ones included) and tools, then ``prompt``, sending only what the cache
        does not hold.

        ``target`` is the params (prepared here) or a handle; which params and which
        cache a call runs with follows ``targets.resolve_target`` (decision 1022):
        ``params=`` is the query when given, a handle of other params is refused (the
        query runs cold). If the cache turns out to be gone on the server, the request
        is re-run cold (``cache_read_tokens = 0``, ``result.handle`` empty).
        """
        query, handle = resolve_target(target, params, self._known_handle)
        _hosted(query)
        if handle is None:
            handle = self.prepare(query)
        else:
            handle = refuse_foreign(handle, self._belongs(handle, query), log)
        cfg = with_max_tokens(config, max_new_tokens)
        try:
            result = generate_with_cache(self._client, query, handle, prompt, config=cfg)
        except NotFoundError as exc:
            if not handle:
                raise
            log.warning("%s; rerunning cold", exc)
            self._drop_handle(handle)
            result = generate_with_cache(self._client, query, CacheHandle.empty(), prompt,
                                         config=cfg)
        return self._count_usage(result)

    async def agenerate(self, target: CachePrepareParams | CacheHandle, prompt: Query = "", *,
                        params: CachePrepareParams | None = None,
                        config: Mapping[str, Any] | None = None,
                        max_new_tokens: int | None = None) -> GenerateResult:
        """``generate`` for asyncio (``client.aio.models``)."""
        query, handle = resolve_target(target, params, self._known_handle)
        _hosted(query)
        if handle is None:
            handle = await self.aprepare(query)
        else:
            belongs = await asyncio.to_thread(self._belongs, handle, query)
            handle = refuse_foreign(handle, belongs, log)
        cfg = with_max_tokens(config, max_new_tokens)
        try:
            result = await agenerate_with_cache(self._client, query, handle, prompt, config=cfg)
        except NotFoundError as exc:
            if not handle:
                raise
            log.warning("%s; rerunning cold", exc)
            self._drop_handle(handle)
            result = await agenerate_with_cache(self._client, query, CacheHandle.empty(),
                                                prompt, config=cfg)
        return self._count_usage(result)

    def _drop_handle(self, handle: CacheHandle) -> None:
        # The server no longer knows the cache: the next prepare() looks again.
        with self._lock:
            for ckey in [k for k, r in self._memory.items() if r.name == handle.ref]:
                del self._memory[ckey]

    def _count_usage(self, result: GenerateResult) -> GenerateResult:
        with self._lock:
            self._stats.queries += 1
            self._stats.cache_read_tokens += result.usage.cache_read_tokens
        return result


def _replace(rec: GenaiRecord, **changes: Any) -> GenaiRecord:
    return dataclasses.replace(rec, **changes)


def _handle(rec: GenaiRecord, source: str) -> CacheHandle:
    """``source``: "memory", "disk" (the store's record), "cold" (created now)."""
    reused = source != "cold"
    return CacheHandle(ref=rec.name, includes=rec.includes, cached_tokens=rec.token_count,
                       written_tokens=0 if reused else rec.token_count,
                       reused_tokens=rec.token_count if reused else 0, source=source)


class _GenaiTenant:
    """The tenant of a genai controller on an encrypted store (issue 33 item 6, decision
    2821). A genai entry holds no payload, only a record of a server resource; what is
    prompt-derived in it is the controller key (``params.key()``, a digest of the model,
    instructions, contents and tools). With a tenant that key is replaced by a keyed hash
    under the tenant's naming key (``Sealer.sealed_key``), and the entry is committed with
    ``tenant=`` (its ``sealed`` fact names the tenant's opaque id, so ``keys revoke``
    releases it): two tenants' equal prompts share no key, entry id or row, and another
    tenant, or none, misses. A store without encryption takes ``tenant=`` as a ConfigError;
    a master key that is not the keyring's is one warning line at open, then every lookup
    misses and nothing is recorded (caches made meanwhile are deleted at ``close``)."""

    def __init__(self, store: Store, tenant: str | None):
        self._store = store
        refuse_tenant_without_encryption(store, tenant)
        sealer = store.sealer
        if sealer is None:
            self.active, self.tenant, self.lost = False, None, False
            return
        self.active, self.tenant = True, tenant
        sealer.tenant_id(tenant)  # a bad name is a ConfigError now, not at the first prepare
        self.lost = master_key_lost(store)
        if self.lost:
            log.warning("the configured master key (id %s) is not the one this store's keyring "
                        "was written under: every genai cache record is a miss and none is "
                        "recorded (docs/runbook.md, key loss)", sealer.master.key_id)

    def key(self, params: CachePrepareParams) -> str:
        """The controller key of ``params`` for this tenant."""
        if not self.active:
            return params.key()
        assert self._store.sealer is not None
        return self._store.sealer.sealed_key(self.tenant, "genai:" + params.key())

    def entry_id(self, namespace: str, key: str) -> str:
        if not self.active:
            return entry_id_for(KIND, namespace, key)
        return self._store.entry_id(KIND, namespace, key, tenant=self.tenant)
