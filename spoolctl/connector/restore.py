"""The restore pipeline (worker): verified reads on helper threads, copies into KV in order.

A restore is a sequence of ``ChunkRestore`` items, one per chunk, in prompt order. Each is
read and verified on a helper thread (``read``: the chunk's manifest is loaded and checked
against this deployment's layout with ``valid``, then ``fill`` reads its objects into a
restore buffer, each byte verified by the store as it is read; reads and hashing release
the GIL), ``read_ahead`` chunks ahead of the one being copied, and copied into vLLM's KV
blocks by ``copy`` on the caller's thread, in order. The first chunk that fails stops the
restore: ``run`` returns its position (the caller reports it and everything after it to
vLLM for recomputation).

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
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

import torch

from spoolctl import metrics as m
from spoolctl.store import Store
from spoolctl.store.errors import CorruptionError, NotFoundError, QuarantineReason, SpoolError
from spoolctl.store.keys import entry_id_for

from .kvio import BufferPool, CopyHandle
from .lookup import KIND
from .stats import ConnectorCounters

log = logging.getLogger("spoolctl.connector")

# Chunks read + verified ahead of the one being copied (at most READ_AHEAD_BYTES).
READ_AHEAD = 8
READ_AHEAD_BYTES = 256 << 20

# A helper thread's read of one chunk: (buffer, None, bytes read) or (None, reason, 0).
ReadResult = tuple["torch.Tensor | None", "str | None", int]


@dataclass(frozen=True)
class ChunkRestore:
    """One chunk to restore: ``valid(manifest)`` checks its entry fits this deployment,
    ``fill(store, manifest, buf) -> bytes`` reads its verified objects into ``buf`` (helper
    thread), ``copy(buf)`` writes them into the KV blocks (caller's thread)."""

    key: str
    valid: Callable[[Any], bool]
    fill: Callable[[Store, Any, torch.Tensor], int]
    # Issues the copies (compute stream ordered after them); the buffer is reused once the
    # returned handle is done (None: the copy already finished).
    copy: Callable[[torch.Tensor], CopyHandle | None]


class RestorePipeline:
    """Restores chunks from one rank store. ``pool`` runs the reads (not owned here)."""

    def __init__(self, store: Store, namespace: str, *, chunk_bytes: int, pool: Executor,
                 counters: ConnectorCounters, on_lost: Callable[[str], None],
                 pin: bool = False):
        self._store = store
        self._namespace = namespace
        self._pool = pool
        self._counters = counters
        self._on_lost = on_lost
        self.read_ahead = max(2, min(READ_AHEAD, READ_AHEAD_BYTES // chunk_bytes))
        # One buffer per chunk in flight: a read always finds a free one (or waits for the
        # device copy still reading it). Pinned when the KV cache is on a CUDA device.
        self._bufs = BufferPool(chunk_bytes, slots=self.read_ahead, pin=pin)

    def run(self, items: Sequence[ChunkRestore]) -> int | None:
        """Restore ``items`` in order (see the module docstring). Returns the position of
        the first item that failed (counted in LOAD_ERRORS), else None."""
        started = time.perf_counter()
        restored = 0
        pending: deque[Future] = deque()
        it = iter(items)
        failed_at = None

        def refill() -> None:
            while len(pending) < self.read_ahead:
                item = next(it, None)
                if item is None:
                    return
                pending.append(self._pool.submit(self.read, item))

        try:
            refill()
            for pos, item in enumerate(items):
                buf, reason, nbytes = pending.popleft().result()
                if buf is not None:
                    handle = None
                    try:
                        handle = item.copy(buf)
                    except Exception:  # a copy bug must not take the worker down
                        log.exception("spoolctl: restore copy failed, recomputing")
                        reason = "unknown"
                    finally:
                        self._bufs.put(buf, after=handle)
                if reason is not None:
                    self._counters.inc(m.LOAD_ERRORS, reason=reason)
                    failed_at = pos
                    break
                restored += nbytes
                refill()
        finally:
            for fut in pending:  # bounded by the read-ahead; their buffers are recycled
                buf, _, _ = fut.result()
                if buf is not None:
                    self._bufs.put(buf)
        if restored:
            self._counters.inc(m.RESTORE_BYTES, restored)
            self._counters.observe(m.RESTORE_SECONDS, time.perf_counter() - started)
        return failed_at

    def close(self) -> None:
        """Wait for copies still reading restore buffers and release (unpin) them."""
        self._bufs.close()

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
