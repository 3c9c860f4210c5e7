"""In-process connector counters (pure; no vLLM). Names come from ``spoolctl.metrics``.

Both connector roles record here; vLLM collects ``take()`` each step through
``get_kv_connector_stats`` and hands the (serialisable) dict to the Prometheus
adapter in ``promstats``. Labels are checked against the closed vocabulary of
``spoolctl.metrics`` so no prompt data can reach a label.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from spoolctl import metrics as m

# Store gauges the worker also exports on vLLM's /metrics (refreshed in the background), and
# the scheduler's count of rank stores it took out of service (``diskguard``).
WORKER_GAUGES: tuple[m.MetricSpec, ...] = (m.STORE_BYTES, m.STORE_MAX_BYTES, m.QUARANTINED_BYTES,
                                           m.DISK_DOWN, m.WRITE_BUDGET, m.WRITE_BUDGET_USED,
                                           m.DRIVE_DOWN)
# A labelled gauge's value is kept per worker part *and* label set: "<part>|<label key>"
# (a part is a rank number or empty, never holding "|").
_PART_SEP = "|"
_SPECS = {spec.name: spec for spec in (*m.CONNECTOR_METRICS, *WORKER_GAUGES)}


def label_key(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={labels[k]}" for k in sorted(labels))


def parse_label_key(key: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in key.split(",")) if key else {}


class ConnectorCounters:
    """Thread-safe counters and histogram observations since the last ``take``.

    ``totals`` keeps cumulative counter values for tests and ``stats_snapshot``.
    """

    def __init__(self, part: str = "") -> None:
        self._lock = threading.Lock()
        # Which worker (rank) this is: gauges are kept per part and summed at export, so a
        # TP/PP deployment's store bytes are the sum over its rank stores.
        self.part = part
        self._counters: dict[str, dict[str, float]] = {}
        self._hist: dict[str, list[float]] = {}
        self._gauges: dict[str, dict[str, float]] = {}
        self._totals: dict[str, dict[str, float]] = {}

    def inc(self, spec: m.MetricSpec, value: float = 1, **labels: str) -> None:
        key = label_key(m.check_labels(spec, labels))
        with self._lock:
            for table in (self._counters, self._totals):
                slot = table.setdefault(spec.name, {})
                slot[key] = slot.get(key, 0) + value

    def observe(self, spec: m.MetricSpec, value: float) -> None:
        with self._lock:
            self._hist.setdefault(spec.name, []).append(float(value))
            slot = self._totals.setdefault(spec.name + "_count", {})
            slot[""] = slot.get("", 0) + 1
            slot = self._totals.setdefault(spec.name + "_sum", {})
            slot[""] = slot.get("", 0) + float(value)

    def set_gauge(self, spec: m.MetricSpec, value: float, **labels: str) -> None:
        """Record the current value of a gauge (sent with the next ``take``); a labelled
        one (``spoolctl_drive_down{drive}``) per label set, summed over the workers at
        export like the others (``gauge_values``)."""
        if spec.type != "gauge":
            raise ValueError(f"{spec.name} is not a gauge")
        key = label_key(m.check_labels(spec, labels))
        with self._lock:
            if not spec.labels:
                self._gauges[spec.name] = {self.part: float(value)}
                self._totals[spec.name] = {"": float(value)}
                return
            self._gauges.setdefault(spec.name, {})[f"{self.part}{_PART_SEP}{key}"] = \
                float(value)
            self._totals.setdefault(spec.name, {})[key] = float(value)

    def take(self) -> dict[str, Any]:
        """The interval's data (and reset it); empty dict if nothing happened."""
        with self._lock:
            data: dict[str, Any] = {}
            if self._counters:
                data["counters"] = self._counters
            if self._hist:
                data["hist"] = self._hist
            if self._gauges:
                data["gauges"] = self._gauges
            self._counters, self._hist, self._gauges = {}, {}, {}
        return data

    def totals(self) -> dict[str, dict[str, float]]:
        """Cumulative counters: ``{metric name: {"label=value,...": total}}``."""
        with self._lock:
            return {name: dict(slot) for name, slot in self._totals.items()}

    def total(self, spec: m.MetricSpec, **labels: str) -> float:
        """Cumulative value of one counter; with no labels, the sum over all label values."""
        slot = self.totals().get(spec.name, {})
        if not labels:
            return sum(slot.values())
        return slot.get(label_key(labels), 0)


def merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Aggregate two ``take()`` payloads (e.g. of several workers or intervals)."""
    out: dict[str, Any] = {"counters": {}, "hist": {}, "gauges": {}}
    for part in (a, b):
        for name, by_part in (part.get("gauges") or {}).items():
            # Per worker the later value wins; different workers are kept apart (summed
            # at export by ``gauge_values``).
            out["gauges"].setdefault(name, {}).update(by_part)
        for name, slot in (part.get("counters") or {}).items():
            dst = out["counters"].setdefault(name, {})
            for key, value in slot.items():
                dst[key] = dst.get(key, 0) + value
        for name, values in (part.get("hist") or {}).items():
            out["hist"].setdefault(name, []).extend(values)
    return {k: v for k, v in out.items() if v}


def gauge_values(by_part: Mapping[str, float]) -> dict[str, float]:
    """A gauge's exported values by label key ("" for an unlabelled gauge): each the sum
    over the workers that reported it."""
    out: dict[str, float] = {}
    for part, value in by_part.items():
        key = part.split(_PART_SEP, 1)[1] if _PART_SEP in part else ""
        out[key] = out.get(key, 0.0) + float(value)
    return out


def write_amplification(written: float, restored: float) -> float | None:
    """Bytes written per byte restored; None (no ratio yet: the gauge is not exported) before
    the first restore, so dashboards never see +Inf; 0 when restores ran but no write."""
    if restored <= 0:
        return None
    return max(written, 0.0) / restored


def known(name: str) -> m.MetricSpec | None:
    return _SPECS.get(name)
