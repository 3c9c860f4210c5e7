"""Scheduler-side lookup: a request's chunk keys, and which of them every rank holds.

* ``request_keys`` names a request's complete prompt chunks (``chain``; on an encrypted
  store per tenant, ``tenancy``), or raises ``Bypass`` for a request that must not use the
  cache (connector disabled, bypass flag, a cache_salt too long to name a tenant,
  a LoRA adapter whose files cannot be read, prompt embeddings, multimodal items without a
  persistent content identity). A LoRA request's chain is keyed by its adapter's content
  digest.
* ``RankLookup`` answers "which chunks does *every* rank hold" (the quorum, ``topology``):
  ranks whose store is on this host are read in their catalogs at every lookup, the others
  in the inventory they report (``inventory``). A rank withdraws an entry before deleting
  it (``holdings``), so no request is planned against a chunk a rank evicted. A catalog
  read has a deadline (``diskguard``): a store late or taken out counts as holding
  nothing, and the request is a miss (``last_unserved``), never a wait on the disk.
  A rank on several drives holds a key when one of its drives that
  answered does; a drive its worker took into its set later is read from when the
  scheduler opened it (``add_drive``). Every local store (every drive of
  every same-host rank) is read at once, each within the deadline, so a lookup waits for
  the slowest store, never for their sum.

No vLLM import: vLLM's request objects are read by attribute.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from spoolctl.store import ConfigError, Store, entry_id_for

from ..deployment.topology import RankPlace, quorum
from ..diskguard import DEFAULT_LOOKUP_DEADLINE_S, DEFAULT_PROBE_INTERVAL_S, DiskGuard, guard_for
from ..planning.chain import MMSpan, chain_root, chunk_keys
from ..planning.inventory import Ack, Applied, InventoryReport, InventoryView, key_bytes
from ..planning.tenancy import TenantKeys

# Every entry the connector writes is of this kind.
KIND = "vllm"
# vLLM's name for media it did not content-hash ("renderer0-mm-7-image-0"): a per-process
# request counter that repeats after a restart, never a persistent identity.
_COUNTER_ID = re.compile(r"^renderer\d+-mm-\d+-")


class Bypass(Exception):
    """A request that must not use the cache; ``args[0]`` is a metrics reason."""


def bypass_reason(request: Any) -> str | None:
    """Why a request must neither be restored nor stored (a metrics reason), or None."""
    params = getattr(request, "kv_transfer_params", None) or {}
    if isinstance(params, dict) and params.get("spoolctl_bypass"):
        return "requested"
    if getattr(request, "prompt_embeds", None) is not None or request.prompt_token_ids is None:
        return "prompt_embeds"
    return None


def mm_spans(request: Any) -> list[MMSpan]:
    """Media identity of every multimodal item; ``Bypass`` when any part is missing.

    An item without its content hash, modality or placeholder range could make two
    different images share KV, so the whole request bypasses persistent reuse.
    """
    spans = []
    for feature in getattr(request, "mm_features", None) or ():
        ident = getattr(feature, "identifier", None)
        modality = getattr(feature, "modality", None)
        pos = getattr(feature, "mm_position", None)
        if not ident or not modality or pos is None or _COUNTER_ID.match(str(ident)):
            raise Bypass("multimodal")
        try:
            spans.append(MMSpan(str(ident), int(pos.offset), int(pos.length),
                                modality=str(modality)))
        except (TypeError, ValueError):
            raise Bypass("multimodal") from None
    return spans


def request_keys(request: Any, *, namespace: str, chunk_tokens: int, enabled: bool = True,
                 mm_unhashed: bool = False,
                 adapters: Callable[[Any], str | None] | None = None,
                 tenants: TenantKeys | None = None) -> list[str]:
    """The chunk keys of ``request``'s prompt (see ``chain``); ``Bypass`` when it must not
    use the cache. ``mm_unhashed``: vLLM names media by request counters, not content.
    ``adapters``: a LoRA request's adapter -> its content digest (None: unreadable); without
    it, LoRA requests bypass. ``tenants``: on an encrypted store, the keys are the tenant
    chunk keys of the request's ``cache_salt`` (``tenancy``)."""
    reason = "disabled" if not enabled else bypass_reason(request)
    if reason is not None:
        raise Bypass(reason)
    adapter = None
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        adapter = adapters(lora) if adapters is not None else None
        if adapter is None:
            raise Bypass("lora")
    spans = mm_spans(request)
    if spans and mm_unhashed:
        raise Bypass("multimodal")  # identifiers are request counters, not content
    salt = getattr(request, "cache_salt", None)
    keys = chunk_keys(chain_root(namespace, salt, adapter), request.prompt_token_ids,
                      chunk_tokens, spans)
    if tenants is None:
        return keys
    try:
        return tenants.keys(salt, keys)
    except ConfigError:
        raise Bypass("tenant") from None  # a salt that names no tenant (over 1024 chars)


