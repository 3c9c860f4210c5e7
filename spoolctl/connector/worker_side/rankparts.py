"""The parts that serve a rank over its drive set: inventory, restores and captures.

``RankBuilder.build(drives)`` starts, over the drives equipped so far, the rank's
``RankHoldings`` (one inventory over every drive), its ``RestorePipeline`` and, unless the
store cannot be written (an encrypted store without its master key: one log line), its
``ChunkStager`` (one writer per drive, each chunk routed by the set). ``RankParts.join``
takes a drive that opened later into running parts (engine thread, between steps).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spoolctl import metrics as m
from spoolctl.store import Store

from ..drives.driveset import Drive, DriveSet
from ..kv.formats import Copier
from ..planning.tenancy import TenantLabels, key_tenant, store_problem
from ..scheduler_side.lookup import KIND
from ..stats import ConnectorCounters
from ..vllm_api.introspect import Deployment
from . import exitdrain
from .capture import ChunkStager, rank_commit, rank_commit_many
from .holdings import DUPLICATE_GRACE_S, RankHoldings
from .restore import Located, OnLost, RestorePipeline

if TYPE_CHECKING:
    from ..kv.kvio import CopyEngine

log = logging.getLogger("spoolctl.connector")

FLUSH_ON_SHUTDOWN_S = 30.0

# Per tenant byte counting: ``for_metric(spec) -> on_bytes(key, n)`` (or None).
TenantBytes = Callable[[m.MetricSpec], Any]


@dataclass(eq=False)
class RankParts:
    """What serves the rank's drives in use (see the module docstring)."""

    holdings: RankHoldings
    pipeline: RestorePipeline
    stager: ChunkStager | None
    where: dict[str, Located] = field(default_factory=dict)
    join: Callable[[Drive], None] | None = None

    def close(self) -> None:
        """Drain queued commits (bounded), stop the keepers, end restores in flight."""
        if self.stager is not None:
            exitdrain.unregister(self.stager)
            if not self.stager.close(FLUSH_ON_SHUTDOWN_S):
                log.warning("spoolctl: shutdown before all stores were committed; "
                            "the rest are skipped")
        with contextlib.suppress(Exception):
            self.holdings.stop()
        self.pipeline.close()  # restores in flight end, their buffers come back


