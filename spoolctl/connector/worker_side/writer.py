"""Off-critical-path commits of captured chunks, with bounded staging memory.

The forward path only reserves staging bytes (``reserve``, non-blocking) and
hands a filled buffer to ``submit``; one daemon thread commits it. When the staging
budget is exhausted the chunk is skipped and counted (reason ``budget``), never waited
for. A failed commit (disk full, I/O error, capacity, busy lock) is counted by reason
and dropped: it can never affect a response. ``flush`` waits (bounded) for queued
commits, e.g. before a clean shutdown or at interpreter exit (``exitdrain``).

Chunks that are queued together (a request's chunks captured in one step, or everything
that queued while the previous commit ran) are committed together, up to
``WRITE_BATCH``, through ``put_many`` (``Store.put_many``: one round of fsyncs for the
batch), with an outcome per chunk: each is committed or skipped and
counted on its own. Without ``put_many`` each chunk is one ``put``.

With a daily write budget (``ledger``, a ``write_budget.WriteLedger``) each chunk's bytes
are taken from it before the commit and given back if the commit fails; a chunk that does
not fit is skipped (reason ``write_budget``), and once the budget is spent ``try_reserve``
refuses at once, so no chunk is even copied out of the KV cache.

A commit that hangs (a disk that stops answering) holds the writer's one thread: it is the
last commit that drive sees, so no count of failures could ever take the drive out.
``commit_overdue`` tells the worker that the commit running now has been running past
``commit_bound`` (memory only), and the worker takes the drive out at once
(``DiskGuard.stuck``).

A commit that fails with a disk error (``disk_error``: EIO, a store directory gone under an
unmounted drive, a lock file that cannot be opened; not a full disk, not a refusal of the
chunk itself) counts ``failed("commit")`` on the writer's ``guard``, and one that stores a
chunk ``ok("commit")``: three in a row take the drive out as failed lookups and restores do
. Called on the writer's thread (the guard is thread-safe).
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spoolctl import metrics as m
from spoolctl.errors import (
    BusyError,
    CapacityError,
    SpoolError,
    StoreIOError,
)

from ..stats import ConnectorCounters

log = logging.getLogger("spoolctl.connector")

# Chunks committed together at most: bounds how long the first chunk of a batch waits to
# be reported committed (the scheduler learns of it then) and what one batch holds; 32
# chunks of 2 MiB already cost about one round of fsyncs (docs/benchmarks.md, batch rows).
WRITE_BATCH = 32

# Several drives: a drive whose commit failed for want of space (ENOSPC: a filesystem
# smaller than spoolctl_max_size, or shared) is passed over by the routing for this long,
# its chunks written to their runner-ups, which have room; then it is tried again (its
# own capacity step, or an operator, may have freed space meanwhile).
FULL_RETRY_S = 30.0

# ``put(key, payload, meta)``: commit one chunk (raises SpoolError if it is not stored).
Put = Callable[[str, Any, Mapping[str, Any]], None]
# ``put_many([(key, payload, meta), ...])``: commit chunks together; per chunk, in order,
# None if it was committed or the exception that kept it out. An exception raised by the
# call itself (a failure shared by the batch) counts against every chunk of it.
PutMany = Callable[[Sequence[tuple[str, Any, Mapping[str, Any]]]], list[BaseException | None]]

# A commit still running after COMMIT_DEADLINE_READS read deadlines plus its bytes at
# COMMIT_FLOOR_BPS is hung: far past any healthy group commit, so only a disk that stopped
# answering passes this bound.
COMMIT_DEADLINE_READS = 4
COMMIT_FLOOR_BPS = 32 << 20


def commit_bound(read_deadline_s: float, nbytes: int) -> float:
    """Seconds after which a commit of ``nbytes`` counts as hung (see above)."""
    return COMMIT_DEADLINE_READS * read_deadline_s + nbytes / COMMIT_FLOOR_BPS


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
    """One background committer: ``put`` commits one chunk, ``put_many`` (if given) the
    chunks queued together (see the module docstring)."""

    def __init__(self, put: Put, *, staging_bytes: int, counters: ConnectorCounters,
                 put_many: PutMany | None = None, ledger: Any = None,
                 guard: Any = None):
        self._put = put
        self._guard = guard  # a DiskGuard (``ok`` / ``failed``), or None
        self._ledger = ledger
        self._put_many = put_many
        self._budget = staging_bytes
        self._counters = counters
        self._lock = threading.Condition()
        self._staged = 0
        self._full_until = 0.0  # monotonic time until which the disk counts as full
        self._in_flight: set[str] = set()
        self._queue: queue.Queue[PendingStore | None] = queue.Queue()
        self._closed = False
        # The commit running now: when it began (monotonic) and its bytes (commit_overdue).
        self._commit_since: float | None = None
        self._commit_bytes = 0
        self._thread = threading.Thread(target=self._run, name="spoolctl-store-writer",
                                        daemon=True)
        self._thread.start()

    @property
    def full(self) -> bool:
        """A commit failed for want of space within the last ``FULL_RETRY_S`` (memory
        only: read per chunk by the routing of several drives)."""
        return time.monotonic() < self._full_until

    @property
    def staged_bytes(self) -> int:
        with self._lock:
            return self._staged

    def commit_overdue(self, read_deadline_s: float, now: float | None = None
                       ) -> float | None:
        """When the commit running now began (monotonic), if it has been running longer
        than ``commit_bound``; else None. Memory only: callable from the engine thread."""
        since, nbytes = self._commit_since, self._commit_bytes
        if since is None:
            return None
        now = time.monotonic() if now is None else now
        return since if now - since > commit_bound(read_deadline_s, nbytes) else None

    def committing_since(self) -> float | None:
        """When the commit running now began (None: none is)."""
        return self._commit_since

    def reserve(self, key: str, nbytes: int) -> bool:
        """Reserve staging memory for chunk ``key``; False (and counted) if it must be skipped."""
        return self.try_reserve(key, nbytes) is None

    def try_reserve(self, key: str, nbytes: int) -> str | None:
        """``reserve``, saying why not: None when reserved, else the (counted) reason."""
        with self._lock:
            if self._closed:
                reason = "shutdown"
            elif key in self._in_flight:
                reason = "exists"
            elif self._ledger is not None and self._ledger.spent:
                reason = "write_budget"
            elif self._staged + nbytes > self._budget:
                reason = "budget"
            else:
                self._staged += nbytes
                self._in_flight.add(key)
                return None
        self._counters.inc(m.STORES_SKIPPED, reason=reason)
        return reason

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
            batch, stop = [item], False
            while self._put_many is not None and len(batch) < WRITE_BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True  # close(): commit what was taken, then end
                    break
                batch.append(more)
            self._commit_bytes = sum(i.nbytes for i in batch)
            self._commit_since = time.monotonic()
            try:
                self._commit(batch)
            finally:
                self._commit_since = None
                for done in batch:
                    try:
                        if done.on_done is not None:
                            done.on_done()
                    finally:
                        self._release(done.key, done.nbytes)
            if stop:
                return

    def _commit(self, batch: list[PendingStore]) -> None:
        started = time.perf_counter()
        ready: list[PendingStore] = []
        for item in batch:
            try:
                if item.ready is not None:
                    item.ready()  # the device copy into the staging buffer
                ready.append(item)
            except Exception:  # the copy failed: its bytes cannot be trusted
                log.exception("spoolctl: a chunk's copy failed; not stored")
                self._counters.inc(m.STORES_SKIPPED, reason="io_error")
        if self._ledger is not None:
            ready = self._within_budget(ready)
        if self._put_many is None:
            for item in ready:
                self._outcomes([item], [_call(self._put, item)], started)
                started = time.perf_counter()
        elif ready:
            try:
                errors = self._put_many([(i.key, i.payload, i.meta) for i in ready])
                if len(errors) != len(ready):
                    raise RuntimeError(f"put_many returned {len(errors)} outcomes for "
                                       f"{len(ready)} chunks")
            except Exception as exc:  # shared by the batch (lock, catalog, a bug)
                errors = [exc] * len(ready)
            self._outcomes(ready, errors, started)

    def _within_budget(self, items: list[PendingStore]) -> list[PendingStore]:
        """The chunks the day's write budget still takes (their bytes taken now); the
        others are skipped and counted."""
        kept = []
        for item in items:
            if self._ledger.take(item.nbytes):
                kept.append(item)
            else:
                self._counters.inc(m.STORES_SKIPPED, reason="write_budget")
        return kept

    def _outcomes(self, items: list[PendingStore], errors: Sequence[BaseException | None],
                  started: float) -> None:
        """Count each chunk: committed (bytes, and the time since its commit began) or
        skipped by reason; one warning per distinct failure of a batch."""
        elapsed = time.perf_counter() - started
        self._tell_guard(errors)
        warned: set[str] = set()
        for item, exc in zip(items, errors, strict=True):
            if exc is None:
                self._counters.inc(m.STORE_WRITE_BYTES, item.nbytes)
                self._counters.observe(m.STORE_WRITE_SECONDS, elapsed)
                continue
            if self._ledger is not None:  # not written: its bytes go back to the budget
                self._ledger.refund(item.nbytes)
            reason = _reason(exc)
            self._counters.inc(m.STORES_SKIPPED, reason=reason)
            if isinstance(exc, StoreIOError) and exc.errno in _FULL:
                self._full_until = time.monotonic() + FULL_RETRY_S
            if reason != "io_error":
                continue
            if isinstance(exc, SpoolError):
                if exc.message not in warned:
                    warned.add(exc.message)
                    log.warning("spoolctl: store skipped: %s", exc.message)
            elif "bug" not in warned:  # a bug must not take the worker down
                warned.add("bug")
                log.error("spoolctl: unexpected error while storing a chunk", exc_info=exc)

    def _tell_guard(self, errors: Sequence[BaseException | None]) -> None:
        """One commit's outcome for the drive's health: failed when a chunk of it failed
        with a disk error, else good when a chunk of it was stored (a commit refused for
        other reasons says nothing about the disk)."""
        if self._guard is None:
            return
        if any(exc is not None and disk_error(exc) for exc in errors):
            self._guard.failed("commit")
        elif any(exc is None for exc in errors):
            self._guard.ok("commit")

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


def _call(put: Put, item: PendingStore) -> BaseException | None:
    try:
        put(item.key, item.payload, item.meta)
    except Exception as exc:
        return exc
    return None


# A full disk or quota: the drive is passed over for FULL_RETRY_S, not taken out.
_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_error(exc: BaseException) -> bool:
    """``exc`` (a failed commit) says the drive itself fails: a ``StoreIOError`` (the
    store's own files or directories could not be opened, written or synced: EIO, ENOENT
    under an unmounted drive, EROFS) or a bare ``OSError``, other than a full disk. Not a
    capacity or busy refusal, a configuration or corruption refusal, or a bug."""
    if isinstance(exc, StoreIOError):
        return exc.errno not in _FULL
    return isinstance(exc, OSError) and exc.errno not in _FULL


def _reason(exc: BaseException) -> str:
    """The ``stores_skipped_total`` reason of a commit that failed with ``exc``."""
    if isinstance(exc, CapacityError):
        return "capacity"
    if isinstance(exc, BusyError):
        return "busy"
    return "io_error"  # StoreIOError (a full disk too), another SpoolError, or a bug
