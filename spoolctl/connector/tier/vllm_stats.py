"""The tier's counters in vLLM's offloading metrics (imports vLLM).

vLLM's OffloadingConnector asks each secondary tier for its metric definitions (in the API
server, to register them) and for its stats (in the scheduler, every logging interval);
they reach vLLM's ``/metrics`` as the ``spoolctl_tier_*`` counters of ``spoolctl.metrics``.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingMetricMetadata

from spoolctl import metrics as m

from .stats import TierCounters, series


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    return {spec.name: OffloadingCounterMetadata(documentation=spec.help,
                                                 labelnames=spec.labels)
            for spec in m.TIER_METRICS}


def take_stats(counters: TierCounters) -> OffloadingConnectorStats | None:
    """What the counters added since the last call, as vLLM's stats; None if nothing."""
    samples = series(counters.take())
    if not samples:
        return None
    stats = OffloadingConnectorStats()
    for spec, labels, n in samples:
        stats.increase_counter(spec.name, n, labels)
    return stats
