"""What a genai controller knows: its live records (memory), the caches it created, the
params of its handles, its counters, and the records of its namespace in the store.

A part ``GoogleGenAICacheController`` is composed of; every field is read and written
under ``lock``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from spoolctl.store import MalformedRow, SpoolError, Store

from ..contract import CacheHandle, CachePrepareParams, GenerateResult
from .records import KIND, GenaiRecord, expire_of, index_problem

log = logging.getLogger("spoolctl.genai")


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


class GenaiBook:
    """The controller's records, in memory and in its store namespace."""

    def __init__(self, store: Store, namespace: str, clock: Callable[[], float]):
        self.store = store
        self.namespace = namespace
        self.clock = clock
        self.lock = threading.Condition()
        self.counts = GenaiStats()
        self.params: dict[str, CachePrepareParams] = {}  # ref -> params, for generate()
        self.memory: dict[str, GenaiRecord] = {}  # controller key -> live record
        self.created: dict[str, str] = {}  # name -> entry id, created here, not yet deleted
        self.released_ok: list[str] = []  # entry ids deleted on the server by this controller

    def record_query(self) -> None:
        """Count one query served (statistics only)."""
        with self.lock:
            self.counts.queries += 1

    def stats(self) -> dict[str, int]:
        with self.lock:
            return self.counts.to_json()

    def remember(self, params: CachePrepareParams, handle: CacheHandle) -> CacheHandle:
        if handle.ref is not None:
            with self.lock:
                self.params[handle.ref] = params
        return handle

    def known_handle(self, handle: CacheHandle) -> CachePrepareParams | None:
        return self.known(handle.ref) if handle.ref is not None else None

    def known(self, ref: str) -> CachePrepareParams | None:
        with self.lock:
            return self.params.get(ref)

    def find_in_store(self, ckey: str, now: float) -> GenaiRecord | None:
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

    def forget(self, rec: GenaiRecord, why: str) -> None:
        """Drop a record whose server resource no longer exists (nothing left to delete)."""
        log.info("genai cache %s: %s", rec.name, why)
        self.store.update_index(rec.entry_id, {"remote_pending": None})
        self.store.release(rec.entry_id)
        with self.lock:
            if self.memory.get(rec.key) is not None and self.memory[rec.key].name == rec.name:
                del self.memory[rec.key]
            if self.created.pop(rec.name, None) is not None:
                self.released_ok.append(rec.entry_id)

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
        with self.lock:
            for ckey in [k for k, r in self.memory.items() if r.expire_time <= now]:
                del self.memory[ckey]
            for name in swept:
                entry_id = self.created.pop(name, None)
                if entry_id is not None:
                    self.released_ok.append(entry_id)
            self.counts.expired += len(swept)
        return swept

    def lookup_name(self, name: str) -> GenaiRecord | None:
        with self.lock:
            for rec in self.memory.values():
                if rec.name == name:
                    return rec
        for row in self.store.entries(kind=KIND, namespace=self.namespace):
            if row.index.get("name") == name:
                try:
                    return GenaiRecord.from_manifest(self.store.manifest(row.entry_id), row)
                except (SpoolError, MalformedRow):
                    return None
        return None

    def settled(self, rec: GenaiRecord, deleted: str | None) -> None:
        self.store.update_index(rec.entry_id, {"remote_pending": None, "remote_error": None})
        with self.lock:
            if deleted:
                self.counts.deletes += 1
            if self.created.pop(rec.name, None) is not None:
                self.released_ok.append(rec.entry_id)

    def drop_handle(self, handle: CacheHandle) -> None:
        # The server no longer knows the cache: the next prepare() looks again.
        with self.lock:
            for ckey in [k for k, r in self.memory.items() if r.name == handle.ref]:
                del self.memory[ckey]

    def count_usage(self, result: GenerateResult) -> GenerateResult:
        with self.lock:
            self.counts.queries += 1
            self.counts.cache_read_tokens += result.usage.cache_read_tokens
        return result
