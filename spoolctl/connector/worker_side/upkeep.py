"""The store side of a rank's inventory: each drive's keeper and the steps it runs.

``HoldingsUpkeep`` is the part of ``RankHoldings`` that does store I/O on a keeper thread:
capacity (withdraw, then delete once acknowledged), the scheduler's drops, the host budget
share, rescans and the release of redundant copies. Called by a keeper with its drive, or with None
(every drive) by a caller outside the keepers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping

from spoolctl.store import Store, entry_id_for

from ..deployment.host_budget import effective_max
from ..drives import placement as drive_rules
from ..drives.policy import DrivePolicy
from ..planning.inventory import RankInventory, key_bytes

log = logging.getLogger("spoolctl.connector")

EVICTION_BUDGET = 1024


class Keeper:
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


class HoldingsUpkeep:
    """Keeper-side steps of ``RankHoldings`` (the fields below are its own)."""

    kind: str
    namespace: str
    ack_timeout_s: float
    duplicate_grace_s: float
    evicted_entries: int
    evicted_bytes: int
    withdrawn_then_deleted: int
    dropped: int
    duplicates_released: int
    duplicate_bytes_released: int
    _lock: threading.Lock
    _policy: DrivePolicy
    _stores: dict[str, Store]
    _up: Callable[[str], bool]
    _on: dict[str, set[bytes]]
    _keepers: dict[str, Keeper]
    _bases: dict[str, str]
    _withdrawn_at: dict[bytes, float]
    _withdrawn_on: dict[bytes, str]
    _inv: RankInventory
    _clock: Callable[[], float]
    _share: int | None
    _per_rank_max: int | None
    _moves: int
    _scanning: dict[str, set[bytes]]

    def _elsewhere(self, raw: bytes, drive: str) -> bool:
        """With the lock held: another up drive holds ``raw`` too."""
        return any(d != drive and raw in keys and self._up(d) for d, keys in self._on.items())

    def _union(self) -> set[bytes]:
        """With the lock held: what the rank holds (every up drive's keys)."""
        held: set[bytes] = set()
        for drive, keys in self._on.items():
            if self._up(drive):
                held |= keys
        return held

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
            # Per drive, the union is rebuilt only when this drive's set changed (the union
            # of 1M keys costs ~0.4 s under the lock).
            per_drive = self._policy.per_drive_bookkeeping
            if not per_drive or held != self._on[drive]:
                self._on[drive] = held
                self._inv.replace(self._union())
                self._moves += 1
            twins = self._twins(drive) if per_drive else None
        if per_drive:  # for state(); one store reads only what it always did
            self._keepers[drive].bytes = store.totals().bytes
        if twins is not None:
            self._release_redundant(drive, twins)

    def _which(self, drive: str | None) -> list[str]:
        """``drive``, or every drive (None: a caller outside the keepers, e.g. a test)."""
        if drive is not None:
            return [drive]
        with self._lock:
            return list(self._stores)


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

    def apply_share(self, drive: str | None = None) -> None:
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

    def drop_requested(self, drive: str | None = None) -> None:
        for d in self._which(drive):
            keeper = self._keepers[d]
            with self._lock:
                keys, keeper.drops = keeper.drops, []
            if not keys:
                continue
            if not self._up(d):
                continue  # a down drive's copies are out of the union already
            n = self.withdraw([self._entry_id(k) for k in keys], d)
            with self._lock:
                self.dropped += n

    def enforce_capacity(self, drive: str | None = None) -> None:
        for d in self._which(drive):  # each drive evicts on itself only
            store = self._stores[d]
            if not self._up(d) or store.max_bytes is None:
                continue
            total = self._keepers[d].bytes = store.totals().bytes
            if total <= store.max_bytes:
                continue
            plan = store.enforce_capacity(dry_run=True, budget=EVICTION_BUDGET, wait=False)
            self.withdraw(plan.entry_ids, d)
            if self._policy.per_drive_bookkeeping:
                self._keepers[d].bytes = store.totals().bytes

    def withdraw(self, entry_ids: Iterable[str], drive: str = "") -> int:
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

    def delete_acknowledged(self, drive: str | None = None) -> None:
        for d in self._which(drive):
            if not self._up(d):
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

