"""The capture and commit path (worker): KV blocks -> staging buffer -> background commit.

After a step's forward the worker captures each chunk the scheduler planned to store
(``stage``): it reserves staging memory with the ``StoreWriter`` (non-blocking; over the
``spoolctl_staging_bytes`` budget the chunk is skipped and counted), copies the chunk's
blocks into a recycled staging buffer with the format's ``fill(buf) -> objects``, and
queues the commit. The writer's thread commits it into this rank's store and tells
``RankHoldings``, which reports it to the scheduler: the chunks queued together as one
group commit (``rank_commit_many``, ``Store.put_many``), each with its own outcome. A
chunk that fails to capture is skipped and counted; nothing here can affect a response.
A restart restores the longest run of a prompt's chunks from its first, so once one chunk
of a request is not stored, its later chunks would be bytes on disk no restore can reach:
they are not stored either (``after_gap``), and what is on disk after a kill
is what a restart can use (the writer commits in the order chunks were staged). A
chunk's manifest index may carry its vLLM block hashes (hashes only, for the KV events:
``events``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from spoolctl import metrics as m
from spoolctl.store import PutRequest, Store, StoreIOError

from ..kv.kvio import BufferPool, CopyHandle
from ..planning.tenancy import commit_tenant
from ..scheduler_side.lookup import KIND
from ..stats import ConnectorCounters
from .holdings import RankHoldings
from .writer import PendingStore, PutMany, StoreWriter

log = logging.getLogger("spoolctl.connector")

# A chunk's objects as the format captured them: object name -> bytes (views of a buffer).
Objects = Mapping[str, memoryview]
# The manifest index travels to ``rank_commit`` inside the commit's meta under this key
# (the writer passes meta through untouched).
INDEX_KEY = "_index"
# Requests whose first unstored chunk is remembered (most recent first out): a bound, not a
# tuning knob -- a request older than this many others is long past its prefill.
GAP_MEMORY = 4096


# Told of each chunk committed: (its key, its bytes) -- the per-tenant byte counter.
Committed = Callable[[str, int], None]
# A chunk key (and drives to pass over: full ones) -> (the drive it is written to, its
# home), or None when no drive can take it (``DriveSet.route``).
Route = Callable[..., "tuple[str, str] | None"]


def _nbytes(objects: Objects) -> int:
    return sum(memoryview(v).nbytes for v in objects.values())


def rank_commit(store: Store, namespace: str, holdings: RankHoldings,
                on_committed: Committed | None = None, *, drive: str = "",
                ) -> Callable[[str, Objects, Mapping[str, Any]], None]:
    """``put(key, objects, meta)`` committing one chunk entry into this rank's store (on an
    encrypted store sealed for the tenant its key names: ``tenancy``); ``drive``: the
    store's drive id (several drives), told to ``holdings``."""

    def put(key: str, objects: Objects, meta: Mapping[str, Any]) -> None:
        index = meta.get(INDEX_KEY)
        meta = {k: v for k, v in meta.items() if k != INDEX_KEY}
        # No commit-time eviction: holdings withdraws victims from the scheduler first.
        store.put(kind=KIND, namespace=namespace, key=key, objects=objects, meta=meta,
                  index=index, evict=False, tenant=commit_tenant(store, key))
        _committed(holdings, key, drive)
        if on_committed is not None:
            on_committed(key, _nbytes(objects))

    return put


def _committed(holdings: RankHoldings, key: str, drive: str) -> None:
    if drive:
        holdings.committed(key, drive)
    else:
        holdings.committed(key)


def rank_commit_many(store: Store, namespace: str, holdings: RankHoldings,
                     on_committed: Committed | None = None, *, drive: str = "") -> PutMany:
    """``put_many([(key, objects, meta), ...])`` committing chunk entries into this rank's
    store together (one group commit); per chunk, None or the error that kept it out."""

    def put_many(items: Sequence[tuple[str, Objects, Mapping[str, Any]]],
                 ) -> list[BaseException | None]:
        requests = [
            PutRequest(KIND, namespace, key, objects,
                       meta={k: v for k, v in meta.items() if k != INDEX_KEY},
                       index=meta.get(INDEX_KEY), tenant=commit_tenant(store, key))
            for key, objects, meta in items]
        # No commit-time eviction: holdings withdraws victims from the scheduler first.
        outcomes = store.put_many(requests, evict=False)
        errors: list[BaseException | None] = []
        for (key, objects, _), outcome in zip(items, outcomes, strict=True):
            if outcome.ok:
                _committed(holdings, key, drive)
                if on_committed is not None:
                    on_committed(key, _nbytes(objects))
                errors.append(None)
            else:
                errors.append(outcome.error or StoreIOError(
                    f"chunk {key} was not committed ({outcome.status})", path=store.root))
        return errors

    return put_many


