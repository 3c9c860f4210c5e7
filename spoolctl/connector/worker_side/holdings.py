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

Several drives (``for_drives``, decision 2714): one inventory for the rank, a store per
drive under it. Each drive has its own held set (a rescan of a drive replaces its set),
and the rank holds a key when some drive that is ``up`` holds it; ``drives_changed()``
after a drive went down or came back recomputes that union (a key held only on a down
drive is withdrawn from the scheduler's view, and restated when the drive is back).
``committed(key, drive)`` and ``lost(key, drive)`` name the drive; ``locate(key)`` is the
up drive to read a key from (the first in the key's ``ranked`` order that holds it).
Capacity is per drive: a victim another up drive also holds is deleted at once (the rank's
inventory does not change), one held nowhere else is withdrawn first as above, and the
acknowledged delete happens on the drive it was withdrawn from. One store (the
constructor) is a set of one drive ``""``, always up: today's behaviour.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from spoolctl.errors import BusyError, SpoolError
from spoolctl.store import Store, entry_id_for

from ..deployment import drives as drive_rules
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
        # Several drives (``for_drives``): drive id -> its rank store, and whether it is up
        # (one store: drive "", always up).
        self._stores: dict[str, Store] = {"": store}
        self._up: Callable[[str], bool] = lambda drive: True
        self._on: dict[str, set[bytes]] = {"": set()}  # what each drive holds
        self._withdrawn_on: dict[bytes, str] = {}  # a withdrawal's drive (its delete's)
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
        self._scan_adds: dict[str, set[bytes]] | None = None  # commits during a rescan
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.evicted_entries = 0
        self.evicted_bytes = 0
        self.withdrawn_then_deleted = 0  # deletions that waited for the scheduler's ack
        self.dropped = 0  # entries withdrawn because another rank withdrew them

    @classmethod
    def for_drives(cls, stores: Mapping[str, Store], up: Callable[[str], bool], *,
                   kind: str, namespace: str, rank: int, epoch: int, **kw) -> RankHoldings:
        """One inventory over a rank's stores on several drives (the module docstring):
        ``stores`` maps drive id -> rank store (ordered as configured), ``up(drive)`` says
        whether a drive serves (its ``DiskGuard``, memory only)."""
        first = next(iter(stores.values()))
        holdings = cls(first, kind=kind, namespace=namespace, rank=rank, epoch=epoch, **kw)
        holdings._stores = dict(stores)
        holdings._up = up
        holdings._on = {drive: set() for drive in stores}
        return holdings

    @property
    def epoch(self) -> int:
        return self._inv.epoch

    @property
    def several(self) -> bool:
        return len(self._stores) > 1

    def drive_ids(self) -> list[str]:
        """The drives this inventory covers, in configured order ("" for one store)."""
        return list(self._stores)

    def _union(self) -> set[bytes]:
        """With the lock held: what the rank holds (every up drive's keys)."""
        held: set[bytes] = set()
        for drive, keys in self._on.items():
            if self._up(drive):
                held |= keys
        return held

    def _elsewhere(self, raw: bytes, drive: str) -> bool:
        """With the lock held: another up drive holds ``raw`` too."""
        return any(d != drive and raw in keys and self._up(d) for d, keys in self._on.items())

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

    def committed(self, key: str, drive: str = "") -> None:
        raw = key_bytes(key)
        with self._lock:
            self._on[drive].add(raw)
            self._inv.add(raw)
            self._withdrawn_at.pop(raw, None)
            self._withdrawn_on.pop(raw, None)
            if self._scan_adds is not None:
                self._scan_adds.setdefault(drive, set()).add(raw)
        if self._stores[drive].max_bytes is not None:
            self._wake.set()  # the thread checks capacity

    def lost(self, key: str, drive: str | None = None) -> None:
        """A chunk disappeared or failed to read: on ``drive`` only (several drives; the rank
        still holds it while another up drive does), or everywhere (None)."""
        raw = key_bytes(key)
        with self._lock:
            for d, keys in self._on.items():
                if drive is None or d == drive:
                    keys.discard(raw)
            if drive is None or not self._elsewhere(raw, drive):
                self._inv.lost(raw)

    def locate(self, key: str, *, or_down: bool = False) -> str | None:
        """The up drive to read ``key`` from: the first of its ``ranked`` order that holds it
        (memory only); None when no up drive does. ``or_down``: then a drive that is down
        and holds it, if one does (a restore then fails ``disk_down``, not ``absent``: the
        operator's reason for a chunk whose only copy is on a drive taken out)."""
        raw = key_bytes(key)
        with self._lock:
            holders = [d for d, keys in self._on.items() if raw in keys and self._up(d)]
            if not holders and or_down:
                holders = [d for d, keys in self._on.items() if raw in keys]
        if len(holders) <= 1:
            return holders[0] if holders else None
        return drive_rules.ranked(key, holders)[0]

    def drives_changed(self) -> None:
        """A drive went down or came back (its guard's flag changed): the rank holds what
        its up drives hold, so keys held only on a down drive are withdrawn from the
        scheduler's view, and a drive that is back restates what it held (its keeper's next
        rescan corrects the set if it changed meanwhile)."""
        with self._lock:
            self._inv.replace(self._union())
        self._wake.set()

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
        """Re-read the stores' inventories (catches deletions made behind our back); a
        drive that is down is not read (its set stays as it was, out of the union)."""
        with self._lock:
            self._scan_adds = {}
        try:
            found: dict[str, set[bytes]] = {}
            for drive, store in self._stores.items():
                if not self._up(drive):
                    continue
                held = set()
                for key in store.live_keys(self.kind, self.namespace):
                    with contextlib.suppress(ValueError):
                        held.add(key_bytes(key))
                found[drive] = held
        except BaseException:
            with self._lock:
                self._scan_adds = None
            raise
        with self._lock:
            adds, self._scan_adds = self._scan_adds or {}, None
            for drive, held in found.items():
                self._on[drive] = held | adds.get(drive, set())
            self._inv.replace(self._union())

    def _entry_id(self, raw: bytes) -> str:
        return entry_id_for(self.kind, self.namespace, raw.hex())

    def _apply_share(self) -> None:
        """Record the effective max size (``min(spoolctl_max_size, share)``) in each store
        (several drives: the share bounds the rank's store on every drive)."""
        with self._lock:
            share = self._share
        if share is None:
            return
        bound = effective_max(self._per_rank_max, share)
        for drive, store in self._stores.items():
            if bound != store.max_bytes and self._up(drive):
                store.set_max_bytes(bound)

    def _drop_requested(self) -> None:
        with self._lock:
            keys, self._drops = self._drops, []
            on = {d: [k for k in keys if k in held] for d, held in self._on.items()}
        if not keys:
            return
        if not self.several:
            (only,) = self._stores
            self.dropped += self._withdraw([self._entry_id(k) for k in keys], only)
            return
        for drive, held in on.items():  # from every drive holding it
            if held and self._up(drive):
                self.dropped += self._withdraw([self._entry_id(k) for k in held], drive)

    def _enforce_capacity(self) -> None:
        for drive, store in self._stores.items():  # each drive evicts on itself only
            if not self._up(drive) or store.max_bytes is None or \
                    store.totals().bytes <= store.max_bytes:
                continue
            plan = store.enforce_capacity(dry_run=True, budget=EVICTION_BUDGET, wait=False)
            self._withdraw(plan.entry_ids, drive)

    def _withdraw(self, entry_ids: Iterable[str], drive: str = "") -> int:
        """Withdraw entries of ``drive``'s store (release them, report their removal) and
        delete those the scheduler cannot count on; the rest are deleted once
        acknowledged. A copy another up drive also holds is deleted at once: the rank
        still holds the key. Returns how many were withdrawn."""
        store = self._stores[drive]
        now: list[str] = []
        expired = withdrawn = 0
        for entry_id in entry_ids:
            row = store.row(entry_id)
            if row is None:
                continue
            wait = False
            if row.kind == self.kind and row.namespace == self.namespace:
                with contextlib.suppress(ValueError), self._lock:
                    raw = key_bytes(row.key)
                    self._on[drive].discard(raw)
                    if self._elsewhere(raw, drive):
                        wait = False  # another copy serves: the inventory does not change
                    else:
                        wait = self._inv.withdraw(raw)
                        since = self._withdrawn_at.setdefault(raw, self._clock())
                        if wait and self._clock() - since >= self.ack_timeout_s:
                            self._inv.expire(raw)  # bounded disk beats a perfect withdrawal
                            wait = False
                            expired += 1
                        if not wait:
                            self._withdrawn_at.pop(raw, None)
                            self._withdrawn_on.pop(raw, None)
                        else:
                            self._withdrawn_on[raw] = drive  # its delete's drive
            store.release(entry_id)
            withdrawn += 1
            if not wait:
                now.append(entry_id)
        if expired:
            log.warning("spoolctl: %d evicted chunks were never acknowledged by the scheduler "
                        "within %.0f s; deleted anyway (restores planned against them are "
                        "recomputed)", expired, self.ack_timeout_s)
        if now:
            self._delete(now, drive)
        return withdrawn

    def _delete_acknowledged(self) -> None:
        with self._lock:
            doomed, self._deletable = self._deletable, []
            on: dict[str, list[bytes]] = {}
            for key in doomed:
                self._withdrawn_at.pop(key, None)
                on.setdefault(self._withdrawn_on.pop(key, ""), []).append(key)
        for drive, keys in on.items():
            if drive in self._stores:
                self.withdrawn_then_deleted += self._delete(
                    [self._entry_id(k) for k in keys], drive)

    def _delete(self, entry_ids: list[str], drive: str = "") -> int:
        report = self._stores[drive].delete_released(entry_ids)
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
