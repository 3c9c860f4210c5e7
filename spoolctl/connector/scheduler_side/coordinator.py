"""The scheduler's work beyond planning one request: ``Coordinator``, owned by ``SchedulerSide``.

* KV events for routers: notes looked-up chunks' vLLM block hashes, sends them with the
  chunk's store plan, announces chunks every rank holds, withdraws them when one rank stops
  holding them, and announces the stores' contents at startup (``take_events``).
* Host disk budget: each rank's share from the handshakes, sent in the step metadata, and
  the chunks one rank withdrew dropped on every rank (``fill``).
* Write admission: stores of chunks not yet admitted are removed from the step's plan
  (skipped, reason ``admission``); with a daily write budget more sightings are asked as
  it runs low and no store is planned once it is spent (reason ``write_budget``).
* Idle stepping (``has_pending_work``): vLLM moves connector messages only in engine
  steps, so an idle engine keeps stepping while something is due, slowly for
  ``idle_tail_s`` after activity, and never longer than ``IDLE_LIMIT_S`` after it.

No vLLM import at runtime (event classes come from ``kvevents`` on first use). Not
thread-safe (vLLM's scheduler is single-threaded).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from spoolctl import metrics as m
from spoolctl.errors import SpoolError
from spoolctl.store import entry_id_for

from ..deployment.host_budget import RankSite, shares
from ..deployment.topology import rank_root
from ..deployment.write_budget import BudgetWatch, effective_after, ledger_path
from ..planning.admission import Admission
from ..planning.events import ChunkHashes, EventLedger, HashBook, chunk_hashes
from ..planning.inventory import Ack, Applied, key_bytes
from ..stats import ConnectorCounters
from .lookup import KIND, RankLookup

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent

    from ..deployment.topology import RankPlace
    from ..planning.messages import SpoolConnectorMetadata
    from ..vllm_api.introspect import Deployment
    from ..vllm_api.protocols import RequestLike

log = logging.getLogger("spoolctl.connector")

IDLE_TAIL_S = 3.0
IDLE_TICK_S = 0.01
IDLE_LIMIT_S = 30.0
DROPS_PER_STEP = 1024
# Above this many chunks to resolve from a store, read its whole catalog once instead of
# one row per chunk (the startup inventory).
_BULK_RESOLVE = 64


class Coordinator:
    """See the module docstring. ``clock`` and ``sleep`` pace idle stepping; ``idle_tail_s``
    is how long after activity an idle engine keeps stepping slowly."""

    def __init__(self, deployment: Deployment, ranks: RankLookup, counters: ConnectorCounters,
                 *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 idle_tail_s: float = IDLE_TAIL_S):
        self._dep = deployment
        self._ranks = ranks
        self._counters = counters
        self._clock, self._sleep = clock, sleep
        self._idle_tail_s = idle_tail_s
        settings = deployment.settings
        hbs = deployment.hash_block_size or deployment.block_size
        self._hbs = hbs
        self._per_chunk = deployment.chunk_tokens // hbs \
            if hbs > 0 and deployment.chunk_tokens % hbs == 0 else 0
        self._book = HashBook()
        self._ledger = EventLedger(self._book) if deployment.kv_events else None
        budgeted = getattr(settings, "write_budget", None) is not None
        self._admission = Admission(settings.admit_after, window_s=settings.admit_window,
                                    track=budgeted)
        # Every rank's ledger paths under this host's roots, one per drive: the ranks on
        # this host have theirs there (from their first write), the others none (their
        # workers still enforce the budget).
        self.budget_watch = BudgetWatch(
            lambda: [[ledger_path(root) for root in self._rank_roots(p)]
                     for p in ranks.places], clock=clock) if budgeted else None
        self._budget: int | None = settings.host_max_bytes
        self._sites: dict[int, RankSite] = {}
        self._shares: dict[int, int] = {}
        self._shares_sent = True
        self._sent_acks: dict[int, Ack] = {}
        self._identity: str | None = None
        self._startup = self._ledger is not None  # the startup inventory is still due
        now = clock()
        self._active_at = now
        self._tail_until = 0.0
        self._slept_at = float("-inf")
        if self._ledger is not None:
            from ..vllm_api.kvevents import reproducible

            if not reproducible(deployment.hash_algo):
                log.warning("spoolctl: prefix_caching_hash_algo=%s without PYTHONHASHSEED "
                            "hashes blocks differently in every process: the spool tier "
                            "announces chunks stored by this process only (set "
                            "PYTHONHASHSEED, or use sha256)", deployment.hash_algo)

    def _rank_roots(self, place: RankPlace) -> list[str]:
        """The rank store roots of ``place`` under this host's roots, one per drive."""
        roots = getattr(self._dep.settings, "roots", ())
        if len(roots) <= 1:
            return [self._dep.rank_root(place)]
        return [rank_root(base, self._dep.chain_namespace, place) for base in roots]

    # -- inputs ---------------------------------------------------------------------------------

    def handshakes(self, sites: Mapping[int, RankSite]) -> None:
        """Where each rank runs and what one chunk costs it (from the handshakes)."""
        self._sites.update(sites)
        self._active_at = self._clock()
        if self._budget is not None:
            fresh = shares(self._budget, self._sites, (p.rank for p in self._ranks.places))
            if fresh != self._shares:
                self._shares, self._shares_sent = fresh, False

    def looked_up(self, req_id: str, request: RequestLike, keys: list[str],
                  present: list[bool]) -> None:
        """A lookup found ``present`` among the request's chunks ``keys``."""
        self._active_at = self._clock()
        raw = [key_bytes(k) for k in keys]
        ledger = self._ledger
        if self._per_chunk:
            found = chunk_hashes(getattr(request, "block_hashes", None) or (), len(raw),
                                 self._per_chunk)
            for key, hashes, held in zip(raw, found, present, strict=True):
                # Needed for a chunk about to be stored, or one to announce on this hit.
                if hashes is not None and (not held or (ledger is not None
                                                        and not ledger.is_advertised(key))):
                    self._book.note(key, hashes)
        self._admission.sighted(req_id, (k for k, p in zip(raw, present, strict=True)
                                         if not p))
        if self._ledger is not None:
            self._ledger.seen(k for k, p in zip(raw, present, strict=True) if p)

    def finished(self, req_id: str) -> None:
        self._admission.finished(req_id)

    def reports_applied(self, applied: Iterable[Applied]) -> None:
        """What the ranks' reports changed (``RankLookup.last_applied``)."""
        applied = list(applied)
        if any(a.kind != "dropped" and (a.added or a.removed or a.kind != "delta")
               for a in applied):
            now = self._clock()
            self._active_at, self._tail_until = now, now + self._idle_tail_s
        if self._ledger is not None:
            self._ledger.applied(applied)

    # -- the step's metadata --------------------------------------------------------------------

    def fill(self, meta: SpoolConnectorMetadata) -> None:
        """Admission, block hashes of the chunks to store, drops, shares (after planning)."""
        if self._admission.enabled and (meta.stores or meta.group_stores):
            after: int | None = self._admission.after
            if self.budget_watch is not None:
                after = effective_after(self._admission.after, self.budget_watch.left_share())
            before = len(meta.stores) + len(meta.group_stores)
            if after is None:  # the day's write budget is spent: plan no store
                meta.stores, meta.group_stores = [], []
                self._counters.inc(m.STORES_SKIPPED, before, reason="write_budget")
            else:
                admitted = self._admission.admitted
                meta.stores = [s for s in meta.stores if admitted(key_bytes(s.key), after)]
                meta.group_stores = [s for s in meta.group_stores
                                     if admitted(key_bytes(s.key), after)]
                skipped = before - len(meta.stores) - len(meta.group_stores)
                if skipped:
                    self._counters.inc(m.STORES_SKIPPED, skipped, reason="admission")
        keys = [s.key for s in meta.stores] + [s.key for s in meta.group_stores]
        if keys:
            now = self._clock()
            self._active_at, self._tail_until = now, now + self._idle_tail_s
            identity = self.identity()
            if identity is not None:
                meta.hash_identity = identity
                for key in keys:
                    hashes = self._book.get(key_bytes(key))
                    if hashes is not None:
                        meta.chunk_hashes[key] = hashes
        meta.drops = self._ranks.view.take_drops(DROPS_PER_STEP)
        if not self._shares_sent:
            meta.capacity = dict(self._shares)
            self._shares_sent = True
        self._sent_acks = dict(meta.acks)

    def identity(self) -> str | None:
        """The fingerprint of vLLM's block hashing here (None until vLLM set its seed)."""
        if self._identity is None and self._per_chunk:
            from ..vllm_api.kvevents import hash_identity

            self._identity = hash_identity(self._dep.hash_algo, self._hbs)
        return self._identity

    # -- KV events ------------------------------------------------------------------------------

    def take_events(self) -> list[KVCacheEvent]:
        """vLLM KV events due now (vLLM's ``take_events``); empty when events are off."""
        if self._ledger is None:
            return []
        identity = self.identity()
        if identity is None:
            return []
        self._startup = False
        unresolved = self._ledger.unresolved
        records = self._ledger.take(self._ranks.view, lambda keys: self._resolve(keys, identity))
        if self._ledger.unresolved > unresolved:
            self._counters.inc(m.EVENTS_UNRESOLVED, self._ledger.unresolved - unresolved)
        if not records:
            return []
        from ..planning.events import Stored
        from ..vllm_api.kvevents import to_vllm

        stored = sum(1 for r in records if isinstance(r, Stored))
        if stored:
            self._counters.inc(m.EVENTS_STORED, stored)
        if len(records) > stored:
            self._counters.inc(m.EVENTS_REMOVED, len(records) - stored)
        group_idx, kind = self._dep.event_group
        return to_vllm(records, block_size=self._hbs, group_idx=group_idx, spec_kind=kind)

    def _resolve(self, keys: list[bytes], identity: str) -> dict[bytes, ChunkHashes]:
        """Hashes recorded in the manifests of ``keys`` (any rank store read here: every
        rank records the same hashes for a chunk)."""
        found: dict[bytes, ChunkHashes] = {}
        for store, ns in self._ranks.local_readers():
            missing = [k for k in keys if k not in found]
            if not missing:
                break
            try:
                if len(missing) > _BULK_RESOLVE:
                    wanted = {k.hex(): k for k in missing}
                    rows = ((wanted[r.key], r.index) for r in store.entries(kind=KIND,
                                                                              namespace=ns)
                            if r.key in wanted)
                else:
                    rows = ((k, row.index) for k in missing
                            if (row := store.row(entry_id_for(KIND, ns, k.hex()))) is not None)
                for key, index in rows:
                    hashes = ChunkHashes.from_index(index, identity)
                    if hashes is not None:
                        found[key] = hashes
            except SpoolError as exc:
                log.warning("spoolctl: could not read chunk hashes for KV events: %s",
                            exc.message)
        return found

    # -- idle stepping --------------------------------------------------------------------------

    def has_pending_work(self) -> bool:
        """Whether the idle engine must take another step (see the module docstring)."""
        now = self._clock()
        if now - self._active_at > IDLE_LIMIT_S:
            return False
        view = self._ranks.view
        if self._startup or view.busy() or not self._shares_sent \
                or (self._ledger is not None and self._ledger.pending) \
                or self._ranks.acks() != self._sent_acks:
            return True
        if now < self._tail_until:
            # Only waiting for background work to show up in a report: step, but slowly
            # (vLLM asks several times per loop iteration; one pause per iteration).
            if now - self._slept_at >= IDLE_TICK_S:
                self._sleep(IDLE_TICK_S)
                self._slept_at = self._clock()
            return True
        return False