class ChunkStager:
    """Captures chunks of ``chunk_bytes`` into staging buffers and queues their commits with
    ``put`` (see ``rank_commit``), or chunks queued together with ``put_many`` if given
    (``rank_commit_many``). ``meta`` is recorded in every chunk's manifest.

    Several drives (``for_drives``): one ``StoreWriter`` per drive (its own
    thread, batch, commit functions and ledger, each with ``staging_bytes / n``, so host
    memory stays bounded by ``staging_bytes`` and a hung drive fills only its share);
    ``stage`` routes each chunk with ``route`` (``DriveSet.route``): a chunk whose home is
    down, or out of space (``StoreWriter.full``) while another drive is not, goes to its
    runner-up, counted in ``spoolctl_drive_failover_stores_total{drive}``
    (``drive``: the home's base root), and one no drive can take is skipped ``disk_down``."""

    def __init__(self, put: Callable[[str, Objects, Mapping[str, Any]], None] | None, *,
                 chunk_bytes: int, staging_bytes: int, meta: Mapping[str, Any],
                 counters: ConnectorCounters, pin: bool = False,
                 put_many: PutMany | None = None, ledger: Any = None,
                 writers: Mapping[str, StoreWriter] | None = None,
                 route: Route | None = None, labels: Mapping[str, str] | None = None,
                 guard: Any = None):
        self._chunk_bytes = chunk_bytes
        self._staging_bytes = staging_bytes
        self._meta = dict(meta)
        self._counters = counters
        # One slot per chunk the staging budget admits: a successful reserve() always finds
        # one. Pinned when the KV cache is on a CUDA device (device copies are then DMA).
        self._bufs = BufferPool(chunk_bytes, slots=max(1, staging_bytes // chunk_bytes),
                                pin=pin)
        if writers is None:  # one store: a set of one writer, every chunk routed to it
            assert put is not None
            writers = {"": StoreWriter(put, staging_bytes=staging_bytes, counters=counters,
                                       put_many=put_many, ledger=ledger, guard=guard)}
            route = route or _to_the_one
        assert route is not None
        self._writers = dict(writers)
        self._route: Route = route
        self._labels = dict(labels or {})
        self._hung_told: dict[str, float] = {}  # drive -> the hung commit already told
        # request -> index of its first chunk not stored (see the module docstring)
        self._gaps: OrderedDict[str, int] = OrderedDict()

    @classmethod
    def for_drives(cls, commits: Mapping[str, tuple[Callable[[str, Objects,
                                                              Mapping[str, Any]], None],
                                                     PutMany | None, Any]],
                   route: Route, labels: Mapping[str, str], *, chunk_bytes: int,
                   staging_bytes: int, meta: Mapping[str, Any], counters: ConnectorCounters,
                   pin: bool = False, guards: Mapping[str, Any] | None = None
                   ) -> ChunkStager:
        """A stager over several drives: ``commits`` maps each drive id to its
        ``(put, put_many, ledger)`` (``rank_commit`` / ``rank_commit_many`` of that drive's
        store); ``labels`` maps a drive id to its base root (the metric's label);
        ``guards`` a drive id to its ``DiskGuard``, told each commit's outcome."""
        share = max(chunk_bytes, staging_bytes // max(1, len(commits)))
        guards = guards or {}
        writers = {drive: StoreWriter(put, staging_bytes=share, counters=counters,
                                      put_many=put_many, ledger=ledger,
                                      guard=guards.get(drive))
                   for drive, (put, put_many, ledger) in commits.items()}
        return cls(None, chunk_bytes=chunk_bytes, staging_bytes=staging_bytes, meta=meta,
                   counters=counters, pin=pin, writers=writers, route=route, labels=labels)

    @property
    def writers(self) -> dict[str, StoreWriter]:
        """Each drive's writer (a copy: the set is replaced when a drive joins)."""
        return dict(self._writers)

    def add_drive(self, drive: str, put: Callable[[str, Objects, Mapping[str, Any]], None],
                  put_many: PutMany | None, ledger: Any, route: Route, label: str,
                  guard: Any = None) -> None:
        """A drive that opened later joins (on the engine thread, before the
        next ``stage``): its own writer, with a share of ``staging_bytes`` as the others
        (the one buffer pool still bounds host memory), and ``route``, which includes it."""
        share = max(self._chunk_bytes, self._staging_bytes // (len(self._writers) + 1))
        writer = StoreWriter(put, staging_bytes=share, counters=self._counters,
                             put_many=put_many, ledger=ledger, guard=guard)
        # Replaced, not changed: the exit drain iterates the writers from another thread.
        self._writers = {**self._writers, drive: writer}
        self._labels = {**self._labels, drive: label}
        self._route = route

    def stage(self, key: str, index: int,
              fill: Callable[[torch.Tensor], tuple[Objects, CopyHandle]], *,
              index_doc: Mapping[str, Any] | None = None, request: str | None = None) -> None:
        """Capture chunk ``index`` (``key``) with ``fill(buf) -> (objects, handle)`` and queue
        its commit (``index_doc``: its manifest index); a chunk over the staging budget or
        failing to capture is skipped, counted, and so are the later chunks of the same
        ``request`` (``after_gap``). The copy may still run on the device when this
        returns: the writer thread waits for ``handle`` before it reads the buffer."""
        nbytes = self._chunk_bytes
        gap = self._gaps.get(request) if request is not None else None
        if gap is not None and index > gap:
            self._counters.inc(m.STORES_SKIPPED, reason="after_gap")
            return
        # A drive out of space is passed over while others have room (runner-ups).
        full = [d for d, w in self._writers.items() if w.full]
        routed = self._route(key, full) if full else None
        routed = routed or self._route(key)
        if routed is None:  # every drive down: nothing waits on a disk that hangs
            self.skip(index, request=request, reason="disk_down")
            return
        drive, home = routed
        writer = self._writers[drive]
        why = writer.try_reserve(key, nbytes)
        if why is not None:
            if why != "exists":  # "exists": another request is storing this very chunk
                self._gap(request, index)
            return
        buf = self._bufs.get()
        if buf is None:  # more chunks in flight than slots: same as over budget
            writer.cancel(key, nbytes)
            self._counters.inc(m.STORES_SKIPPED, reason="budget")
            self._gap(request, index)
            return
        try:
            objects, handle = fill(buf)
        except Exception:  # raised before any copy was issued (ids are checked first)
            self._bufs.put(buf)
            writer.cancel(key, nbytes)
            log.exception("spoolctl: could not capture a chunk; not stored")
            self._counters.inc(m.STORES_SKIPPED, reason="io_error")
            self._gap(request, index)
            return
        meta_doc = dict(self._meta, chunk_index=index)
        if index_doc:
            meta_doc[INDEX_KEY] = dict(index_doc)
        if drive != home:  # its home is down: written to the runner-up
            self._counters.inc(m.DRIVE_FAILOVER_STORES, drive=self._labels.get(home, home))
        writer.submit(PendingStore(
            key, objects, nbytes, meta_doc, on_done=partial(self._bufs.put, buf),
            ready=handle.wait))

    def skip(self, index: int, *, request: str | None, reason: str) -> None:
        """Chunk ``index`` of ``request`` is not stored (counted under ``reason``); nor are
        its later chunks (``after_gap``)."""
        self._counters.inc(m.STORES_SKIPPED, reason=reason)
        self._gap(request, index)

    def _gap(self, request: str | None, index: int) -> None:
        """Remember that chunk ``index`` of ``request`` is not stored (the earliest wins)."""
        if request is None:
            return
        self._gaps[request] = min(index, self._gaps.get(request, index))
        self._gaps.move_to_end(request)
        while len(self._gaps) > GAP_MEMORY:
            self._gaps.popitem(last=False)

    def hung_commits(self, read_deadline_s: float) -> list[tuple[str, Callable[[], bool]]]:
        """The writers whose commit running now is past its bound (``commit_bound``), each
        once per commit: ``(drive, still)`` (drive "" for one store), ``still()`` True
        while that same commit is running. Memory only (the engine thread, every step)."""
        hung: list[tuple[str, Callable[[], bool]]] = []
        for drive, writer in self._writers.items():
            since = writer.commit_overdue(read_deadline_s)
            if since is None or self._hung_told.get(drive) == since:
                continue
            self._hung_told[drive] = since
            hung.append((drive, partial(_still_committing, writer, since)))
        return hung

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued commits (every drive's, within the one bound); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return all([w.flush(_left(deadline)) for w in self._writers.values()])

    def close(self, timeout: float | None) -> bool:
        """Stop accepting chunks, drain (bounded) and stop the writers; False if some were
        left uncommitted. The writers drain concurrently (each on its own thread), so one
        bound covers them all. The staging buffers are unpinned once every writer drained."""
        deadline = None if timeout is None else time.monotonic() + timeout
        drained = all([w.close(_left(deadline)) for w in self._writers.values()])
        if drained:
            self._bufs.close()
        return drained


def _to_the_one(key: str, avoid: Collection[str] = ()) -> tuple[str, str]:
    """The route of a stager over one store: its one writer, full or not."""
    return "", ""


def _still_committing(writer: StoreWriter, since: float) -> bool:
    """``writer`` is still in the commit that began at ``since``."""
    return writer.committing_since() == since


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
