"""Off-critical-path commits of captured chunks, with bounded staging memory.

The forward path only reserves staging bytes (``reserve``, non-blocking) and
hands a filled buffer to ``submit``; one daemon thread commits it with
``Store.put``. When the staging budget is exhausted the chunk is skipped and
counted (reason ``budget``), never waited for. A failed commit (disk full, I/O
error, capacity, busy lock) is counted by reason and dropped: it can never
affect a response. ``flush`` waits (bounded) for queued commits, e.g. before a
clean shutdown.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from spoolctl import metrics as m
from spoolctl.store.errors import (
    BusyError,
    CapacityError,
    SpoolError,
    StoreIOError,
)

from .stats import ConnectorCounters

log = logging.getLogger("spoolctl.connector")


@dataclass
class PendingStore:
    key: str
    payload: Any  # a buffer exporting the chunk bytes (memoryview-able)
    nbytes: int
    meta: Mapping[str, Any]
    on_done: Callable[[], None] | None = None  # called once the payload is no longer used
    # Blocks until the payload's bytes are in place (a device-to-host copy still running on
    # the copy stream): called on the commit thread, never on the forward path.
    ready: Callable[[], None] | None = None


class StoreWriter:
    """One background committer. ``put`` is ``Store.put``-like: ``put(key, payload, meta)``."""

    def __init__(self, put: Callable[[str, Any, Mapping[str, Any]], None], *,
                 staging_bytes: int, counters: ConnectorCounters):
        self._put = put
        self._budget = staging_bytes
        self._counters = counters
        self._lock = threading.Condition()
        self._staged = 0
        self._in_flight: set[str] = set()
        self._queue: queue.Queue[PendingStore | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="spoolctl-store-writer",
                                        daemon=True)
        self._thread.start()

    @property
    def staged_bytes(self) -> int:
        with self._lock:
            return self._staged

    def reserve(self, key: str, nbytes: int) -> bool:
        """Reserve staging memory for chunk ``key``; False (and counted) if it must be skipped."""
        with self._lock:
            if self._closed:
                reason = "shutdown"
            elif key in self._in_flight:
                reason = "exists"
            elif self._staged + nbytes > self._budget:
                reason = "budget"
            else:
                self._staged += nbytes
                self._in_flight.add(key)
                return True
        self._counters.inc(m.STORES_SKIPPED, reason=reason)
        return False

    def cancel(self, key: str, nbytes: int) -> None:
        """Give back a reservation that will not be submitted."""
        self._release(key, nbytes)

    def submit(self, item: PendingStore) -> None:
        self._queue.put(item)

    def _release(self, key: str, nbytes: int) -> None:
        with self._lock:
            self._staged -= nbytes
            self._in_flight.discard(key)
            self._lock.notify_all()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._commit(item)
            finally:
                if item.on_done is not None:
                    item.on_done()
                self._release(item.key, item.nbytes)

    def _commit(self, item: PendingStore) -> None:
        started = time.perf_counter()
        reason = None
        try:
            if item.ready is not None:
                item.ready()
            self._put(item.key, item.payload, item.meta)
        except CapacityError:
            reason = "capacity"
        except BusyError:
            reason = "busy"
        except StoreIOError as exc:
            reason = "io_error"
            log.warning("spoolctl: store skipped: %s", exc.message)
        except SpoolError as exc:
            reason = "io_error"
            log.warning("spoolctl: store skipped: %s", exc.message)
        except Exception:  # a bug must not take the worker down; the chunk is just not cached
            reason = "io_error"
            log.exception("spoolctl: unexpected error while storing a chunk")
        if reason is not None:
            self._counters.inc(m.STORES_SKIPPED, reason=reason)
            return
        self._counters.inc(m.STORE_WRITE_BYTES, item.nbytes)
        self._counters.observe(m.STORE_WRITE_SECONDS, time.perf_counter() - started)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted chunk is committed or skipped; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._staged > 0:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def close(self, timeout: float | None = 30.0) -> bool:
        """Stop accepting work, drain (bounded by ``timeout``) and stop the thread."""
        with self._lock:
            self._closed = True
        drained = self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout=1.0 if drained else 0.1)
        return drained
