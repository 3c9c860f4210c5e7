"""The scheduler side of the connector: lookups, planning, and what each rank holds.

``SchedulerSide`` is built by ``SpoolConnector`` in vLLM's scheduler (engine core). For
each new request it names the prompt's chunks and asks which of them every rank holds
(``lookup``); the format's ``Planning`` (``formats``) turns the hit into the restores and
captures sent to the workers each step (``build_meta``). What remote ranks hold comes from
their handshakes and per-step reports (``adopt_handshakes``, ``apply_output``); a rank
whose store is on this host (same boot, same path, same store id) is read in its catalog
instead, through a store shared with a same-process worker (``rankstores``); on several
drives every drive's catalog, including a drive the worker took into its set after the
handshake, opened here off the engine loop when the worker names it (``latedrives``).

A request whose restore failed (``failed_recving``, or a block reported invalid) is never
restored again (a deterministic failure would otherwise loop): when vLLM looks it up anew
it recomputes in full, and its absent chunks are still stored. That lookup is counted a
miss with the reason the worker reported in the same step (``SpoolWorkerMeta``:
``disk_slow``, ``io_error``, ``disk_down``, ``corrupt``, ``absent``, ``unknown``), kept
only while the request is in vLLM.

What concerns the fleet and the host rather than one request (KV events for routers, the
host disk budget's shares, drops, write admission, keeping an idle engine stepping while
any of it is due) is the ``Coordinator``'s (``coordinator``).
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from pathlib import Path
from typing import Any

from spoolctl import metrics as m
from spoolctl.errors import SpoolError

from ..deployment.host_budget import RankSite
from ..deployment.topology import all_ranks
from ..deployment.usage_record import UsageRecorder
from ..deployment.weights import AdapterDigests, memo_dir_for
from ..drives.opening import DriveStores
from ..drives.rankstores import OpenStores
from ..kv.formats import KVFormat
from ..planning.messages import (
    DriveInfo,
    SpoolConnectorMetadata,
    SpoolHandshake,
    SpoolWorkerMeta,
)
from ..planning.tenancy import TenantKeys, TenantLabels
from ..stats import ConnectorCounters
from ..vllm_api.introspect import Deployment, host_identity, scheduled_requests
from .coordinator import Coordinator
from .latedrives import LateDrives
from .lookup import Bypass, RankLookup, request_keys

log = logging.getLogger("spoolctl.connector")


def usage_counts(counters: ConnectorCounters) -> tuple[int, int, int, int]:
    """(lookup tokens, hit tokens, lookups, hits) since the engine started; bypassed
    requests are no lookups."""
    totals = counters.totals()  # one snapshot under the counters' lock, not three
    lookups = totals.get(m.LOOKUPS.name, {})
    return (int(sum(totals.get(m.LOOKUP_TOKENS.name, {}).values())),
            int(sum(totals.get(m.HIT_TOKENS.name, {}).values())),
            int(sum(v for k, v in lookups.items() if "result=bypass" not in k.split(","))),
            int(sum(v for k, v in lookups.items() if "result=hit" in k.split(","))))


class SchedulerSide:
    """See the module docstring. Not thread-safe (vLLM's scheduler is not)."""

    def __init__(self, deployment: Deployment, fmt: KVFormat, counters: ConnectorCounters,
                 stores: OpenStores):
        self._dep = deployment
        self._fmt = fmt
        self._counters = counters
        self._stores = stores
        self._chunk = deployment.chunk_tokens
        self._planning = fmt.planning()
        ident = deployment.identity
        # Until the workers' handshakes arrive every rank is unknown: all misses.
        settings = deployment.settings
        self._ranks = RankLookup(all_ranks(ident.tp_size, ident.pp_size),
                                 deadline_s=settings.lookup_deadline,
                                 probe_interval_s=settings.probe_interval)
        # Requests whose restore failed -> why (a ``restore_failure`` reason); each leaves
        # with its request (``finished``).
        self._no_restore: dict[str, str] = {}
        self._coord = Coordinator(deployment, self._ranks, counters)
        # Drives a same-host rank took into its set after its handshake.
        self._late = LateDrives(stores, tag_key=settings.tag_key(),
                                deadline_s=settings.lookup_deadline,
                                probe_interval_s=settings.probe_interval)
        # Ranks on several drives: rank -> root -> (the drive as its worker named it last,
        # whether it was taken into the set after the handshake); for ``inventory_state``.
        self._drive_infos: dict[int, dict[str, tuple[DriveInfo, bool]]] = {}
        # LoRA requests are keyed by their adapter's content digest.
        self._adapters = AdapterDigests(memo_dir_for(deployment.settings.weights_memo))
        # Encryption at rest: each request's cache_salt names its tenant.
        self._tenants = TenantKeys.from_environment()
        self._tenant_labels = TenantLabels(settings.tenant_metrics
                                           if self._tenants is not None else 0)
        # The hit rate for `spoolctl status`, beside the rank stores (usage_record); the final
        # counts also at interpreter exit (vLLM may never call the scheduler's shutdown).
        self._usage = UsageRecorder(Path(deployment.rank_root(deployment.place)).parent)
        self._usage_counts = functools.partial(usage_counts, counters)
        self._usage_final = weakref.finalize(self, self._usage.close, self._usage_counts)

    # -- what each rank holds ------------------------------------------------------------------

    @property
    def deployment(self) -> Deployment:
        return self._dep

    @property
    def tenants(self) -> TenantKeys | None:
        """The tenants' keys from the environment (None: no encryption at rest)."""
        return self._tenants

    @property
    def unrestorable(self) -> dict[str, str]:
        """Requests whose restore failed -> why (a copy; kept while the request is in vLLM)."""
        return dict(self._no_restore)

    def adopt_handshakes(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Every worker's handshake, keyed by (pp_rank, tp_rank): adopt its inventory, and read
        its catalog directly when its store is on this host (and inventory mode allows)."""
        here = host_identity()
        tp_size = self._dep.identity.tp_size
        sites: dict[int, RankSite] = {}
        for (pp_rank, tp_rank), hs in metadata.items():
            if not isinstance(hs, SpoolHandshake) or hs.rank != pp_rank * tp_size + tp_rank:
                log.warning("spoolctl: ignoring a malformed handshake from pp %s tp %s; that "
                            "rank's chunks are misses", pp_rank, tp_rank)
                continue
            self._ranks.apply([hs.report])
            self._coord.reports_applied(self._ranks.last_applied)
            sites[hs.rank] = RankSite(hs.host, hs.chunk_bytes)
            if hs.drives:  # several drives: named in ``inventory_state``
                self._drive_infos[hs.rank] = {os.path.normpath(d.root): (d, False)
                                              for d in hs.drives}
            if self._dep.settings.inventory == "auto" and hs.host == here:
                self._adopt_local(hs)
        self._coord.handshakes(sites)

    def _adopt_local(self, hs: SpoolHandshake) -> None:
        place = self._ranks.place_of(hs.rank)
        if place is None:
            return
        root = self._dep.rank_root(place)
        if os.path.normpath(hs.root) != os.path.normpath(root):
            return
        if not hs.store_id:
            return  # its worker has not opened it yet (a hung or missing disk): reports
        settings = self._dep.settings
        # Several drives: every drive the worker uses, each checked by its store id.
        wanted = [(d.base, d.root) for d in hs.drives] or [(settings.root, root)]
        ids = [d.store_id for d in hs.drives] or [hs.store_id]
        try:
            # A reader: never changes the max size the rank records (its worker sets it).
            # Bounded: a disk that hangs now must not hang vLLM's scheduler.
            drives = DriveStores.open(wanted, self._stores, create=False,
                                      tag_key=settings.tag_key(),
                                      deadline_s=settings.lookup_deadline,
                                      probe_interval_s=settings.probe_interval)
        except SpoolError as exc:
            log.warning("spoolctl: rank %d store not readable here (%s); using its reports",
                        hs.rank, exc.message)
            return
        opened = [s.store for s in drives.slots if s.store is not None]
        if len(opened) != len(wanted):
            drives.close()  # no retries: its reports tell what it holds
            log.warning("spoolctl: rank %d store not open here in time; using its reports",
                        hs.rank)
            return
        if [s.marker.store_id for s in opened] != ids:
            drives.close()
            return  # same path, different store (another disk mounted there): use reports
        store, *more = opened
        assert store is not None
        before = self._ranks.read_locally(hs.rank, store, self._dep.rank_namespace(place))
        if before is not None:  # a repeated handshake: one reference per rank
            self._stores.release(before)
        for earlier in self._ranks.read_on_drives(hs.rank, more):  # several drives
            self._stores.release(earlier)

    def apply_output(self, connector_output: Any) -> None:
        """The workers' step output: failed restores and inventory reports."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        failed = self._planning.load_failures(
            set(getattr(connector_output, "finished_recving", None) or ()),
            set(getattr(connector_output, "failed_recving", None) or ()),
            set(getattr(connector_output, "invalid_block_ids", None) or ()))
        if failed:
            # The workers say why in the same step's output (a worker that did not: unknown).
            # Only requests still in vLLM (planned, not finished): one aborted meanwhile
            # would never be looked up or finished again, its entry never removed.
            reasons = meta.load_failures if isinstance(meta, SpoolWorkerMeta) else {}
            live = self._planning.planner.requests
            for req_id in failed & live.keys():
                self._no_restore[req_id] = reasons.get(req_id, "unknown")
        if not isinstance(meta, SpoolWorkerMeta):
            return
        if meta.drives:
            self._drives_joined(meta.drives)
        for rank in self._ranks.apply(meta.reports):
            log.warning("spoolctl: lost track of rank %d's inventory (a report went missing "
                        "or the rank restarted); its chunks are misses until it restates it",
                        rank)
        self._coord.reports_applied(self._ranks.last_applied)

    def _drives_joined(self, drives: dict[int, tuple[DriveInfo, ...]]) -> None:
        """A worker took a drive into its set after the handshake: for a rank whose
        catalogs are read here, open each drive not read yet (``latedrives``; returns at
        once). A rank read from its reports needs nothing: they cover every drive."""
        for rank, infos in drives.items():
            known = self._drive_infos.setdefault(rank, {})
            for info in infos:  # opened late: not opened by its worker at the handshake
                before = known.get(os.path.normpath(info.root))
                late = before is None or before[1] or (bool(info.store_id)
                                                      and not before[0].store_id)
                known[os.path.normpath(info.root)] = (info, late)
            read = {os.path.normpath(str(s.root)) for s in self._ranks.stores_of(rank)}
            if not read:
                continue
            for info in infos:
                if info.store_id and os.path.normpath(info.root) not in read:
                    self._late.want(rank, info)

    def _adopt_late_drives(self) -> None:
        """On the engine loop, memory only: read the drives opened since in their ranks'
        lookups (each checked by the store id its worker named)."""
        for rank, info, store in self._late.take():
            if any(s is store for s in self._ranks.stores_of(rank)):
                self._stores.release(store)  # read already (its root spelt another way)
                continue
            if store.marker.store_id != info.store_id:
                log.warning("spoolctl: rank %d drive %s holds another store than its worker "
                            "named; not read here", rank, info.base)
                self._stores.release(store)
                continue
            if not self._ranks.add_drive(rank, store):  # read from its reports meanwhile
                self._stores.release(store)
                continue
            log.info("spoolctl: rank %d drive %s read here from now on", rank, info.base)

    # -- per request ---------------------------------------------------------------------------

    def lookup(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: the tokens to restore beyond
        ``num_computed_tokens``, and whether the restore is asynchronous."""
        req_id = request.request_id
        self._planning.finished(req_id)  # a re-query (e.g. after preemption) starts afresh
        self._adopt_late_drives()
        try:
            keys = request_keys(request, namespace=self._dep.chain_namespace,
                                chunk_tokens=self._chunk, enabled=self._dep.enabled,
                                mm_unhashed=self._dep.mm_unhashed, adapters=self._adapters,
                                tenants=self._tenants)
            present = self._ranks.present(keys)
        except Bypass as bypass:
            self._counters.inc(m.LOOKUPS, result="bypass", reason=bypass.args[0])
            return 0, False
        except SpoolError as exc:
            log.warning("spoolctl: lookup failed, serving without cache: %s", exc.message)
            self._counters.inc(m.LOOKUPS, result="error", reason="none")
            return 0, False
        self._coord.looked_up(req_id, request, keys, present)
        n_prompt = len(request.prompt_token_ids)
        if req_id in self._no_restore:
            # Its asynchronous restore failed (a bad entry, a slow or failing disk): recompute
            # it in full rather than risk the same failure again; absent chunks are still
            # stored. Counted with the worker's reason, not as corruption.
            self._planning.lookup(req_id, keys, present, n_prompt, num_computed_tokens,
                                  restore=False)
            self._counters.inc(m.LOOKUPS, result="miss", reason=self._no_restore[req_id])
            return 0, False
        ext = self._planning.lookup(req_id, keys, present, n_prompt, num_computed_tokens)
        self._counters.inc(m.LOOKUP_TOKENS, n_prompt)
        self._count_tenant(request, ext)
        if ext > 0:
            usable = (n_prompt - 1) // self._chunk
            full = sum(present[:usable]) == usable
            self._counters.inc(m.LOOKUPS, result="hit", reason="none" if full else "partial")
            self._counters.inc(m.HIT_TOKENS, ext)
            hit_chunks = -(-(num_computed_tokens + ext) // self._chunk)
            self._ranks.touch(keys[:hit_chunks])
        else:
            # A store late or out of service on this host is a miss too.
            self._counters.inc(m.LOOKUPS, result="miss",
                               reason="disk_down" if self._ranks.last_unserved else "absent")
        # Both formats restore asynchronously: the request waits for its KV while others
        # run.
        return ext, self._fmt.load_async and ext > 0

    def _count_tenant(self, request: Any, ext: int) -> None:
        """Per-tenant hits and misses on an encrypted store (opaque ids, bounded)."""
        if self._tenants is None or not self._tenant_labels.enabled:
            return
        tid = self._tenants.tenant_id(getattr(request, "cache_salt", None))
        tenant = self._tenant_labels.label(tid)
        self._counters.inc(m.TENANT_LOOKUPS, tenant=tenant, result="hit" if ext > 0 else "miss")
        if ext > 0:
            self._counters.inc(m.TENANT_HIT_TOKENS, ext, tenant=tenant)

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM's ``update_state_after_alloc``."""
        self._planning.allocated(request.request_id, blocks, num_external_tokens)

    def build_meta(self, scheduler_output: Any) -> SpoolConnectorMetadata:
        """This step's restores and captures, and the inventory protocol's messages."""
        meta = SpoolConnectorMetadata()
        steps = list(scheduled_requests(scheduler_output))
        self._planning.plan_step(steps, meta)
        meta.idle = all(s.computed_after <= s.computed_before for s in steps)
        meta.acks = self._ranks.acks()
        meta.resync = self._ranks.resync_requests()
        self._coord.fill(meta)
        self._usage.offer(self._usage_counts)
        return meta

    def finished(self, request: Any, *, all_groups: bool = True) -> tuple[bool, dict | None]:
        """The request left vLLM. Captures are synchronous and restores end before the
        request leaves ``WAITING_FOR_REMOTE_KVS`` (vLLM delays freeing until then), so no
        block is held."""
        self._planning.finished(request.request_id)
        if all_groups:
            self._no_restore.pop(request.request_id, None)
            self._coord.finished(request.request_id)
        return False, None

    # -- KV events and idle steps (``coordinator``) -------------------------------------------

    def take_events(self) -> list[Any]:
        """vLLM's ``take_events``: the spool tier's KV events due now."""
        return self._coord.take_events()

    def has_pending_work(self) -> bool:
        """vLLM's ``has_pending_push_work``: whether an idle engine must step again."""
        return self._coord.has_pending_work()

    # -- diagnostics and lifecycle -------------------------------------------------------------

    def take_stats(self) -> dict[str, Any]:
        if self._ranks.local_stores():
            self._counters.set_gauge(m.DISK_DOWN, len(self._ranks.down_ranks()))
        return self._counters.take()

    @property
    def store_roots(self) -> list[str]:
        """The rank stores read here directly (known after the workers' handshakes)."""
        return [str(store.root) for store in self._ranks.local_stores()]

    @property
    def inventory_state(self) -> dict:
        """Per rank (``RankLookup.state``); a rank on several drives also gets ``drives``:
        per drive its ``base``, ``root``, ``drive`` id, ``source`` (``catalog``: read here;
        ``reports``: covered by the rank's reports; ``pending``: its worker has not opened
        it), ``up`` (a drive read here: by this scheduler's own guards; else None) and
        ``late`` (its worker took it into its set after the handshake)."""
        state = self._ranks.state()
        for rank, infos in self._drive_infos.items():
            if rank not in state:
                continue
            read = self._ranks.drives_up(rank)
            state[rank]["drives"] = [
                {"base": info.base, "root": info.root, "drive": info.drive_id,
                 "source": "catalog" if root in read else
                 "reports" if info.store_id else "pending",
                 "up": read.get(root), "late": late}
                for root, (info, late) in infos.items()]
        return state

    def shutdown(self) -> None:
        """Let go of the rank stores read here (closed with their last user)."""
        self._usage_final()
        self._late.close()
        for store in self._ranks.stop_reading_locally():
            self._stores.release(store)
