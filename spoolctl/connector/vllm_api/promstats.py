"""vLLM adapters for the connector's counters: ``KVConnectorStats`` and Prometheus metrics.

Workers and the scheduler hand ``ConnectorCounters.take()`` payloads to vLLM;
vLLM aggregates them (``SpoolStats.aggregate``) and calls ``SpoolPromMetrics.observe``
in the API server, which exports them on vLLM's own ``/metrics`` under the
``spoolctl_`` names of ``spoolctl.metrics``. The write amplification gauge (bytes written /
bytes restored) is derived here from the two byte counters as they are observed, so it
covers every worker of an engine; it is exported from the first restore on (absent before).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from spoolctl import metrics as m

from ..stats import (
    WORKER_GAUGES,
    gauge_values,
    known,
    merge,
    parse_label_key,
    write_amplification,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class SpoolStats(KVConnectorStats):
    """The connector's interval data: ``{"counters": {...}, "hist": {...}}`` (see stats.py)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> SpoolStats:
        return SpoolStats(data=merge(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name, slot in (self.data.get("counters") or {}).items():
            for key, value in slot.items():
                out[f"{name}{{{key}}}" if key else name] = value
        for name, by_part in (self.data.get("gauges") or {}).items():
            for key, value in gauge_values(by_part).items():
                out[f"{name}{{{key}}}" if key else name] = value
        for name, values in (self.data.get("hist") or {}).items():
            out[f"{name}_count"] = len(values)
            out[f"{name}_sum"] = round(sum(values), 6)
        return out

    def is_empty(self) -> bool:
        return not (self.data.get("counters") or self.data.get("hist") or self.data.get("gauges"))


class SpoolPromMetrics(KVConnectorPromMetrics):
    """Registers every connector metric of ``spoolctl.metrics`` with vLLM's metric classes."""

    def __init__(self, vllm_config: VllmConfig,
                 metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM types each of its metric classes as any of Gauge, Counter and Histogram, so
        # their own keyword arguments need the ignores below.
        self._defs: dict[str, Any] = {}
        for spec in m.CONNECTOR_METRICS:
            labels = list(self._labelnames) + list(spec.labels)
            if spec.type == "histogram":
                metric = self._histogram_cls(  # type: ignore[call-arg]
                    name=spec.name, documentation=spec.help, labelnames=labels,
                    buckets=_SECONDS_BUCKETS)
            elif spec.type == "counter":
                metric = self._counter_cls(name=spec.name, documentation=spec.help,
                                           labelnames=labels)
            else:
                continue
            self._defs[spec.name] = metric
        for spec in (*WORKER_GAUGES, m.WRITE_AMPLIFICATION):
            self._defs[spec.name] = self._gauge_cls(  # type: ignore[call-arg]
                name=spec.name, documentation=spec.help,
                labelnames=list(self._labelnames) + list(spec.labels),
                multiprocess_mode="mostrecent")
        self._io: dict[int, list[float]] = {}  # engine -> [bytes written, bytes restored]
        # (engine, gauge) -> each worker part's (and label set's) last value: workers send a
        # gauge in different steps (when it changes, when a refresh lands), so the sum over
        # the workers is taken over every part's last value, not one step's payload.
        self._gauge_parts: dict[tuple[int, str], dict[str, float]] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine_labels = list(self.per_engine_labelvalues[engine_idx])
        for name, slot in (transfer_stats_data.get("counters") or {}).items():
            spec, metric = known(name), self._defs.get(name)
            if spec is None or metric is None:
                continue
            for key, value in slot.items():
                labels = m.check_labels(spec, parse_label_key(key))
                metric.labels(*engine_labels, *(labels[n] for n in spec.labels)).inc(value)
        self._amplification(transfer_stats_data, engine_idx, engine_labels)
        for name, by_part in (transfer_stats_data.get("gauges") or {}).items():
            spec, metric = known(name), self._defs.get(name)
            if spec is None or metric is None:
                continue
            parts = self._gauge_parts.setdefault((engine_idx, name), {})
            parts.update(by_part)
            for key, value in gauge_values(parts).items():
                labels = m.check_labels(spec, parse_label_key(key))
                metric.labels(*engine_labels, *(labels[n] for n in spec.labels)).set(value)
        for name, values in (transfer_stats_data.get("hist") or {}).items():
            metric = self._defs.get(name)
            if metric is None:
                continue
            child = metric.labels(*engine_labels)
            for v in values:
                child.observe(v)

    def _amplification(self, data: dict[str, Any], engine_idx: int,
                       labels: list[object]) -> None:
        counters = data.get("counters") or {}
        written = sum((counters.get(m.STORE_WRITE_BYTES.name) or {}).values())
        restored = sum((counters.get(m.RESTORE_BYTES.name) or {}).values())
        if not written and not restored:
            return
        io = self._io.setdefault(engine_idx, [0.0, 0.0])
        io[0] += written
        io[1] += restored
        ratio = write_amplification(*io)
        if ratio is not None:  # before the first restore the series is absent, never +Inf
            self._defs[m.WRITE_AMPLIFICATION.name].labels(*labels).set(ratio)


__all__ = ["SpoolPromMetrics", "SpoolStats"]
