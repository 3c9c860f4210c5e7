"""A worker's view of its own rank store: inventory reports and withdraw-then-delete eviction.

``RankHoldings`` wraps the pure ``inventory.RankInventory`` with the store I/O it
needs. It learns what the store holds from a full catalog scan at start, from the
connector (a chunk committed, a chunk that failed to read) and from periodic rescans
(entries an operator deleted, scrub quarantined). It also enforces the store's
capacity itself, because an entry other ranks' plans may still count on must be
withdrawn — reported, and acknowledged by the scheduler — before it is deleted:

1. over ``max_bytes``: choose victims in the store's eviction order (released first,
   then least recently used, down to 90%);
2. withdraw each from the inventory and ``release`` it in the catalog (a same-host
   scheduler reading the catalog stops counting it at once);
3. once the scheduler acknowledged the report carrying the withdrawal, delete the
   entries that are still released (a chunk re-stored meanwhile is kept).

A withdrawal that stays unacknowledged for ``ack_timeout_s`` (an engine that takes
no steps, a scheduler that never learnt of this rank) is deleted anyway, so the store
stays bounded; a restore planned against it meanwhile fails its read and is
recomputed, as for any entry lost behind the connector's back.

Two more reasons to withdraw an entry come from the scheduler (``on_scheduler``):
another rank withdrew the same chunk (``drops``: the chunk is a miss everywhere now, so
every rank frees it), and a host disk budget share (``host_budget``): the store's
recorded max size becomes ``min(spoolctl_max_size, share)``, enforced as above.

All store I/O runs on one daemon thread, never on vLLM's engine loop; the methods
the connector calls from the engine loop only take a lock and touch memory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from spoolctl.errors import BusyError, SpoolError
from spoolctl.store import Store, entry_id_for

from ..deployment.host_budget import effective_max
from ..planning.inventory import (
    HANDSHAKE_MAX_KEYS,
    STEP_MAX_KEYS,
    Ack,
    InventoryReport,
    RankInventory,
    key_bytes,
    resync_for,
)

log = logging.getLogger("spoolctl.connector")

RESCAN_S = 10.0
EVICTION_BUDGET = 1024
ACK_TIMEOUT_S = 300.0


class RankHoldings:
    """See the module docstring. ``start()`` scans the store; ``stop()`` ends the thread."""

    def __init__(self, store: Store, *, kind: str, namespace: str, rank: int, epoch: int,
                 rescan_s: float = RESCAN_S, ack_timeout_s: float = ACK_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic,
                 per_rank_max: int | None = None, share: int | None = None):
        """``per_rank_max``: ``spoolctl_max_size``; ``share``: this rank's host budget share
        until the scheduler sends one (None: no host budget)."""
        self.store = store
        self.kind = kind
        self.namespace = namespace
        self.rank = rank
        self.rescan_s = rescan_s
        self.ack_timeout_s = ack_timeout_s
        self._clock = clock
        self._withdrawn_at: dict[bytes, float] = {}
        self._inv = RankInventory(rank, epoch)
        self._lock = threading.Lock()
        self._deletable: list[bytes] = []  # acknowledged withdrawals, deleted by the thread
        self._drops: list[bytes] = []  # chunks the scheduler asked every rank to drop
        self._per_rank_max = per_rank_max
        self._share = share  # the host budget share to apply (None: no host budget)
        self._scan_adds: set[bytes] | None = None  # commits seen while a rescan runs
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.evicted_entries = 0
        self.evicted_bytes = 0
        self.withdrawn_then_deleted = 0  # deletions that waited for the scheduler's ack
        self.dropped = 0  # entries withdrawn because another rank withdrew them

    @property
    def epoch(self) -> int:
        return self._inv.epoch

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Apply the host budget share, scan the store (so the handshake carries the
        inventory), then start the thread."""
        self._apply_share()
        self.rescan()
        self._thread = threading.Thread(target=self._run, name="spoolctl-holdings", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    # -- engine-loop side (memory only) --------------------------------------------------------

    def committed(self, key: str) -> None:
        raw = key_bytes(key)
        with self._lock:
            self._inv.add(raw)
            self._withdrawn_at.pop(raw, None)
            if self._scan_adds is not None:
                self._scan_adds.add(raw)
        if self.store.max_bytes is not None:
            self._wake.set()  # the thread checks capacity

    def lost(self, key: str) -> None:
        with self._lock:
            self._inv.lost(key_bytes(key))

    def handshake_report(self) -> InventoryReport:
        with self._lock:
            self._inv.resync()  # the handshake always restates the inventory
            report = self._inv.report(HANDSHAKE_MAX_KEYS)
        assert report is not None  # a reset report is never empty of meaning
        return report

    def step_report(self) -> InventoryReport | None:
        with self._lock:
            return self._inv.report(STEP_MAX_KEYS)

    def on_scheduler(self, acks: Mapping[int, Ack], resync: Mapping[int, int],
                     drops: Iterable[bytes] = (), share: int | None = None) -> None:
        """Apply the scheduler's acknowledgement and resync request for this rank, the
        chunks every rank should drop and this rank's host budget share."""
        ack = acks.get(self.rank)
        with self._lock:
            if resync_for(resync, self.rank, self._inv.epoch):
                self._inv.resync()
            done = self._inv.acked(ack) if ack is not None else []
            if done:
                self._deletable.extend(done)
            held = [k for k in drops if self._inv.holds(k)]
            self._drops.extend(held)
            wake = bool(done or held)
            if share is not None and self._share is not None and share != self._share:
                self._share, wake = share, True
        if wake:
            self._wake.set()

    @property
    def awaiting(self) -> int:
        with self._lock:
            return self._inv.awaiting

    def held_keys(self) -> set[str]:
        with self._lock:
            return {k.hex() for k in self._inv.held}

    # -- background thread (store I/O) --------------------------------------------------------

    def _run(self) -> None:
        scanned = self._clock()
        while not self._stop.is_set():
            self._wake.wait(max(0.0, scanned + self.rescan_s - self._clock()))
            self._wake.clear()
            if self._stop.is_set():
                return
            steps = (self._apply_share, self._delete_acknowledged, self._drop_requested)
            # A rescan every rescan_s even when commits keep waking the thread (a busy store
            # must still notice deletions made behind its back, e.g. ``spoolctl clean``).
            due = self._clock() - scanned >= self.rescan_s
            if due:
                scanned = self._clock()
            for step in (*steps, self.rescan, self._enforce_capacity) if due \
                    else (*steps, self._enforce_capacity):
                try:
                    step()
                except BusyError:
                    pass  # maintenance elsewhere; next round
                except Exception as exc:  # never let bookkeeping take the worker down
                    log.warning("spoolctl: inventory step failed: %s",
                                exc.message if isinstance(exc, SpoolError) else exc)

    def rescan(self) -> None:
        """Re-read the store's inventory (catches deletions made behind our back)."""
        with self._lock:
            self._scan_adds = set()
        try:
            keys = self.store.live_keys(self.kind, self.namespace)
        except BaseException:
            with self._lock:
                self._scan_adds = None
            raise
        held = set()
        for key in keys:
            with contextlib.suppress(ValueError):
                held.add(key_bytes(key))
        with self._lock:
            held |= self._scan_adds or set()
            self._scan_adds = None
            self._inv.replace(held)

    def _entry_id(self, raw: bytes) -> str:
        return entry_id_for(self.kind, self.namespace, raw.hex())

    def _apply_share(self) -> None:
        """Record the effective max size (``min(spoolctl_max_size, share)``) in the store."""
        with self._lock:
            share = self._share
        if share is None:
            return
        bound = effective_max(self._per_rank_max, share)
        if bound != self.store.max_bytes:
            self.store.set_max_bytes(bound)

    def _drop_requested(self) -> None:
        with self._lock:
            keys, self._drops = self._drops, []
        if keys:
            self.dropped += self._withdraw([self._entry_id(k) for k in keys])

    def _enforce_capacity(self) -> None:
        if self.store.max_bytes is None or self.store.totals().bytes <= self.store.max_bytes:
            return
        plan = self.store.enforce_capacity(dry_run=True, budget=EVICTION_BUDGET, wait=False)
        self._withdraw(plan.entry_ids)

    def _withdraw(self, entry_ids: Iterable[str]) -> int:
        """Withdraw entries (release them, report their removal) and delete those the
        scheduler cannot count on; the rest are deleted once acknowledged. Returns how
        many were withdrawn."""
        now: list[str] = []
        expired = withdrawn = 0
        for entry_id in entry_ids:
            row = self.store.row(entry_id)
            if row is None:
                continue
            wait = False
            if row.kind == self.kind and row.namespace == self.namespace:
                with contextlib.suppress(ValueError), self._lock:
                    raw = key_bytes(row.key)
                    wait = self._inv.withdraw(raw)
                    since = self._withdrawn_at.setdefault(raw, self._clock())
                    if wait and self._clock() - since >= self.ack_timeout_s:
                        self._inv.expire(raw)  # bounded disk beats a perfect withdrawal
                        wait = False
                        expired += 1
                    if not wait:
                        self._withdrawn_at.pop(raw, None)
            self.store.release(entry_id)
            withdrawn += 1
            if not wait:
                now.append(entry_id)
        if expired:
            log.warning("spoolctl: %d evicted chunks were never acknowledged by the scheduler "
                        "within %.0f s; deleted anyway (restores planned against them are "
                        "recomputed)", expired, self.ack_timeout_s)
        if now:
            self._delete(now)
        return withdrawn

    def _delete_acknowledged(self) -> None:
        with self._lock:
            doomed, self._deletable = self._deletable, []
            for key in doomed:
                self._withdrawn_at.pop(key, None)
        if doomed:
            self.withdrawn_then_deleted += self._delete([self._entry_id(k) for k in doomed])

    def _delete(self, entry_ids: list[str]) -> int:
        report = self.store.delete_released(entry_ids)
        self.evicted_entries += report.entries
        self.evicted_bytes += report.bytes
        return report.entries

    def state(self) -> dict:
        """Diagnostics: epoch, what is held and what waits for an acknowledgement."""
        with self._lock:
            return {"epoch": self._inv.epoch, "held": self._inv.held_count,
                    "awaiting_ack": self._inv.awaiting,
                    "withdrawn_then_deleted": self.withdrawn_then_deleted,
                    "evicted_entries": self.evicted_entries, "dropped": self.dropped,
                    "max_bytes": self.store.max_bytes}