class RankBuilder:
    """Builds ``RankParts`` for one worker (its deployment, copier, counters and set)."""

    def __init__(self, deployment: Deployment, copier: Copier, counters: ConnectorCounters,
                 drives: DriveSet, *, engine: Callable[[], CopyEngine | None],
                 on_lost: OnLost):
        self._dep, self._copier, self._counters = deployment, copier, counters
        self._drives, self._engine, self._on_lost = drives, engine, on_lost
        self._namespace = deployment.identity.namespace

    def build(self, drives: list[Drive], epoch_floor: int = 0) -> RankParts:
        """The rank's parts over ``drives`` (equipped, in configured order), started; their
        epoch exceeds ``epoch_floor`` (a handshake sent while no store was open)."""
        settings, ns, policy = self._dep.settings, self._namespace, self._drives.policy
        first = drives[0].store
        problem = store_problem(first)  # an encrypted store without its master key
        if problem is not None:
            log.warning("spoolctl: %s", problem)
        tenant_bytes = self._tenant_bytes(first)
        epoch = max(d.store.next_generation(f"vllm-connector:{ns}") for d in drives)
        shares = [self.initial_share(d.store) for d in drives]
        holdings = RankHoldings.for_drives(
            {d.id: d.store for d in drives}, self._drives.inventory_up, kind=KIND,
            namespace=ns, rank=self._dep.place.rank, epoch=max(epoch, epoch_floor + 1),
            per_rank_max=settings.max_bytes, share=shares[0],
            bases={d.id: d.base for d in drives}, policy=policy,
            # a redundant copy outlives any restore that located it
            duplicate_grace_s=max(DUPLICATE_GRACE_S, 2 * settings.read_deadline))
        for drive in drives:
            self._drives.use(drive)
            self._listen(drive, holdings)
        holdings.start()
        where = {d.id: Located(d.id, d.store, d.guard, d.pool) for d in drives}

        def locate(key: str) -> Located | None:
            drive = holdings.locate(key, or_down=True)  # a down drive's guard: disk_down
            return where.get(drive) if drive is not None else None

        one = drives[0]
        pipeline = self._pipeline(
            first, one.pool, tenant_bytes,
            # one root reads from its store under its guard: a chunk the catalog has that
            # the inventory has not scanned yet still restores
            guard=None if policy.restores_locate else one.guard,
            locate=locate if policy.restores_locate else None)
        committed = tenant_bytes(m.TENANT_STORE_BYTES)
        stager = None if problem is not None else self._stager(drives, holdings, committed)
        parts = RankParts(holdings, pipeline, stager, where)

        def join(drive: Drive) -> None:
            """Reads first (``locate`` may name it once the inventory knows it), then the
            inventory (its scan on a thread of its own), then the writes."""
            where[drive.id] = Located(drive.id, drive.store, drive.guard, drive.pool)
            self._drives.use(drive)
            self._listen(drive, holdings)
            holdings.add_drive(drive.id, drive.store, drive.base)
            if stager is not None:
                stager.add_drive(drive.id, rank_commit(drive.store, ns, holdings, committed,
                                                       drive=drive.id),
                                 rank_commit_many(drive.store, ns, holdings, committed,
                                                  drive=drive.id),
                                 drive.ledger, self._drives.route, drive.base,
                                 guard=drive.guard)

        parts.join = join
        return parts

    def _listen(self, drive: Drive, holdings: RankHoldings) -> None:
        """A drive down or back changes what the rank holds (where health counts)."""
        if self._drives.policy.inventory_follows_health:
            drive.guard.listen(lambda down: holdings.drives_changed())

    def _stager(self, drives: list[Drive], holdings: RankHoldings,
                committed: Any) -> ChunkStager:
        settings, ns = self._dep.settings, self._namespace
        commits = {d.id: (rank_commit(d.store, ns, holdings, committed, drive=d.id),
                          rank_commit_many(d.store, ns, holdings, committed, drive=d.id),
                          d.ledger) for d in drives}
        engine = self._engine()
        stager = ChunkStager.for_drives(
            commits, self._drives.route, {d.id: d.base for d in drives},
            chunk_bytes=self._copier.chunk_bytes, staging_bytes=settings.staging_bytes,
            meta=self.entry_meta(), counters=self._counters,
            pin=engine is not None and engine.cuda,
            # a commit failing with a disk error counts against its drive
            guards={d.id: d.guard for d in drives})
        # `LLM(...).generate(...)` then exit: commit the last chunks before the pools go.
        exitdrain.register(stager)
        return stager

    def entry_meta(self) -> dict[str, Any]:
        """What every chunk entry's manifest records about the layout and deployment."""
        copier = self._copier
        return {"layout": copier.layout_digest, "chunk_tokens": self._dep.chunk_tokens,
                "chunk_bytes": copier.chunk_bytes, "deployment": self._dep.identity.summary(),
                "kv_layout": copier.layout_json}

    def _pipeline(self, store: Store, pool: Any, tenant_bytes: TenantBytes, *,
                  guard: Any, locate: Callable[[str], Located | None] | None
                  ) -> RestorePipeline:
        engine = self._engine()
        return RestorePipeline(store, self._namespace, chunk_bytes=self._copier.chunk_bytes,
                               pool=pool, counters=self._counters, on_lost=self._on_lost,
                               pin=engine is not None and engine.cuda,
                               deadline_s=self._dep.settings.read_deadline, guard=guard,
                               on_restored=tenant_bytes(m.TENANT_RESTORE_BYTES),
                               # KV in host memory: the readers copy
                               copy_in_reader=engine is not None
                               and engine.device.type == "cpu",
                               locate=locate)

    def _tenant_bytes(self, store: Store) -> TenantBytes:
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

    def initial_share(self, store: Store) -> int | None:
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
