"""``SpoolTier``: vLLM's ``SecondaryTierManager`` backed by a spoolctl store.

Every method runs on vLLM's scheduler thread and returns at once: lookups are answered by
a background probe of the store's catalog (RETRY until it answers), stores and promotions
run on ``TierIO``'s threads. Construction refuses (ConfigError, one line) a configuration
whose keys would not survive a restart or whose guarantees the tier API cannot carry.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import vllm
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from spoolctl.errors import ConfigError, CorruptionError, NotFoundError, SpoolError
from spoolctl.store import Manifest, PutRequest, Store, refuse_encrypted

from .api_check import check_tier_api
from .bounded import BoundedCall
from .engine import (
    engine_config,
    engine_generation,
    hash_algo,
    model_computation,
    model_revision,
    seed_is_stable,
)
from .identity import python_hash_seed, tier_identity, weights_of
from .io import Done, ReadFound, TierIO
from .keys import KIND, OBJECT, check_stable_hashing, entry_key, namespace_of
from .settings import TierSettings, parse_settings
from .startup import open_store
from .stats import TierCounters
from .touch import Toucher, touch_in
from .vllm_stats import metric_definitions, take_stats

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import OffloadingMetricMetadata, OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("spoolctl.connector")
SHUTDOWN_TIMEOUT = 60.0
LOAD_YIELD_S = 0.002  # at most this per step, and only while a promotion is unfinished


class _StoreProbe(AsyncLookupManager):
    """Answers lookups from the store's catalog on vLLM's lookup thread."""

    def __init__(self, tier: SpoolTier, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier
        self.answered = threading.Event()  # set after every batch answered

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        found = self._tier.present(keys)
        self.answered.set()
        return found


def _refuse_engine(vllm_config: Any) -> None:
    """Refuse an engine whose keys would not survive a restart, or whose requests carry
    what the tier API cannot bind into a key (a LoRA adapter's content)."""
    if vllm_config is None:
        raise ConfigError("SpoolTier cannot find the engine's configuration to check that "
                          "its block hashes survive a restart",
                          fix="use a vLLM version SpoolTier supports (docs/connector.md)")
    check_stable_hashing(hash_algo(vllm_config), python_hash_seed())
    if getattr(vllm_config, "lora_config", None) is not None:
        raise ConfigError("SpoolTier cannot bind a LoRA adapter's content into its keys "
                          "(vLLM's tier API passes only the adapter's name)",
                          fix="use SpoolConnector for LoRA serving, or disable LoRA")


def _refuse_encrypted(store: Store) -> None:
    """Refuse an encrypted store: vLLM's tier API passes no tenant to choose a key by."""
    try:
        refuse_encrypted(store, "SpoolTier")
    except ConfigError:
        raise ConfigError("SpoolTier cannot use an encrypted store: vLLM's tier API passes "
                          "no tenant with a chunk to choose its key by", path=store.root,
                          fix="use SpoolConnector (tenants from cache_salt) for encryption "
                              "at rest, or unset SPOOLCTL_MASTER_KEY, SPOOLCTL_MASTER_KEY_FILE "
                              "and SPOOLCTL_MASTER_KEY_COMMAND for this engine") from None


class SpoolTier(SecondaryTierManager):
    """A disk tier under vLLM's CPU tier, in a spoolctl store (see the package docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview,
                 tier_type: str, backpressure_detector: BackpressureDetector | None = None,
                 **options: Any) -> None:
        check_tier_api(SecondaryTierManager, type(self), vllm.__version__)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings: TierSettings = parse_settings(options)
        locality = options.get("locality")
        self.locality = Locality(locality) if locality is not None else None
        vllm_config = engine_config()
        _refuse_engine(vllm_config)
        self._seed_checked = self._disabled = False
        self._awaiting_lookup = False  # a lookup answered RETRY since the last poll
        config = offloading_spec.config
        weights = weights_of(config.model.name, self.settings, model_revision(vllm_config))
        identity = tier_identity(config, self.block_size_bytes, weights, engine_generation(),
                                 model_computation(vllm_config))
        self.namespace = namespace_of(identity)
        self.store = open_store(self.settings, self.block_size_bytes)
        try:
            _refuse_encrypted(self.store)
        except ConfigError:
            self.store.close()
            raise
        self.counters = TierCounters()
        # vLLM's view is (chunks, bytes per chunk); one flat byte view to slice chunks from.
        self._flat = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 or \
            primary_kv_view.format != "B" else primary_kv_view
        self._dropped: list[JobResult] = []  # store jobs refused by a full queue
        self._events: list[OffloadingEvent] | None = (
            [] if options.get("enable_kv_events")
            and offloading_spec.kv_events_config.enable_kv_cache_events else None)
        s = self.settings
        touch = touch_in(self.store, self.namespace)
        self._io = TierIO(find=self._find_chunks, write=self._write_chunks,
                          chunk_bytes=self.block_size_bytes, read_threads=s.read_threads,
                          write_threads=s.write_threads, queue_depth=s.queue_depth,
                          read_deadline=s.read_deadline, after_load=touch)
        self.lookup_guard = BoundedCall(s.read_deadline, "spool_tier_lookup")
        self._probe = _StoreProbe(self, tier_type)
        self._toucher = Toucher(touch)
        log.info("spoolctl tier: store %s, namespace %s", self.store.root, self.namespace)

    # -- store access (the tier's threads) ------------------------------------------------

    def _entry_id(self, key: bytes) -> str:
        return self.store.entry_id(KIND, self.namespace, entry_key(key))

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys have a committed entry (catalog only; the lookup thread); all
        misses if the catalog does not answer within ``read_deadline`` (a hung disk)."""
        ids = [self._entry_id(k) for k in keys]
        live: set[str] = self.lookup_guard(lambda: self.store.live(ids), set())
        return [i in live for i in ids]

    def _find_chunks(self, keys: Sequence[bytes]) -> list[ReadFound | None]:
        """Find a slice of a promotion's chunks with one catalog query; per key, how to read
        it, or None (a miss: absent, or not one chunk's size)."""
        try:
            manifests = self.store.lookup_many(KIND, self.namespace,
                                               [entry_key(k) for k in keys], touch=False)
        except SpoolError as exc:
            self.counters.add(load_io_errors=len(keys))
            log.warning("spoolctl tier: %d chunks are recomputed: %s", len(keys), exc)
            return [None] * len(keys)
        reads: list[ReadFound | None] = [
            functools.partial(self._read_found, m) if m is not None and any(
                r.name == OBJECT and r.size == self.block_size_bytes for r in m.objects)
            else None for m in manifests]
        self.counters.add(load_misses=reads.count(None))
        return reads

    def _read_found(self, manifest: Manifest, into: memoryview) -> bool:
        """Read one found chunk, verified, into ``into``; False for a miss (a corrupt entry
        is quarantined by the store)."""
        try:
            self.store.read(manifest, OBJECT, into=into)
        except NotFoundError:  # deleted since the lookup
            self.counters.add(load_misses=1)
            return False
        except SpoolError as exc:
            corrupt = isinstance(exc, CorruptionError)
            self.counters.add(load_failures=int(corrupt), load_io_errors=int(not corrupt))
            log.warning("spoolctl tier: a chunk is recomputed: %s", exc)
            return False
        return True

    def _write_chunks(self, chunks: Sequence[tuple[bytes, memoryview]]) -> set[bytes]:
        requests = [PutRequest(KIND, self.namespace, entry_key(k), {OBJECT: data})
                    for k, data in chunks]
        stored: set[bytes] = set()
        try:
            outcomes = self.store.put_many(requests)
        except SpoolError as exc:  # shared by the batch: a full disk, a lock, the catalog
            log.warning("spoolctl tier: %d chunks were not stored: %s", len(chunks), exc)
            self.counters.add(store_failures=len(chunks))
            return stored
        for (key, _), outcome in zip(chunks, outcomes, strict=True):
            if outcome.error is None:
                stored.add(key)
            else:
                log.warning("spoolctl tier: a chunk was not stored: %s", outcome.error)
        self.counters.add(store_chunks=len(stored), store_failures=len(chunks) - len(stored))
        return stored

    # -- the SecondaryTierManager contract (the scheduler thread) -------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def _unstable(self) -> bool:
        """True (logged once) if vLLM resolved a per-process block-hash seed after all:
        the tier then serves and stores nothing rather than keys no restart finds."""
        if not self._seed_checked:
            self._seed_checked = True
            self._disabled = not seed_is_stable()
            if self._disabled:
                log.error("spoolctl tier: vLLM seeded its block hashes randomly for this "
                          "process; the tier is off (set PYTHONHASHSEED or use sha256)")
        return self._disabled

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._unstable():
            return LookupResult.MISS
        found = self._probe.lookup(key, req_context)
        if found is None:
            self._awaiting_lookup = True
            return LookupResult.RETRY
        self.counters.add(lookup_hits=int(found), lookup_misses=int(not found))
        return LookupResult.HIT if found else LookupResult.MISS

    def _slots(self, job: TransferJob) -> list[memoryview]:
        size = self.block_size_bytes
        return [self._flat[int(c) * size:(int(c) + 1) * size] for c in job.chunk_ids]

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        slots = self._slots(job_metadata)
        if self._unstable() or not self._io.submit_store(job_metadata.job_id, keys, slots):
            self.counters.add(stores_dropped=len(keys))
            self._io_failed(job_metadata.job_id)

    def _io_failed(self, job_id: int) -> None:
        self._dropped.append(JobResult(job_id=job_id, success=False))

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._io.submit_load(job_metadata.job_id, list(job_metadata.keys),
                             self._slots(job_metadata))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        # Polled once per engine step: while a promotion runs, an engine with nothing else
        # to do would spin and starve the readers of the interpreter, so wait a moment.
        if self._awaiting_lookup:
            self._awaiting_lookup = False
            self._probe.answered.wait(LOAD_YIELD_S)
            self._probe.answered.clear()
        self._io.wait_loads(LOAD_YIELD_S)
        results, self._dropped = self._dropped, []
        for done in self._io.finished():
            results.append(self._result(done))
        return results

    def _count(self, done: Done) -> None:
        if not done.is_load:
            self.counters.add(store_bytes=done.nbytes)
        elif done.overdue:
            self.counters.add(load_deadline_misses=len(done.keys))
        else:
            self.counters.add(load_chunks=len(done.ok_keys), load_bytes=done.nbytes)

    def _result(self, done: Done) -> JobResult:
        ok = len(done.ok_keys) == len(done.keys)
        self._count(done)
        if done.is_load:
            if not ok:
                failed = set(done.keys).difference(done.ok_keys)
                self._probe.mark_miss([OffloadKey(k) for k in failed])
        elif done.ok_keys and self._events is not None:
            self._events.append(OffloadingEvent(keys=[OffloadKey(k) for k in done.ok_keys],
                                                medium=self.medium, removed=False,
                                                locality=self.locality))
        return JobResult(job_id=done.job_id, success=ok,
                         successful_keys=None if ok or not done.is_load or not done.ok_keys
                         else tuple(OffloadKey(k) for k in done.ok_keys),
                         transfer_time=done.seconds, transfer_bytes=done.nbytes or None)

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]
                                 ) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    def get_stats(self) -> OffloadingConnectorStats | None:
        return take_stats(self.counters)

    def has_pending_work(self) -> bool:
        return self._io.busy()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if not self._unstable():
            self._toucher.add(keys)  # the toucher's thread writes the catalog, never this one

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._probe.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._probe.flush()

    def drain_jobs(self) -> None:
        self._io.wait_idle()

    def shutdown(self) -> None:
        self._probe.shutdown()
        self.lookup_guard.close()
        if self._io.shutdown(SHUTDOWN_TIMEOUT) and self._toucher.shutdown(SHUTDOWN_TIMEOUT):
            self.store.close()
            if self._flat is not self._primary_kv_view:
                self._flat.release()  # vLLM closes the CPU tier's mmap after us
        else:
            log.warning("spoolctl tier: I/O threads still busy after %.0f s (a hung disk); "
                        "the store is left to process exit", SHUTDOWN_TIMEOUT)
        log.info("spoolctl tier: %s", self.counters.snapshot())
