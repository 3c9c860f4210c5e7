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

Reads run at most ``slots`` chunks ahead of the copies, over every request together, first
come first served: each read has a recycled buffer of its own (``kvio.BufferPool``), so
host memory is bounded (``RESTORE_BUFFER_BYTES``). ``run`` is the synchronous form (one
request, waited for). ``cancel`` stops a request vLLM finished while it was loading: its
reads in flight are discarded, it still ends (vLLM frees its blocks only then).

Failures are classified here, for every format: a manifest that does not match this
deployment is quarantined (``manifest_validation``); a corrupt object was quarantined by
the store (its reason); a missing entry is ``absent``; store I/O errors ``io_error``;
anything else ``unknown``. A chunk that is gone or bad is also reported lost
(``on_lost``), so the scheduler stops counting it. Nothing here raises into vLLM.

What a chunk *is* (which objects, which blocks) is the format's business (``formats``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass, field

import torch

from spoolctl import metrics as m
from spoolctl.store import Store
from spoolctl.store.errors import CorruptionError, NotFoundError, QuarantineReason, SpoolError
from spoolctl.store.keys import entry_id_for

from .formats import ChunkRestore
from .kvio import BufferPool, CopyHandle
from .lookup import KIND
from .stats import ConnectorCounters

log = logging.getLogger("spoolctl.connector")

# Chunks read + verified ahead of the copies, every request together: at most
# READ_AHEAD chunks and RESTORE_BUFFER_BYTES of host memory (a whole 8K-token restore of a
# small model fits, so it never waits for the engine's next safe point to keep reading).
READ_AHEAD = 64
RESTORE_BUFFER_BYTES = 256 << 20

# A helper thread's read of one chunk: (buffer, None, bytes read) or (None, reason, 0).
ReadResult = tuple["torch.Tensor | None", "str | None", int]


@dataclass
class _Restore:
    """One request's restore in flight (engine thread only)."""

    req_id: str
    items: Sequence[ChunkRestore]
    started: float
    reads: deque[Future] = field(default_factory=deque)  # submitted, in prompt order
    submitted: int = 0
    copied: int = 0
    nbytes: int = 0
    failed_at: int | None = None
    cancelled: bool = False

    @property
    def wants_reads(self) -> bool:
        return self.failed_at is None and not self.cancelled and \
            self.submitted < len(self.items)

    @property
    def ended(self) -> bool:
        return not self.reads and (self.failed_at is not None or self.cancelled
                                   or self.copied == len(self.items))


def copy_into_kv(item: ChunkRestore, buf: torch.Tensor) -> CopyHandle | None:
    """Copy one verified chunk buffer into its KV blocks (engine thread: a safe point, the
    blocks belong to a request vLLM does not run until its restore is reported). On a
    device the copy runs on the copy engine's stream and the compute stream is ordered
    after it (``kvio.PagedKV.restore``): the forward that first reads these blocks, one
    step later at the earliest, waits for it. Returns the copy's handle (None: done)."""
    return item.copy(buf)


class RestorePipeline:
    """Restores chunks from one rank store. ``pool`` runs the reads (not owned here).
    ``begin``, ``pump``, ``cancel``, ``run`` and ``close`` are called from one thread."""

    def __init__(self, store: Store, namespace: str, *, chunk_bytes: int, pool: Executor,
                 counters: ConnectorCounters, on_lost: Callable[[str], None],
                 pin: bool = False):
        self._store = store
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

    @property
    def busy(self) -> bool:
        """Some restore has not ended yet."""
        return bool(self._active)

    def begin(self, req_id: str, items: Sequence[ChunkRestore]) -> None:
        """Start restoring ``items`` for ``req_id`` (after the restores begun before it)."""
        self._active.append(_Restore(req_id, list(items), time.perf_counter()))
        self._submit()

    def cancel(self, req_ids: Iterable[str]) -> None:
        """Stop the restores of ``req_ids`` (finished by vLLM while loading)."""
        wanted = set(req_ids)
        for r in self._active:
            if r.req_id in wanted:
                r.cancelled = True

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
            heads = [r.reads[0] for r in self._active if r.reads]
            if not heads or (wait_s is not None and wait_s <= 0):
                return ended
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return ended
            wait(heads, timeout=left, return_when=FIRST_COMPLETED)

    def run(self, items: Sequence[ChunkRestore]) -> int | None:
        """Restore ``items`` now and wait for them (see the module docstring). Returns the
        position of the first item that failed (counted in LOAD_ERRORS), else None."""
        token = object()
        req_id = f"sync-{id(token)}"
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
        self.pump(wait_s=None)
        self._bufs.close()

    def _advance(self) -> None:
        """Copy the chunks read so far, in order per request; then submit more reads."""
        for r in self._active:
            while r.reads and r.reads[0].done():
                self._in_flight -= 1
                buf, reason, nbytes = r.reads.popleft().result()
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
                    r.failed_at = r.copied
                else:
                    r.copied += 1
                    r.nbytes += nbytes
        self._submit()

    def _release(self, buf: torch.Tensor, handle: CopyHandle | None) -> None:
        """Give a restore buffer back; it is handed out again once its copy (``handle``)
        no longer reads it."""
        self._bufs.put(buf, after=handle)

    def _submit(self) -> None:
        for r in self._active:  # first come, first served
            while r.wants_reads and self._in_flight < self.slots:
                r.reads.append(self._pool.submit(self.read, r.items[r.submitted]))
                r.submitted += 1
                self._in_flight += 1
            if self._in_flight >= self.slots:
                return

    def _take_ended(self) -> list[tuple[str, int | None]]:
        ended, still = [], []
        for r in self._active:
            if not r.ended:
                still.append(r)
                continue
            if r.nbytes:
                self._counters.inc(m.RESTORE_BYTES, r.nbytes)
                self._counters.observe(m.RESTORE_SECONDS, time.perf_counter() - r.started)
            ended.append((r.req_id, None if r.cancelled else r.failed_at))
        self._active = still
        return ended

    def read(self, item: ChunkRestore) -> ReadResult:
        """Load ``item``'s manifest, check it (a mismatch is quarantined), then fill a
        restore buffer with its verified objects. Returns ``(buffer, None, bytes)`` or
        ``(None, reason, 0)`` where reason is a metrics label; never raises (helper
        thread)."""
        store = self._store
        entry_id = entry_id_for(KIND, self._namespace, item.key)
        try:
            manifest = store.manifest(entry_id)
            if not item.valid(manifest):
                store.quarantine_entry(entry_id, QuarantineReason.MANIFEST_VALIDATION,
                                       "KV layout does not match this deployment")
                self._on_lost(item.key)
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
            # Each rank keeps its own LRU clock: the scheduler may not see this store.
            store.touch([entry_id])
            return buf, None, nbytes
        except CorruptionError as exc:
            self._on_lost(item.key)
            self._counters.inc(m.QUARANTINE_EVENTS, reason=exc.reason.value)
            log.warning("spoolctl: cached chunk failed verification (%s); quarantined, "
                        "recomputing", exc.reason.value)
            return None, exc.reason.value, 0
        except (NotFoundError, KeyError):
            self._on_lost(item.key)
            return None, "absent", 0
        except SpoolError as exc:
            log.warning("spoolctl: restore failed, recomputing: %s", exc.message)
            return None, "io_error", 0
        except Exception:  # never let a cache problem take the worker down
            log.exception("spoolctl: unexpected restore error, recomputing")
            return None, "unknown", 0