class RankLookup:
    """Which chunks every rank holds (see the module docstring). Not thread-safe (the
    scheduler is not). Until a rank is known (its handshake) its chunks are misses."""

    def __init__(self, places: Sequence[RankPlace], *,
                 deadline_s: float = DEFAULT_LOOKUP_DEADLINE_S,
                 probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S):
        self._places = list(places)
        self._local: dict[int, tuple[Store, str]] = {}  # rank -> (its store, its namespace)
        self._guards: dict[int, DiskGuard] = {}  # rank -> its store's deadlines and health
        # Ranks on several drives: rank -> its other drives' (store, guard). With more than
        # one local store, every store is read at once on ``_readers`` (each read returns
        # within its guard's deadline).
        self._more: dict[int, list[tuple[Store, DiskGuard]]] = {}
        self._readers: ThreadPoolExecutor | None = None
        self._readers_width = 0
        self._guard_settings = {"deadline_s": deadline_s, "probe_interval_s": probe_interval_s}
        # The last ``present`` found a local store late or out of service (its chunks: misses).
        self.last_unserved = False
        self._view = InventoryView(p.rank for p in self._places)
        self.last_applied: list[Applied] = []  # what the last ``apply`` changed, per report

    def present(self, keys: list[str]) -> list[bool]:
        """Which of ``keys`` *every* rank holds (committed, retained): the quorum."""
        raw = [key_bytes(k) for k in keys]
        self.last_unserved = False
        local = self._read_local(keys)

        def per_rank():
            for place in self._places:
                held = local.get(place.rank)
                yield self._view.has(place.rank, raw) if held is None else held

        return quorum(per_rank(), len(keys))

    def _read_local(self, keys: list[str]) -> dict[int, list[bool]]:
        """Per local rank, which of ``keys`` one of its stores that answered holds (a late
        or down store holds nothing: ``last_unserved``). Every store's ``live(ids)`` is
        started at once, each within its guard's deadline, so the whole read takes the
        slowest store's time, not the sum over ranks and drives; one
        store alone is read on the caller's thread."""
        reads: list[tuple[int, list[str], Store, DiskGuard]] = []
        for rank, (store, ns) in self._local.items():
            ids = [entry_id_for(KIND, ns, k) for k in keys]
            reads += [(rank, ids, s, g)
                      for s, g in [(store, self._guards[rank]), *self._more.get(rank, ())]]
        if not reads:
            return {}
        if len(reads) == 1:
            rank, ids, store, guard = reads[0]
            answers = [guard.call(partial(store.live, ids))]
        else:
            assert self._readers is not None
            calls = [self._readers.submit(guard.call, partial(store.live, ids))
                     for _, ids, store, guard in reads]
            answers = [call.result() for call in calls]
        held: dict[int, list[bool]] = {r: [False] * len(keys) for r in self._local}
        for (rank, ids, _, _), (served, live) in zip(reads, answers, strict=True):
            if not served:
                self.last_unserved = True
                continue
            held[rank] = [h or i in live for h, i in zip(held[rank], ids, strict=True)]
        return held

    def touch(self, keys: Iterable[str]) -> None:
        """Mark ``keys`` used in the stores read here (each worker touches its own at
        restore; this keeps a same-host store's LRU clock current at lookup)."""
        keys = list(keys)
        for rank, (store, ns) in self._local.items():
            ids = [entry_id_for(KIND, ns, k) for k in keys]
            # Best effort, never waited for: skipped while the disk is busy or out.
            self._guards[rank].spare(partial(store.touch, ids))
            for other, guard in self._more.get(rank, ()):
                guard.spare(partial(other.touch, ids))

    @property
    def places(self) -> list[RankPlace]:
        """Every rank of the deployment."""
        return list(self._places)

    def place_of(self, rank: int) -> RankPlace | None:
        return next((p for p in self._places if p.rank == rank), None)

    def read_locally(self, rank: int, store: Store, namespace: str) -> Store | None:
        """Read ``rank``'s chunks in ``store``'s catalog from now on (same host); returns
        the store it was read in before, if any."""
        before = self._local.get(rank)
        self._local[rank] = (store, namespace)
        self._guards[rank] = guard_for(store, **self._guard_settings)
        self._widen()
        return before[0] if before is not None else None

    def read_on_drives(self, rank: int, more: Sequence[Store]) -> list[Store]:
        """A rank on several drives: read its chunks in ``more`` (its stores on its other
        drives) too, with the store given to ``read_locally``; returns the other drives'
        stores it was read in before (for the caller to release)."""
        earlier = [s for s, _ in self._more.pop(rank, [])]
        if more:
            self._more[rank] = [(s, guard_for(s, **self._guard_settings)) for s in more]
            self._widen()
        return earlier

    def stores_of(self, rank: int) -> list[Store]:
        """The stores ``rank`` is read in here (every drive's); empty: read from reports."""
        local = self._local.get(rank)
        if local is None:
            return []
        return [local[0], *(s for s, _ in self._more.get(rank, ()))]

    def add_drive(self, rank: int, store: Store) -> bool:
        """Read ``rank``'s chunks in ``store`` too from now on (a drive its worker took into
        its set after the handshake); False when ``rank`` is read from its
        reports (which cover the drive already), leaving ``store`` to the caller."""
        if rank not in self._local:
            return False
        self.read_on_drives(rank, [*self.stores_of(rank)[1:], store])  # same guards
        return True

    def _widen(self) -> None:
        """A reader thread for every local store when there is more than one (``present``
        reads them all at once)."""
        width = len(self._local) + sum(len(d) for d in self._more.values())
        if width > 1 and (self._readers is None or self._readers_width < width):
            old, self._readers_width = self._readers, width
            self._readers = ThreadPoolExecutor(width, thread_name_prefix="spoolctl-lookup")
            if old is not None:
                old.shutdown(wait=False)

    def stop_reading_locally(self) -> list[Store]:
        """Forget every local store (their ranks' chunks are then known from reports
        only); returns them."""
        stores = self.local_stores()
        self._local.clear()
        self._guards.clear()
        self._more.clear()
        if self._readers is not None:
            self._readers.shutdown(wait=False)  # every read on it ends within its deadline
            self._readers, self._readers_width = None, 0
        return stores

    def apply(self, reports: Iterable[InventoryReport]) -> list[int]:
        """Apply ranks' inventory reports in order; return the ranks the scheduler newly
        lost track of (a gap or a restart: their chunks are misses until they restate).
        What each report changed is left in ``last_applied`` (for the KV events)."""
        before = self._view.resync_requests()
        self.last_applied = [self._view.apply(report) for report in reports]
        return sorted(self._view.resync_requests().keys() - before.keys())

    @property
    def view(self) -> InventoryView:
        """Every rank's reported inventory (all ranks report, wherever they are read)."""
        return self._view

    def local_readers(self) -> list[tuple[Store, str]]:
        """(store, namespace) of every rank store read here directly (every drive's), in
        rank order."""
        return [(s, self._local[r][1]) for r in sorted(self._local)
                for s in (self._local[r][0], *(o for o, _ in self._more.get(r, ())))]

    def acks(self) -> dict[int, Ack]:
        return self._view.acks()

    def resync_requests(self) -> dict[int, int]:
        return self._view.resync_requests()

    def local_stores(self) -> list[Store]:
        return [s for s, _ in self.local_readers()]

    def down_ranks(self) -> list[int]:
        """Ranks read here with a store out of service (``diskguard``; on several drives:
        one entry per drive out, so ``spoolctl_disk_down`` counts stores)."""
        return sorted([r for r, g in self._guards.items() if g.down] +
                      [r for r, more in self._more.items() for _, g in more if g.down])

    def drives_up(self, rank: int) -> dict[str, bool]:
        """The stores ``rank`` is read in here, by root (``os.path.normpath``): True while
        in service by this scheduler's own guards. Empty: read from its reports."""
        local = self._local.get(rank)
        if local is None:
            return {}
        guards = [(local[0], self._guards[rank]), *self._more.get(rank, ())]
        return {os.path.normpath(str(s.root)): not g.down for s, g in guards}

    def state(self) -> dict:
        """Per rank: how it is read and how many chunks it is known to hold (and
        ``disk_down: True`` while its store is out of service here)."""
        down = set(self.down_ranks())
        return {p.rank: {"source": "catalog" if p.rank in self._local else "reports",
                         "known": self._view.known(p.rank),
                         **({"disk_down": True} if p.rank in down else {})}
                for p in self._places}
