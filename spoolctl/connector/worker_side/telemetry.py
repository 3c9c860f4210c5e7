"""Worker telemetry: store gauges and background progress folded into the connector counters.

vLLM collects the connector's counters every step (``get_kv_connector_stats``). Besides
what the restore and capture paths count themselves, a worker exports its store's disk
and quarantine bytes (refreshed off the engine loop every ``GAUGE_REFRESH_S``, and within
``CHANGED_REFRESH_S`` of a commit, eviction or quarantine, so the value an idle server
keeps exporting is the one after its last change: vLLM collects only in engine steps, and an
idle engine steps only for a short tail after its last activity) and
the progress of its background threads: entries ``RankHoldings`` evicted and the
maintainer's scrub, eviction, authorization and error counts (``collect``). On several
drives the store gauges and the write-budget gauges are the sums over the rank's stores
(each drive's facts read on its own pool, a drive out of service keeping its last ones).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

from spoolctl import metrics as m
from spoolctl.store import Store

from ..stats import ConnectorCounters

log = logging.getLogger("spoolctl.connector")

GAUGE_REFRESH_S = 15.0
# After the store changed (a commit, an eviction, a quarantine): refresh this soon, well
# inside the idle tail of steps an engine takes after its last activity (IDLE_TAIL_S, 3 s).
CHANGED_REFRESH_S = 1.0
# Counters whose change means the store's bytes changed.
_CHANGES = (m.STORE_WRITE_BYTES, m.EVICTED_ENTRIES, m.QUARANTINE_EVENTS)
# The store gauges the connector exports from `Store.facts()` (the rest are per-host CLI gauges).
_STORE_GAUGES = (m.STORE_BYTES, m.STORE_MAX_BYTES, m.QUARANTINED_BYTES)
# Maintainer snapshot counters -> connector counters.
_MAINTAINER_TOTALS = (("scrubbed_bytes", m.SCRUBBED_BYTES),
                      ("scrubbed_entries", m.SCRUBBED_ENTRIES),
                      ("evicted_entries", m.EVICTED_ENTRIES),
                      ("auth_requests", m.AUTH_REQUESTS))
# Maintainer snapshot counters by label -> connector counters with that label.
_MAINTAINER_LABELLED = (("quarantine_events", m.QUARANTINE_EVENTS, "reason"),
                        ("errors", m.MAINTENANCE_ERRORS, "step"))


class WorkerTelemetry:
    """Folds a worker's background progress into ``counters`` (engine-loop thread only)."""

    def __init__(self, counters: ConnectorCounters, clock: Any = time.monotonic):
        self._counters = counters
        self._clock = clock
        self._evicted_last = 0
        self._maint_last: dict[str, Any] = {}
        self._gauges_at = float("-inf")
        self._changes_seen: float | None = None
        # Each store's last facts (gauge name -> value), summed into the gauges.
        self._facts: dict[int, dict[str, float]] = {}
        self._facts_lock = threading.Lock()

    def collect(self, holdings: Any, maintainer: Any) -> None:
        """Fold ``holdings``' evictions and the ``maintainer``'s progress since the last
        call into the counters (either may be None)."""
        if holdings is not None:
            evicted = holdings.evicted_entries
            if evicted > self._evicted_last:
                self._counters.inc(m.EVICTED_ENTRIES, evicted - self._evicted_last)
                self._evicted_last = evicted
        if maintainer is None:
            return
        snap = maintainer.counters.snapshot()
        last, self._maint_last = self._maint_last, snap
        for key, spec in _MAINTAINER_TOTALS:
            delta = snap.get(key, 0) - last.get(key, 0)
            if delta > 0:
                self._counters.inc(spec, delta)
        for field_name, spec, label in _MAINTAINER_LABELLED:
            now, before = snap.get(field_name, {}), last.get(field_name, {})
            for value, count in now.items():
                delta = count - before.get(value, 0)
                if delta > 0 and value in m.LABEL_VALUES[label]:
                    self._counters.inc(spec, delta, **{label: value})

    def budget(self, state: Any | Sequence[Any]) -> None:
        """Export the day's write budget and the bytes counted against it (a
        ``write_budget.LedgerState``, or one per drive: their sums; cheap, in memory)."""
        states = [state] if not isinstance(state, Sequence) else list(state)
        now = time.time()
        self._counters.set_gauge(m.WRITE_BUDGET, sum(s.budget for s in states))
        self._counters.set_gauge(m.WRITE_BUDGET_USED, sum(s.used_today(now) for s in states))

    def refresh_gauges(self, store: Store | Sequence[tuple[Store, Executor | None]],
                       pool: Executor | None = None) -> None:
        """Recompute the store's disk and quarantine bytes on ``pool`` (never on the engine
        loop) every ``GAUGE_REFRESH_S``, or ``CHANGED_REFRESH_S`` after the last refresh when
        the store changed since; nothing without a pool. Several drives: ``store`` lists
        ``(store, its pool)`` for the drives to read now, and the gauges are the sums over
        every store read so far (a drive left out keeps its last facts)."""
        stores = [(store, pool)] if isinstance(store, Store) else list(store)
        now = self._clock()
        changes = sum(self._counters.total(spec) for spec in _CHANGES)
        since = now - self._gauges_at
        if not any(p is not None for _, p in stores) or not (since >= GAUGE_REFRESH_S or (
                changes != self._changes_seen and since >= CHANGED_REFRESH_S)):
            return
        self._gauges_at, self._changes_seen = now, changes
        for one, on in stores:
            if on is not None:
                on.submit(self._refresh, one)

    def _refresh(self, store: Store) -> None:
        """On a pool thread: ``store``'s facts, then the gauges summed over the stores."""
        try:
            # the same snapshot `spoolctl status` and `metrics` read (one set of facts)
            facts = {sample.spec.name: sample.value for sample in m.store_gauges(store.facts())
                     if sample.spec in _STORE_GAUGES}
        except Exception as exc:  # metrics are best effort
            log.debug("spoolctl: gauge refresh failed: %s", exc)
            return
        with self._facts_lock:
            self._facts[id(store)] = facts
            for spec in _STORE_GAUGES:
                values = [f[spec.name] for f in self._facts.values() if spec.name in f]
                if values:
                    self._counters.set_gauge(spec, sum(values))
