"""The tier's I/O: store reads and writes on the tier's own threads, never the scheduler's.

``TierIO`` runs load (promotion) jobs on ``read_threads`` and store (cascade) jobs on
``write_threads``. Store jobs wait in a bounded queue: when the disk falls behind, a new
store job fails at once (the chunk stays only in the CPU tier) instead of blocking the
scheduler. A load job's chunks are read by every read thread at once (one job is one
request's whole promotion): its keys are first found in slices, one per read thread (``find``:
one catalog query per slice, not per chunk), then each found chunk is a task of its own (the
threads share them as they come free); each reads and verifies a chunk into a private buffer and
copies it into the primary slot only if its job is still wanted: a load past its deadline (a
hung disk) is failed by the scheduler thread and its late bytes are dropped, never copied.
The keys a load read go to ``after_load`` (the LRU clock) later, on a write thread, once no
load has run for ``TOUCH_QUIET_S``: a catalog write during a promotion's forward slowed it.

Pure: no vLLM import; jobs are described by ``LoadJob``/``StoreJob`` and report ``Done``.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("spoolctl.connector")
TOUCH_QUIET_S = 0.5  # touch promoted entries once loads have been quiet this long
TOUCH_LATEST_S = 10.0  # ...or at the latest this long after the oldest waiting key

# Reads one chunk, verified, into the buffer; False for a miss (absent, corrupt, unreadable).
ReadChunk = Callable[[bytes, memoryview], bool]
# Reads one found chunk, verified, into the buffer; False for a miss.
ReadFound = Callable[[memoryview], bool]
# Finds a slice of a job's keys at once: per key, how to read it, or None (a miss).
FindChunks = Callable[[Sequence[bytes]], Sequence[ReadFound | None]]
# Commits chunks (key, bytes) together; returns the keys that are now stored.
WriteChunks = Callable[[Sequence[tuple[bytes, memoryview]]], set[bytes]]
# Told the keys a finished load read (on a read thread, after the job is reported).
AfterLoad = Callable[[list[bytes]], None]


@dataclass
class Done:
    """One finished job: ``ok_keys`` is every key that made it."""

    job_id: int
    keys: list[bytes]
    ok_keys: list[bytes]
    is_load: bool
    seconds: float
    nbytes: int
    overdue: bool = False  # failed by its deadline (a slow or hung disk)


@dataclass
class LoadJob:
    job_id: int
    keys: list[bytes]
    slots: list[memoryview]
    deadline: float
    started: float = field(default_factory=time.monotonic)
    # Held while a worker copies into a primary slot, and to abandon the job.
    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False  # failed by its deadline: its late bytes are dropped
    completed: bool = False  # its result is queued
    found: list[bool] = field(default_factory=list)  # per chunk, set by its reader
    pending: int = 0  # chunks not read yet (guarded by lock)


@dataclass
class StoreJob:
    job_id: int
    keys: list[bytes]
    slots: list[memoryview]
    started: float = field(default_factory=time.monotonic)


# A load task: (job, the indices of a slice to find, None) or (job, [index], its read).
_Task = tuple[LoadJob, list[int], ReadFound | None]


def _each(read: ReadChunk) -> FindChunks:
    """``find`` for a reader of one key at a time: every key is read (a miss says so)."""
    return lambda keys: [functools.partial(read, key) for key in keys]


class TierIO:
    """Owns the threads and the job queues; ``finished()`` is polled by the scheduler."""

    def __init__(self, *, write: WriteChunks, chunk_bytes: int, read_threads: int,
                 write_threads: int, queue_depth: int, read_deadline: float,
                 read: ReadChunk | None = None, find: FindChunks | None = None,
                 after_load: AfterLoad | None = None) -> None:
        """``find`` (a job's keys in slices) or ``read`` (one key at a time) reads loads."""
        if find is None:
            if read is None:
                raise ValueError("TierIO needs find or read")
            find = _each(read)
        self._find, self._write, self._after_load = find, write, after_load
        self._chunk_bytes = chunk_bytes
        self._deadline = read_deadline
        self._read_threads = read_threads
        # Tasks (job, indices, None): find a slice of a job's keys; (job, [index], read):
        # read one found chunk. A job's chunks spread over every read thread.
        self._loads: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._stores: queue.Queue[StoreJob | None] = queue.Queue(maxsize=queue_depth)
        self._done: deque[Done] = deque()
        self._expired: list[Done] = []  # loads failed by their deadline (scheduler thread)
        self._active_loads: dict[int, LoadJob] = {}
        self._touch_lock = threading.Lock()
        self._to_touch: list[bytes] = []  # read by loads, not yet given to after_load
        self._touch_since = self._last_load = 0.0
        self._idle = threading.Condition()
        self._in_flight = 0  # guarded by _idle
        self._stopped = False
        self._queue_lock = threading.Lock()  # orders queued reads before the stop marks
        self._threads = [
            *(threading.Thread(target=self._load_loop, name=f"spool_tier_read{i}", daemon=True)
              for i in range(read_threads)),
            *(threading.Thread(target=self._store_loop, name=f"spool_tier_write{i}",
                               daemon=True) for i in range(write_threads))]
        for t in self._threads:
            t.start()

    # -- the scheduler thread -------------------------------------------------------------

    def submit_load(self, job_id: int, keys: Sequence[bytes], slots: list[memoryview]) -> None:
        job = LoadJob(job_id, list(keys), list(slots),
                      deadline=time.monotonic() + self._deadline)
        job.found, job.pending = [False] * len(job.keys), len(job.keys)
        self._active_loads[job_id] = job
        self._begin()
        if not job.keys:
            self._finish_load(job)
            return
        slices = min(self._read_threads, len(job.keys))
        for first in range(slices):
            self._loads.put((job, list(range(first, len(job.keys), slices)), None))

    def submit_store(self, job_id: int, keys: Sequence[bytes], slots: list[memoryview]
                     ) -> bool:
        """Queue a store job; False (nothing queued) when the queue is full."""
        if self._stopped:
            return False
        self._begin()
        try:
            self._stores.put_nowait(StoreJob(job_id, list(keys), list(slots)))
        except queue.Full:
            self._end()
            return False
        return True

    def finished(self) -> list[Done]:
        """Jobs done since the last call; loads past their deadline are failed here."""
        self._expire_overdue(time.monotonic())
        out, self._expired = self._expired, []
        while self._done:
            done = self._done.popleft()
            if done.is_load and self._active_loads.pop(done.job_id, None) is None:
                continue  # already failed by its deadline
            out.append(done)
        return out

    def wait_loads(self, timeout: float) -> None:
        """Wait up to ``timeout`` s while a load runs and none has finished: the caller's
        thread gives the readers the interpreter instead of spinning through empty steps."""
        with self._idle:
            if self._active_loads and not self._done:
                self._idle.wait(timeout)

    def busy(self) -> bool:
        with self._idle:
            return self._in_flight > 0

    def wait_idle(self, poll: float = 0.05) -> None:
        """Block until every job finished or, for a load past its deadline, was failed."""
        with self._idle:
            while self._in_flight > 0 and self._overdue_running(time.monotonic()):
                self._idle.wait(poll)
        # Loads left running are past their deadline: fail them so nothing waits on them.
        self._expire_overdue(time.monotonic())

    def shutdown(self, timeout: float) -> bool:
        """Finish queued jobs (up to ``timeout`` s), stop the threads; False if some hang."""
        readers = [t for t in self._threads if t.name.startswith("spool_tier_read")]
        with self._queue_lock:
            self._stopped = True
            for _ in readers:
                self._loads.put(None)
        for _ in range(len(self._threads) - len(readers)):
            self._stores.put(None)
        until = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, until - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    # -- helpers ------------------------------------------------------------------------

    def _begin(self) -> None:
        with self._idle:
            self._in_flight += 1

    def _end(self) -> None:
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def _overdue_running(self, now: float) -> bool:
        """True while some job is still within its time (worth waiting for)."""
        return any(now < job.deadline for job in self._active_loads.values()) or \
            self._in_flight > len(self._active_loads)

    def _expire_overdue(self, now: float) -> None:
        for job_id, job in list(self._active_loads.items()):
            if now < job.deadline:
                continue
            with job.lock:
                if job.abandoned or job.completed:
                    continue
                job.abandoned = True
            log.warning("spoolctl tier: a promotion of %d chunks passed its %.0f s deadline "
                        "(a slow or hung disk); the chunks are recomputed", len(job.keys),
                        self._deadline)
            del self._active_loads[job_id]
            self._expired.append(Done(job_id, job.keys, [], True, now - job.started, 0, True))

    # -- the tier's threads ---------------------------------------------------------------

    def _load_loop(self) -> None:
        scratch = memoryview(bytearray(self._chunk_bytes))
        while (task := self._loads.get()) is not None:
            job, indices, read = task
            done = indices
            try:
                if job.abandoned:
                    pass
                elif read is None:
                    done = self._find_slice(job, indices)
                else:
                    self._read_one(job, indices[0], read, scratch)
            finally:
                self._chunks_done(job, len(done))

    def _chunks_done(self, job: LoadJob, count: int) -> None:
        if not count:
            return
        with job.lock:
            job.pending -= count
            last = job.pending == 0
        if last:
            self._finish_load(job)

    def _find_slice(self, job: LoadJob, indices: list[int]) -> list[int]:
        """Find ``indices`` of ``job`` and queue a read of each found chunk; returns the
        indices that are done now (the misses)."""
        try:
            reads = list(self._find([job.keys[i] for i in indices]))
        except Exception:  # a bug or an unexpected error: misses, never a crash
            log.exception("spoolctl tier: finding chunks failed")
            return indices
        if len(reads) != len(indices):
            log.error("spoolctl tier: finding %d chunks answered %d", len(indices), len(reads))
            return indices
        misses, found = [], []
        for index, read in zip(indices, reads, strict=True):
            (misses.append(index) if read is None else found.append((index, read)))
        with self._queue_lock:  # never queued behind shutdown's stop marks: read them here
            if not self._stopped:
                for index, read in found:
                    self._loads.put((job, [index], read))
                return misses
        for index, read in found:
            self._read_one(job, index, read, memoryview(bytearray(self._chunk_bytes)))
        return indices

    def _read_one(self, job: LoadJob, index: int, read: ReadFound, scratch: memoryview
                  ) -> None:
        try:
            found = read(scratch)
        except Exception:  # a bug or an unexpected error: a miss, never a crash
            log.exception("spoolctl tier: reading a chunk failed")
            found = False
        if not found:
            return
        with job.lock:
            if job.abandoned:
                return
            job.slots[index][:] = scratch
            job.found[index] = True

    def _finish_load(self, job: LoadJob) -> None:
        """The job's last chunk is done: report it (unless its deadline failed it)."""
        ok = [k for k, found in zip(job.keys, job.found, strict=True) if found]
        try:
            with job.lock:
                if not job.abandoned:
                    job.completed = True
                    self._done.append(Done(job.job_id, job.keys, ok, True,
                                           time.monotonic() - job.started,
                                           len(ok) * self._chunk_bytes))
            job.slots.clear()  # no view of the CPU tier outlives its job
        finally:
            self._end()
        with self._touch_lock:
            self._last_load = time.monotonic()
            if ok and self._after_load is not None:
                self._touch_since = self._touch_since if self._to_touch else self._last_load
                self._to_touch += ok

    def _touch_due(self, *, stopping: bool = False) -> None:
        """Give the waiting keys to ``after_load`` when loads are quiet (or stopping)."""
        now = time.monotonic()
        with self._touch_lock:
            if not self._to_touch or not (
                    stopping or now - self._last_load >= TOUCH_QUIET_S
                    or now - self._touch_since >= TOUCH_LATEST_S):
                return
            keys, self._to_touch = self._to_touch, []
        if self._after_load is None:
            return
        try:
            self._after_load(keys)
        except Exception:  # the LRU clock only: never fails a load
            log.exception("spoolctl tier: touching promoted chunks failed")

    def _store_loop(self) -> None:
        while True:
            try:
                job = self._stores.get(timeout=TOUCH_QUIET_S)
            except queue.Empty:
                self._touch_due()
                continue
            if job is None:
                self._touch_due(stopping=True)
                return
            try:
                self._run_store(job)
            finally:
                job.slots.clear()
                self._end()
            self._touch_due()

    def _run_store(self, job: StoreJob) -> None:
        try:
            stored = self._write(list(zip(job.keys, job.slots, strict=True)))
        except Exception:
            log.exception("spoolctl tier: storing %d chunks failed", len(job.keys))
            stored = set()
        ok = [k for k in job.keys if k in stored]
        self._done.append(Done(job.job_id, job.keys, ok, False,
                               time.monotonic() - job.started, len(ok) * self._chunk_bytes))
