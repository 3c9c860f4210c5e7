"""A worker's view of its rank's stores: inventory reports and withdraw-then-delete eviction.

``RankHoldings`` wraps the pure ``inventory.RankInventory`` with the store I/O it needs. It
learns what the stores hold from a catalog scan at start, from the connector (a chunk
committed, a chunk that failed to read) and from periodic rescans. Capacity is enforced
here: an entry other ranks' plans may count on is withdrawn (reported, released in the
catalog) and deleted once the scheduler acknowledged the withdrawal, or after
``ack_timeout_s`` without one. The scheduler's ``drops`` (another rank withdrew a chunk)
and host budget share arrive through ``on_scheduler``.

One inventory covers every drive of the rank (``for_drives``; one store is a set of one
drive ``""``): each drive has its own held set and keeper thread (``upkeep``), the rank
holds a key some ``up`` drive holds, ``locate(key)`` names the drive to read it from, and a
duplicate left on a runner-up is released once it has been redundant for
``duplicate_grace_s``, never the last up copy. The set's ``DrivePolicy`` says how a drive's
health and bookkeeping count. Methods called from the engine loop only take a lock and
touch memory; ``stop()`` waits for the keepers within ``stop_bound_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

from spoolctl.errors import BusyError, SpoolError
from spoolctl.store import Store

from ..drives import placement as drive_rules
from ..drives.policy import ONE_ROOT, SEVERAL, DrivePolicy
from ..planning.inventory import (
    HANDSHAKE_MAX_KEYS,
    STEP_MAX_KEYS,
    Ack,
    InventoryReport,
    RankInventory,
    key_bytes,
    resync_for,
)
from .upkeep import EVICTION_BUDGET, HoldingsUpkeep, Keeper

log = logging.getLogger("spoolctl.connector")

RESCAN_S = 10.0
ACK_TIMEOUT_S = 300.0
STOP_BOUND_S = 5.0  # stop() waits this long for every keeper together
START_SCAN_S = 5.0  # keepers scanning at start: start() waits this long for them together
# Past a restore's read deadline, so a read that located a redundant copy has ended.
DUPLICATE_GRACE_S = 30.0

__all__ = ["EVICTION_BUDGET", "RankHoldings"]


class RankHoldings(HoldingsUpkeep):
    """See the module docstring. ``start()`` scans the stores and starts the keepers;
    ``stop()`` ends them (bounded)."""

    def __init__(self, store: Store, *, kind: str, namespace: str, rank: int, epoch: int,
                 rescan_s: float = RESCAN_S, ack_timeout_s: float = ACK_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic,
                 per_rank_max: int | None = None, share: int | None = None,
                 stop_bound_s: float = STOP_BOUND_S, start_scan_s: float = START_SCAN_S,
                 duplicate_grace_s: float = DUPLICATE_GRACE_S,
                 policy: DrivePolicy = ONE_ROOT):
        """``per_rank_max``: ``spoolctl_max_size``; ``share``: this rank's host budget share
        until the scheduler sends one (None: no host budget); ``policy``: the drive set's
        rules (one store: ``ONE_ROOT``)."""
        self.store = store
        self._policy = policy
        # Several drives (``for_drives``): drive id -> its rank store, and whether it is up
        # (one store: drive "", always up).
        self._stores: dict[str, Store] = {"": store}
        self._up: Callable[[str], bool] = lambda drive: True
        self._on: dict[str, set[bytes]] = {"": set()}  # what each drive holds
        self._keepers: dict[str, Keeper] = {"": Keeper("")}
        self._bases: dict[str, str] = {}  # drive id -> its base root, when known
        self._withdrawn_on: dict[bytes, str] = {}  # a withdrawal's drive (its delete's)
        self.kind = kind
        self.namespace = namespace
        self.rank = rank
        self.rescan_s = rescan_s
        self.ack_timeout_s = ack_timeout_s
        self.stop_bound_s = stop_bound_s
        self.start_scan_s = start_scan_s
        self.duplicate_grace_s = duplicate_grace_s
        self._clock = clock
        self._withdrawn_at: dict[bytes, float] = {}
        self._inv = RankInventory(rank, epoch)
        self._lock = threading.Lock()
        self._per_rank_max = per_rank_max
        self._share = share  # the host budget share to apply (None: no host budget)
        self._scanning: dict[str, set[bytes]] = {}  # a drive being rescanned -> its commits
        self._moves = 0  # bumped when a key may have become held twice (twins to look for)
        self._stop = threading.Event()
        self._started = False
        self.evicted_entries = 0
        self.evicted_bytes = 0
        self.withdrawn_then_deleted = 0  # deletions that waited for the scheduler's ack
        self.dropped = 0  # entries withdrawn because another rank withdrew them
        self.duplicates_released = 0  # redundant copies deleted (several drives)
        self.duplicate_bytes_released = 0

    @classmethod
    def for_drives(cls, stores: Mapping[str, Store], up: Callable[[str], bool], *,
                   kind: str, namespace: str, rank: int, epoch: int,
                   bases: Mapping[str, str] | None = None, policy: DrivePolicy = SEVERAL,
                   **kw) -> RankHoldings:
        """One inventory over a rank's stores on several drives (the module docstring):
        ``stores`` maps drive id -> rank store (ordered as configured), ``up(drive)`` says
        whether a drive serves (its ``DiskGuard``, memory only), ``bases`` each drive's
        base root (shown by ``state()``)."""
        first = next(iter(stores.values()))
        holdings = cls(first, kind=kind, namespace=namespace, rank=rank, epoch=epoch,
                       policy=policy, **kw)
        holdings._stores = dict(stores)
        holdings._up = up
        holdings._on = {drive: set() for drive in stores}
        holdings._keepers = {drive: Keeper(drive) for drive in stores}
        holdings._bases = dict(bases or {})
        return holdings

    @property
    def epoch(self) -> int:
        return self._inv.epoch

    @property
    def stores(self) -> dict[str, Store]:
        """Drive id -> its rank store (a copy)."""
        with self._lock:
            return dict(self._stores)

    def keeper_threads(self) -> dict[str, threading.Thread | None]:
        """Drive id -> its keeper thread (None before ``start``)."""
        with self._lock:
            return {d: k.thread for d, k in self._keepers.items()}

    def wake(self, drive: str) -> None:
        """Have ``drive``'s keeper run its next round now."""
        with self._lock:
            keeper = self._keepers.get(drive)
        if keeper is not None:
            keeper.wake.set()

    def drive_ids(self) -> list[str]:
        """The drives this inventory covers, in configured order ("" for one store)."""
        with self._lock:
            return list(self._stores)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Apply the host budget share, scan the stores (so the handshake carries the
        inventory), then start the keepers. One store: on the calling thread, as always.
        Several drives: each keeper scans its drive first and this waits for the scans
        within ``start_scan_s`` together; a drive that has not answered by then is left to
        its keeper (its chunks count once its scan ends, through the step reports)."""
        on_keepers = self._policy.keepers_scan_at_start
        if not on_keepers:
            self.apply_share()
            self.rescan()
        with self._lock:
            self._started = True
            keepers = list(self._keepers.values())
        for keeper in keepers:
            self._spawn(keeper, first_scan=on_keepers)
        if not on_keepers:
            return
        end = time.monotonic() + self.start_scan_s
        for keeper in keepers:
            if not keeper.scanned.wait(max(0.0, end - time.monotonic())):
                log.warning("spoolctl: drive %s did not answer its inventory scan within "
                            "%g s; its chunks count once it does",
                            self._bases.get(keeper.drive, keeper.drive), self.start_scan_s)

    def _spawn(self, keeper: Keeper, *, first_scan: bool) -> None:
        name = "spoolctl-holdings" if not keeper.drive else f"spoolctl-keeper-{keeper.drive[:8]}"
        keeper.thread = threading.Thread(target=self._keep, args=(keeper, first_scan),
                                         name=name, daemon=True)
        keeper.thread.start()

    def stop(self) -> None:
        """End the keepers, waiting for them within ``stop_bound_s`` together: a keeper
        stuck on a hung drive is a daemon and is left behind (it ends when the disk answers,
        and does nothing more)."""
        self._stop.set()
        with self._lock:
            keepers = list(self._keepers.values())
        for keeper in keepers:
            keeper.wake.set()
        end = time.monotonic() + self.stop_bound_s
        for keeper in keepers:
            if keeper.thread is not None:
                keeper.thread.join(timeout=max(0.0, end - time.monotonic()))
                keeper.thread = None

    # -- engine-loop side (memory only) --------------------------------------------------------

    def committed(self, key: str, drive: str = "") -> None:
        raw = key_bytes(key)
        with self._lock:
            self._on[drive].add(raw)
            self._inv.add(raw)
            self._withdrawn_at.pop(raw, None)
            self._withdrawn_on.pop(raw, None)
            if self._elsewhere(raw, drive):
                self._moves += 1
            adds = self._scanning.get(drive)
            if adds is not None:
                adds.add(raw)
        if self._stores[drive].max_bytes is not None:
            self._keepers[drive].wake.set()  # its keeper checks capacity

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
        scheduler's view, and a drive that is back restates what it held (its keeper
        rescans it at once). Which copy restores read may have changed, so every
        redundant copy starts its grace again."""
        with self._lock:
            self._inv.replace(self._union())
            self._moves += 1
            keepers = list(self._keepers.values())
            for keeper in keepers:
                keeper.redundant.clear()
        for keeper in keepers:
            keeper.wake.set()

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
        chunks every rank should drop and this rank's host budget share; each drive's
        part goes to that drive's keeper."""
        ack = acks.get(self.rank)
        woken: set[str] = set()
        with self._lock:
            if resync_for(resync, self.rank, self._inv.epoch):
                self._inv.resync()
            for key in self._inv.acked(ack) if ack is not None else []:
                self._withdrawn_at.pop(key, None)
                drive = self._withdrawn_on.pop(key, "")
                if drive in self._keepers:  # deleted on the drive it was withdrawn from
                    self._keepers[drive].deletable.append(key)
                    woken.add(drive)
            held = [k for k in drops if self._inv.holds(k)]
            if held:  # from every drive holding it
                for drive, keys in self._on.items():
                    mine = [k for k in held if k in keys]
                    if mine:
                        self._keepers[drive].drops.extend(mine)
                        woken.add(drive)
            if share is not None and self._share is not None and share != self._share:
                self._share = share
                woken.update(self._keepers)
            keepers = [self._keepers[d] for d in woken]
        for keeper in keepers:
            keeper.wake.set()

    @property
    def awaiting(self) -> int:
        with self._lock:
            return self._inv.awaiting

    def held_keys(self) -> set[str]:
        with self._lock:
            return {k.hex() for k in self._inv.held}

    # -- keepers (store I/O, one thread per drive) ------------------------------------------

    def _keep(self, keeper: Keeper, first_scan: bool) -> None:
        drive = keeper.drive
        if first_scan:
            self._step(keeper, self.apply_share)
            self._step(keeper, self.rescan)
            keeper.scanned.set()
        scanned = self._clock()
        while not self._stop.is_set():
            keeper.wake.wait(max(0.0, scanned + self.rescan_s - self._clock()))
            keeper.wake.clear()
            if self._stop.is_set():
                return
            up = self._up(drive)
            back, keeper.was_up = up and not keeper.was_up, up
            # A rescan every rescan_s even when commits keep waking the keeper (a busy store
            # must still notice deletions made behind its back, e.g. ``spoolctl clean``),
            # and at once when the drive is back.
            due = back or self._clock() - scanned >= self.rescan_s
            if due:
                scanned = self._clock()
            steps = (self.apply_share, self.delete_acknowledged, self.drop_requested)
            for step in (*steps, self.rescan, self.enforce_capacity) if due \
                    else (*steps, self.enforce_capacity):
                if self._stop.is_set():
                    return
                self._step(keeper, step)

    def _step(self, keeper: Keeper, step: Callable[[str], object]) -> None:
        keeper.busy_since = time.monotonic()
        try:
            step(keeper.drive)
        except BusyError:
            pass  # maintenance elsewhere; next round
        except Exception as exc:  # never let bookkeeping take the worker down
            log.warning("spoolctl: inventory step failed: %s",
                        exc.message if isinstance(exc, SpoolError) else exc)
        finally:
            keeper.busy_since = None

    def stuck_keepers(self, bound_s: float) -> list[tuple[str, Callable[[], bool]]]:
        """The drives whose keeper has been in one store step for longer than ``bound_s``
        (a drive that hangs under its bookkeeping only), each once per step: ``(drive,
        still)``, ``still()`` True while that same step runs. Memory only (the engine
        thread, every step)."""
        now = time.monotonic()
        stuck: list[tuple[str, Callable[[], bool]]] = []
        for keeper in list(self._keepers.values()):
            since = keeper.busy_since
            if since is None or now - since <= bound_s or keeper.stuck_told == since:
                continue
            keeper.stuck_told = since
            stuck.append((keeper.drive, partial(_still_busy, keeper, since)))
        return stuck

    def state(self) -> dict:
        """Diagnostics (memory only): epoch, what is held and what waits for an
        acknowledgement. Several drives also: ``duplicates_released`` and ``drives``, per
        drive its id, base and root, whether it is up, the keys it holds, its bytes at its
        keeper's last pass (None before one), its max size, its evictions, its released
        duplicates and ``busy_s`` (how long its keeper has been in one store step: a drive
        that hangs shows it growing); ``max_bytes`` is then the sum of the drives' (None
        when one is unbounded)."""
        with self._lock:
            out: dict[str, Any] = {"epoch": self._inv.epoch, "held": self._inv.held_count,
                   "awaiting_ack": self._inv.awaiting,
                   "withdrawn_then_deleted": self.withdrawn_then_deleted,
                   "evicted_entries": self.evicted_entries, "dropped": self.dropped,
                   "max_bytes": self.store.max_bytes}
            if not self._policy.per_drive_bookkeeping:
                return out
            now = time.monotonic()
            drives = []
            for drive, store in self._stores.items():
                keeper = self._keepers[drive]
                busy = keeper.busy_since
                drives.append({
                    "drive": drive, "base": self._bases.get(drive), "root": str(store.root),
                    "up": self._up(drive), "held": len(self._on[drive]),
                    "bytes": keeper.bytes, "max_bytes": store.max_bytes,
                    "evicted_entries": keeper.evicted_entries,
                    "duplicates_released": keeper.duplicates_released,
                    "busy_s": None if busy is None else round(now - busy, 3)})
            bounds = [d["max_bytes"] for d in drives]
            out["max_bytes"] = None if None in bounds else sum(bounds)
            out["duplicates_released"] = self.duplicates_released
            out["drives"] = drives
            return out

    def add_drive(self, drive: str, store: Store, base: str | None = None) -> None:
        """A drive that opened after start joins the set: its keeper scans it on its own
        thread, after which its keys count in the union and in ``locate``. Memory only on
        the caller's thread; a drive already in the set is left as it is. ``base``: its
        configured root, for log lines and ``state()``."""
        keeper = Keeper(drive)
        with self._lock:
            if drive in self._stores:
                return
            if base is not None:
                self._bases[drive] = base
            self._stores[drive] = store
            self._on[drive] = set()
            self._keepers[drive] = keeper
            started = self._started and not self._stop.is_set()
        if started:
            self._spawn(keeper, first_scan=True)


def _still_busy(keeper: Keeper, since: float) -> bool:
    """``keeper`` is still in the store step that began at ``since``."""
    return keeper.busy_since == since
