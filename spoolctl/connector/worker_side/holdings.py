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

Store I/O runs on keeper threads (daemons), one per store, never on vLLM's engine loop;
the methods the connector calls from the engine loop only take a lock and touch memory.

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

Each drive has its own keeper (decision 2760): its rescans, share, capacity step,
acknowledged deletes and drops run on that drive's thread, so a drive whose I/O hangs
(before its guard takes it out, or unseen by the guard because only its keeper touches
it) stops only its own bookkeeping; the other drives keep evicting and deleting. The
inventory stays one, in memory, under one lock that no keeper holds across store I/O.
``stop()`` waits for the keepers together within ``stop_bound_s``; a keeper stuck in the
kernel is a daemon and is left behind.

Duplicates (decision 2760): a key written to a runner-up while its home was down is held
twice once the home is back. At each rescan of a drive, a copy there that another up drive
also holds and that is not the copy ``locate`` reads (the first of the key's ``ranked``
order among the up holders: the home when it is up) is released and deleted, once it has
been redundant for ``duplicate_grace_s`` (longer than a restore's read deadline, so a
restore that located it before the other copy counted has ended) — never the last up copy.
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
STOP_BOUND_S = 5.0  # stop() waits this long for every keeper together
START_SCAN_S = 5.0  # several drives: start() waits this long for the first scans together
# A redundant copy is deleted once it has not been the copy restores read for this long:
# well past a restore's read deadline (5 s by default, decision 2700), so a read that
# located it before the other copy counted has ended (the worker passes at least twice
# its configured read deadline).
DUPLICATE_GRACE_S = 30.0


class _Keeper:
    """One drive's bookkeeping thread and what waits for it. Fields other than ``thread``,
    ``wake`` and ``scanned`` are read and written under the holdings' lock (``busy_since``
    and ``bytes`` are single writes by the keeper, read for diagnostics)."""

    def __init__(self, drive: str) -> None:
        self.drive = drive
        self.wake = threading.Event()
        self.scanned = threading.Event()  # its first scan ended (several drives: start())
        self.thread: threading.Thread | None = None
        self.deletable: list[bytes] = []  # acknowledged withdrawals on this drive
        self.drops: list[bytes] = []  # chunks the scheduler asked every rank to drop
        self.redundant: dict[bytes, float] = {}  # duplicate copies here -> first seen
        self.busy_since: float | None = None  # monotonic start of the store step running
        self.stuck_told: float | None = None  # the step already told stuck (engine thread)
        self.bytes: int | None = None  # the store's bytes at its last pass
        self.looked = -1  # the holdings' ``_moves`` when it last looked for twins
        self.evicted_entries = 0
        self.duplicates_released = 0
        self.was_up = True


