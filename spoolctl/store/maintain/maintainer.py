"""Background maintenance for a long-lived process (a vLLM worker) that owns a store.

``BackgroundMaintainer`` runs one low-priority daemon thread that, every ``interval_s``:
answers queued ``request-auth`` requests and does one bounded scrub step (both only while
it holds the owner lease), and enforces capacity without waiting for the maintenance
lock (lease or not; unless ``enforce_capacity=False``). Nothing raises into the caller:
errors are logged and counted in ``counters``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import BusyError

if TYPE_CHECKING:
    from ..disk.locks import OwnerLease
    from ..store import Store

log = logging.getLogger("spoolctl.maintainer")

# Entries verified per scrub step; bounds how long a step holds the scrub lock.
SCRUB_STEP_ITEMS = 64
CAPACITY_BUDGET = 1024


@dataclass
class MaintainerCounters:
    """Cumulative counts since ``start`` (read them for metrics; updated by the thread)."""

    steps: int = 0
    scrubbed_entries: int = 0
    scrubbed_bytes: int = 0
    scrub_cycles_completed: int = 0
    quarantine_events: Counter[str] = field(default_factory=Counter)  # by reason value
    evicted_entries: int = 0
    evicted_bytes: int = 0
    auth_requests: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # by step: scrub, capacity, auth

    def snapshot(self) -> dict[str, Any]:
        return {
            "steps": self.steps, "scrubbed_entries": self.scrubbed_entries,
            "scrubbed_bytes": self.scrubbed_bytes,
            "scrub_cycles_completed": self.scrub_cycles_completed,
            "quarantine_events": dict(self.quarantine_events),
            "evicted_entries": self.evicted_entries, "evicted_bytes": self.evicted_bytes,
            "auth_requests": self.auth_requests, "errors": dict(self.errors),
        }


class BackgroundMaintainer:
    """See the module docstring. ``store`` must stay open while the maintainer runs;
    ``start``/``stop`` are idempotent; ``stop`` joins the thread and releases the lease."""

    def __init__(
        self,
        store: Store,
        *,
        scrub_rate_bytes: int = 16 << 20,
        interval_s: float = 30.0,
        role: str = "vllm-worker",
        enforce_capacity: bool = True,
    ):
        if scrub_rate_bytes <= 0:
            raise ValueError("scrub_rate_bytes must be positive")
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.store = store
        self.scrub_rate_bytes = scrub_rate_bytes
        self.interval_s = interval_s
        self.role = role
        # False for an owner that evicts itself (the vLLM connector withdraws entries
        # from its peers first); the capacity step is then skipped.
        self.enforce_capacity = enforce_capacity
        self.counters = MaintainerCounters()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lease: OwnerLease | None = None

    @property
    def owns_store(self) -> bool:
        """True while this maintainer holds the store's owner lease."""
        return self._lease is not None and self._lease.held

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Take the owner lease if free and start the thread (no-op if running)."""
        with self._lock:
            if self.running:
                return
            try:
                self._lease = self.store.acquire_owner_lease(self.role)
            except Exception as exc:
                log.warning("could not take the owner lease of %s: %s", self.store.root, exc)
                self.counters.errors["lease"] += 1
                self._lease = None
            if self._lease is None:
                log.info("store %s has another owner: capacity checks only", self.store.root)
            self._stop.clear()
            self._thread = threading.Thread(target=self._main, name="spoolctl-maintainer",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the thread, join it and release the lease. Never raises."""
        with self._lock:
            thread = self._thread
            self._stop.set()
            if thread is not None:
                thread.join(timeout)
                if thread.is_alive():
                    log.warning("maintainer thread did not stop within %ss", timeout)
            self._thread = None
            if self._lease is not None:
                try:
                    self._lease.release()
                except Exception as exc:  # never raise into the caller
                    log.warning("releasing the owner lease failed: %s", exc)
                self._lease = None

    def _main(self) -> None:
        # Lower this thread's CPU priority on Linux (per-thread nice); elsewhere the
        # rate limit alone keeps it polite.
        with contextlib.suppress(Exception):
            if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while not self._stop.is_set():
            self.step()
            self._stop.wait(self.interval_s)

    def step(self) -> None:
        """One round of maintenance (also callable directly, e.g. from tests)."""
        self.counters.steps += 1
        if self.owns_store:
            self._guard("auth", self._auth)
            self._guard("scrub", self._scrub)
        if self.enforce_capacity:
            self._guard("capacity", self._capacity)

    def _guard(self, step: str, fn: Callable[[], None]) -> None:
        if self._stop.is_set() and step != "auth":
            return
        try:
            fn()
        except BusyError:
            pass  # someone else is doing maintenance right now: try next round
        except Exception as exc:
            self.counters.errors[step] += 1
            log.warning("background %s step failed: %s", step, exc,
                        exc_info=log.isEnabledFor(logging.DEBUG))

    def _auth(self) -> None:
        from .auth_requests import process_pending

        self.counters.auth_requests += process_pending(self.store)

    def _scrub(self) -> None:
        from .scrub import Scrubber

        scrubber = Scrubber(self.store, rate_bytes=self.scrub_rate_bytes,
                            sleep=self._interruptible_sleep)
        report = scrubber.run(max_items=SCRUB_STEP_ITEMS, should_stop=self._stop.is_set)
        if report is None:
            return  # a CLI scrub holds the scrub lock
        self.counters.scrubbed_entries += report.checked
        self.counters.scrubbed_bytes += report.bytes
        for finding in report.quarantined:
            self.counters.quarantine_events[finding["reason"]] += 1
        if report.cycle_completed:
            self.counters.scrub_cycles_completed += 1

    def _interruptible_sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _capacity(self) -> None:
        report = self.store.enforce_capacity(budget=CAPACITY_BUDGET, wait=False)
        self.counters.evicted_entries += report.entries
        self.counters.evicted_bytes += report.bytes
