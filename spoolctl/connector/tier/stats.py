"""The tier's counters: what it looked up, promoted, stored and refused (thread-safe), and
the ``spoolctl_tier_*`` series each counter feeds (pure; vLLM's adapter is vllm_stats)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

from spoolctl import metrics as m


@dataclass
class TierCounters:
    """Chunk (and byte) counts since the tier started; ``add`` from any thread."""

    lookup_hits: int = 0
    lookup_misses: int = 0
    load_chunks: int = 0  # promoted: read, verified and copied into the CPU tier
    load_bytes: int = 0
    load_misses: int = 0  # gone since the lookup (evicted, cleaned)
    load_failures: int = 0  # corrupt: quarantined, recomputed
    load_io_errors: int = 0  # unreadable: recomputed
    load_deadline_misses: int = 0  # in a promotion failed by read_deadline (a hung disk)
    store_chunks: int = 0
    store_bytes: int = 0
    store_failures: int = 0  # refused by the store (full disk, capacity)
    stores_dropped: int = 0  # refused at once: the store queue was full
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _reported: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return self._values()

    def take(self) -> dict[str, int]:
        """The counts added since the last ``take`` (those that moved)."""
        with self._lock:
            now = self._values()
            delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
            self._reported = now
        return {k: v for k, v in delta.items() if v}

    def _values(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if not f.name.startswith("_")}


# Each counter's series: the metric and its label values (in the metric's label order).
SERIES: dict[str, tuple[m.MetricSpec, tuple[str, ...]]] = {
    "lookup_hits": (m.TIER_LOOKUPS, ("hit",)),
    "lookup_misses": (m.TIER_LOOKUPS, ("miss",)),
    "load_chunks": (m.TIER_PROMOTED, ()),
    "load_bytes": (m.TIER_READ_BYTES, ()),
    "load_misses": (m.TIER_LOAD_ERRORS, ("absent",)),
    "load_failures": (m.TIER_LOAD_ERRORS, ("corrupt",)),
    "load_io_errors": (m.TIER_LOAD_ERRORS, ("io_error",)),
    "load_deadline_misses": (m.TIER_LOAD_ERRORS, ("deadline",)),
    "store_chunks": (m.TIER_STORED, ()),
    "store_bytes": (m.TIER_WRITE_BYTES, ()),
    "store_failures": (m.TIER_STORES_SKIPPED, ("io_error",)),
    "stores_dropped": (m.TIER_STORES_SKIPPED, ("busy",)),
}


def series(counts: dict[str, int]) -> list[tuple[m.MetricSpec, tuple[str, ...], int]]:
    """The metric samples ``counts`` (``TierCounters.take``) add, labels checked."""
    out = []
    for name, n in counts.items():
        spec, values = SERIES[name]
        m.check_labels(spec, dict(zip(spec.labels, values, strict=True)))
        out.append((spec, values, n))
    return out