class RankHoldings:
    """See the module docstring. ``start()`` scans the stores and starts the keepers;
    ``stop()`` ends them (bounded)."""

    def __init__(self, store: Store, *, kind: str, namespace: str, rank: int, epoch: int,
                 rescan_s: float = RESCAN_S, ack_timeout_s: float = ACK_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic,
                 per_rank_max: int | None = None, share: int | None = None,
                 stop_bound_s: float = STOP_BOUND_S, start_scan_s: float = START_SCAN_S,
                 duplicate_grace_s: float = DUPLICATE_GRACE_S):
        """``per_rank_max``: ``spoolctl_max_size``; ``share``: this rank's host budget share
        until the scheduler sends one (None: no host budget)."""
        self.store = store
        # Several drives (``for_drives``): drive id -> its rank store, and whether it is up
        # (one store: drive "", always up).
        self._stores: dict[str, Store] = {"": store}
        self._up: Callable[[str], bool] = lambda drive: True
        self._on: dict[str, set[bytes]] = {"": set()}  # what each drive holds
        self._keepers: dict[str, _Keeper] = {"": _Keeper("")}
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
                   bases: Mapping[str, str] | None = None, **kw) -> RankHoldings:
        """One inventory over a rank's stores on several drives (the module docstring):
        ``stores`` maps drive id -> rank store (ordered as configured), ``up(drive)`` says
        whether a drive serves (its ``DiskGuard``, memory only), ``bases`` each drive's
        base root (shown by ``state()``)."""
        first = next(iter(stores.values()))
        holdings = cls(first, kind=kind, namespace=namespace, rank=rank, epoch=epoch, **kw)
        holdings._stores = dict(stores)
        holdings._up = up
        holdings._on = {drive: set() for drive in stores}
        holdings._keepers = {drive: _Keeper(drive) for drive in stores}
        holdings._bases = dict(bases or {})
        return holdings

    @property
    def epoch(self) -> int:
        return self._inv.epoch

    @property
    def several(self) -> bool:
        return len(self._stores) > 1

    def drive_ids(self) -> list[str]:
        """The drives this inventory covers, in configured order ("" for one store)."""
        with self._lock:
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
        """Apply the host budget share, scan the stores (so the handshake carries the
        inventory), then start the keepers. One store: on the calling thread, as always.
        Several drives: each keeper scans its drive first and this waits for the scans
        within ``start_scan_s`` together; a drive that has not answered by then is left to
        its keeper (its chunks count once its scan ends, through the step reports)."""
        if not self.several:
            self._apply_share()
            self.rescan()
        with self._lock:
            self._started = True
            keepers = list(self._keepers.values())
        for keeper in keepers:
            self._spawn(keeper, first_scan=self.several)
        if not self.several:
            return
        end = time.monotonic() + self.start_scan_s
        for keeper in keepers:
            if not keeper.scanned.wait(max(0.0, end - time.monotonic())):
                log.warning("spoolctl: drive %s did not answer its inventory scan within "
                            "%g s; its chunks count once it does",
                            self._bases.get(keeper.drive, keeper.drive), self.start_scan_s)

    def _spawn(self, keeper: _Keeper, *, first_scan: bool) -> None:
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
            if self.several and self._elsewhere(raw, drive):
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
            if held and not self.several:
                (only,) = self._keepers
                self._keepers[only].drops.extend(held)
                woken.add(only)
            elif held:  # from every drive holding it
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

    def _keep(self, keeper: _Keeper, first_scan: bool) -> None:
        drive = keeper.drive
        if first_scan:
            self._step(keeper, self._apply_share)
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
            steps = (self._apply_share, self._delete_acknowledged, self._drop_requested)
            for step in (*steps, self.rescan, self._enforce_capacity) if due \
                    else (*steps, self._enforce_capacity):
                if self._stop.is_set():
                    return
                self._step(keeper, step)

    def _step(self, keeper: _Keeper, step: Callable[[str], object]) -> None:
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
        thread, every step; decision 2790)."""
        now = time.monotonic()
        stuck = []
        for keeper in list(self._keepers.values()):
            since = keeper.busy_since
            if since is None or now - since <= bound_s or keeper.stuck_told == since:
                continue
            keeper.stuck_told = since
            stuck.append((keeper.drive, lambda k=keeper, t=since: k.busy_since == t))
        return stuck

    def _which(self, drive: str | None) -> list[str]:
        """``drive``, or every drive (None: a caller outside the keepers, e.g. a test)."""
        if drive is not None:
            return [drive]
        with self._lock:
            return list(self._stores)

    def rescan(self, drive: str | None = None) -> None:
        """Re-read ``drive``'s inventory (every drive's: None) to catch deletions made
        behind our back; a drive that is down is not read (its set stays as it was, out of
        the union). Several drives: then release the copies there that are redundant."""
        for d in self._which(drive):
            self._rescan_one(d)

    def _rescan_one(self, drive: str) -> None:
        if not self._up(drive):
            return
        store = self._stores[drive]
        with self._lock:
            self._scanning[drive] = set()
        try:
            held = set()
            for key in store.live_keys(self.kind, self.namespace):
                with contextlib.suppress(ValueError):
                    held.add(key_bytes(key))
        except BaseException:
            with self._lock:
                self._scanning.pop(drive, None)
            raise
        with self._lock:
            adds = self._scanning.pop(drive, set())
            held |= adds
            # Several drives: each keeper rescans, so the rank's union is rebuilt only when
            # this drive's set changed (the union of 1M keys costs ~0.4 s under the lock).
            if not self.several or held != self._on[drive]:
                self._on[drive] = held
                self._inv.replace(self._union())
                self._moves += 1
            twins = self._twins(drive) if self.several else None
        if self.several:  # for state(); one store reads only what it always did
            self._keepers[drive].bytes = store.totals().bytes
        if twins is not None:
            self._release_redundant(drive, twins)

    def _twins(self, drive: str) -> dict[bytes, list[str]] | None:
        """With the lock held: keys ``drive`` holds that another up drive holds too, each
        with its up holders (in configured order). Looked for only when a set changed since
        this drive's last look, or while copies here wait for their grace (else None)."""
        keeper = self._keepers[drive]
        if keeper.looked == self._moves and not keeper.redundant:
            return None
        keeper.looked = self._moves
        others = [keys for d, keys in self._on.items() if d != drive and self._up(d)]
        mine = self._on[drive]
        twins: set[bytes] = set()
        for keys in others:
            twins |= mine & keys
        return {raw: [d for d, keys in self._on.items() if raw in keys and self._up(d)]
                for raw in twins}

    def _release_redundant(self, drive: str, twins: Mapping[bytes, list[str]]) -> None:
        """Delete ``drive``'s copies of ``twins`` that restores do not read (``locate``'s
        choice is another drive) and that have been redundant for the grace period; the
        copy ``locate`` reads, and a last up copy, are never touched."""
        keeper = self._keepers[drive]
        spare = {raw for raw, holders in twins.items()
                 if drive_rules.ranked(raw.hex(), holders)[0] != drive}
        now = self._clock()
        with self._lock:
            keeper.redundant = {raw: keeper.redundant.get(raw, now) for raw in spare}
            due = [raw for raw, since in keeper.redundant.items()
                   if now - since >= self.duplicate_grace_s][:EVICTION_BUDGET]
        if not due:
            return
        store = self._stores[drive]
        doomed: list[str] = []
        for raw in due:
            with self._lock:
                if not self._elsewhere(raw, drive):  # the other copy went meanwhile
                    keeper.redundant.pop(raw, None)
                    continue
                self._on[drive].discard(raw)  # the rank still holds it: no report
                keeper.redundant.pop(raw, None)
            entry_id = self._entry_id(raw)
            if store.release(entry_id):
                doomed.append(entry_id)
        if not doomed:
            return
        report = store.delete_released(doomed)
        with self._lock:
            keeper.duplicates_released += report.entries
            self.duplicates_released += report.entries
            self.duplicate_bytes_released += report.bytes
        keeper.bytes = store.totals().bytes
        log.info("spoolctl: released %d redundant copies (%d bytes) on drive %s",
                 report.entries, report.bytes, self._bases.get(drive, drive))

    def _entry_id(self, raw: bytes) -> str:
        return entry_id_for(self.kind, self.namespace, raw.hex())

    def _apply_share(self, drive: str | None = None) -> None:
        """Record the effective max size (``min(spoolctl_max_size, share)``) in each store
        (several drives: the share bounds the rank's store on every drive)."""
        with self._lock:
            share = self._share
        if share is None:
            return
        bound = effective_max(self._per_rank_max, share)
        for d in self._which(drive):
            store = self._stores[d]
            if bound != store.max_bytes and self._up(d):
                store.set_max_bytes(bound)

    def _drop_requested(self, drive: str | None = None) -> None:
        for d in self._which(drive):
            keeper = self._keepers[d]
            with self._lock:
                keys, keeper.drops = keeper.drops, []
            if not keys:
                continue
            if self.several and not self._up(d):
                continue  # a down drive's copies are out of the union already
            n = self._withdraw([self._entry_id(k) for k in keys], d)
            with self._lock:
                self.dropped += n

    def _enforce_capacity(self, drive: str | None = None) -> None:
        for d in self._which(drive):  # each drive evicts on itself only
            store = self._stores[d]
            if not self._up(d) or store.max_bytes is None:
                continue
            total = self._keepers[d].bytes = store.totals().bytes
            if total <= store.max_bytes:
                continue
            plan = store.enforce_capacity(dry_run=True, budget=EVICTION_BUDGET, wait=False)
            self._withdraw(plan.entry_ids, d)
            if self.several:
                self._keepers[d].bytes = store.totals().bytes

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

    def _delete_acknowledged(self, drive: str | None = None) -> None:
        for d in self._which(drive):
            if self.several and not self._up(d):
                continue  # kept queued until the drive answers again
            keeper = self._keepers[d]
            with self._lock:
                keys, keeper.deletable = keeper.deletable, []
            if keys:
                n = self._delete([self._entry_id(k) for k in keys], d)
                with self._lock:
                    self.withdrawn_then_deleted += n

    def _delete(self, entry_ids: list[str], drive: str = "") -> int:
        report = self._stores[drive].delete_released(entry_ids)
        with self._lock:
            self.evicted_entries += report.entries
            self.evicted_bytes += report.bytes
            self._keepers[drive].evicted_entries += report.entries
        return report.entries

    def state(self) -> dict:
        """Diagnostics (memory only): epoch, what is held and what waits for an
        acknowledgement. Several drives also: ``duplicates_released`` and ``drives``, per
        drive its id, base and root, whether it is up, the keys it holds, its bytes at its
        keeper's last pass (None before one), its max size, its evictions, its released
        duplicates and ``busy_s`` (how long its keeper has been in one store step: a drive
        that hangs shows it growing); ``max_bytes`` is then the sum of the drives' (None
        when one is unbounded)."""
        with self._lock:
            out = {"epoch": self._inv.epoch, "held": self._inv.held_count,
                   "awaiting_ack": self._inv.awaiting,
                   "withdrawn_then_deleted": self.withdrawn_then_deleted,
                   "evicted_entries": self.evicted_entries, "dropped": self.dropped,
                   "max_bytes": self.store.max_bytes}
            if not self.several:
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
        keeper = _Keeper(drive)
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
