"""SpoolTier's counters on vLLM's /metrics: vLLM's own OffloadingConnector metrics class
registers the tier's ``spoolctl_tier_*`` counters from the tier entry of its config and
exports what the tier's ``get_stats`` reports (vLLM's classes, no engine started)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics

from spoolctl import metrics as m
from spoolctl.connector.tier.stats import TierCounters
from spoolctl.connector.tier.vllm_stats import take_stats


class EngineConfig:
    """What vLLM's metrics class reads of the engine's config: its KV transfer config."""

    def __init__(self, root: Path) -> None:
        self.kv_transfer_config = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 30,
                "secondary_tiers": [{"type": "SpoolTier", "module_path": "spoolctl.connector.tier",
                                     "root": str(root)}]})


def test_the_tiers_counters_reach_vllms_metrics(tmp_path: Path) -> None:
    reg = CollectorRegistry()

    def bind(cls):
        return lambda **kw: cls(registry=reg, **kw)

    prom = OffloadPromMetrics(EngineConfig(tmp_path), {Gauge: bind(Gauge), Counter: bind(Counter),
                                                       Histogram: bind(Histogram)},
                              ["engine"], {0: ["0"]})
    counters = TierCounters()
    counters.add(lookup_hits=3, lookup_misses=1, load_chunks=3, load_bytes=3 << 16,
                 load_failures=1, load_deadline_misses=2, store_chunks=4, store_bytes=4 << 16,
                 stores_dropped=5)
    stats = take_stats(counters)
    assert stats is not None and take_stats(counters) is None  # each count reported once
    prom.observe(stats.data, 0)
    counters.add(lookup_hits=1)
    prom.observe(take_stats(counters).data, 0)
    text = generate_latest(reg).decode()
    for line in ('spoolctl_tier_lookups_total{engine="0",result="hit"} 4.0',
                 'spoolctl_tier_lookups_total{engine="0",result="miss"} 1.0',
                 'spoolctl_tier_promoted_chunks_total{engine="0"} 3.0',
                 f'spoolctl_tier_read_bytes_total{{engine="0"}} {float(3 << 16)}',
                 'spoolctl_tier_load_errors_total{engine="0",reason="corrupt"} 1.0',
                 'spoolctl_tier_load_errors_total{engine="0",reason="deadline"} 2.0',
                 'spoolctl_tier_stored_chunks_total{engine="0"} 4.0',
                 f'spoolctl_tier_write_bytes_total{{engine="0"}} {float(4 << 16)}',
                 'spoolctl_tier_stores_skipped_total{engine="0",reason="busy"} 5.0'):
        assert line in text
    assert {s.name for s in m.TIER_METRICS} <= {s.name for s in m.ALL_METRICS}
