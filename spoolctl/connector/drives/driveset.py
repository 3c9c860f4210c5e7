"""A rank's drives as one set: each drive's parts, its health, routing and late joiners.

``DriveSet`` opens the rank store on every configured root (``opening.DriveStores``,
bounded: a hung or missing drive is pending and tried again). ``equip`` gives an open
drive its parts (``Drive``: its ``DiskGuard`` shared with a same-process scheduler, a read
pool, the write ledger, the background maintainer and the out-of-service record beside
the store); the worker takes equipped drives into use (``use``). What the worker asks of
the set: ``route`` (which drive a chunk is written to), ``up`` (a drive's health),
``inventory_up`` (whether the rank's inventory counts a drive, per the set's
``DrivePolicy``), ``guard_of`` and ``down_flags``. One root is a set of one drive ``""``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spoolctl.store import Store, TagKey

from ..deployment.out_of_service import OutOfServiceRecorder
from ..diskguard import DiskGuard, guard_for
from . import placement
from .opening import DriveSlot, DriveStores
from .policy import DrivePolicy
from .rankstores import OpenStores

if TYPE_CHECKING:
    from spoolctl.store import BackgroundMaintainer

    from ..deployment.write_budget import WriteLedger

log = logging.getLogger("spoolctl.connector")

# Threads reading and verifying restores (and refreshing gauges), per drive.
READ_THREADS = 4


@dataclass(eq=False)
class Drive:
    """One open drive of the rank and its parts (``DriveSet.equip``)."""

    slot: DriveSlot
    store: Store
    guard: DiskGuard
    pool: ThreadPoolExecutor
    recorder: OutOfServiceRecorder
    ledger: WriteLedger | None = None
    maintainer: BackgroundMaintainer | None = None
    closed: bool = False

    @property
    def id(self) -> str:
        return self.slot.drive_id

    @property
    def base(self) -> str:
        return self.slot.base

    def close(self) -> None:
        """Stop this drive's threads (once); a read stuck on a hung disk does not hold it."""
        if self.closed:
            return
        self.closed = True
        if self.ledger is not None:  # the exact count (a crash leaves at most a slab more)
            self.ledger.close()
        if self.maintainer is not None:
            with contextlib.suppress(Exception):
                self.maintainer.stop()
        # Queued reads are dropped, running ones end on their own.
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.guard.close()
        self.recorder.update(False)  # this engine no longer has it out


@dataclass(frozen=True)
class DriveTools:
    """How the set equips a drive: the guard's deadlines and the optional parts."""

    lookup_deadline_s: float
    probe_interval_s: float
    ledger: Callable[[Store], WriteLedger | None]
    maintainer: Callable[[Store], BackgroundMaintainer | None]


class DriveSet:
    """See the module docstring. Thread-safe, except ``use``: the engine thread's."""

    def __init__(self, roots: Sequence[tuple[str, str]], stores: OpenStores, *,
                 tools: DriveTools, max_bytes: int | None, tag_key: TagKey | None,
                 prepare: Callable[[Store], None] | None = None,
                 on_open: Callable[[DriveSlot], None] | None = None):
        """Open ``roots`` (``(base, rank store root)`` per drive, configured order) for a
        worker; ``on_open(slot)`` runs on the opening thread of a drive that opens late."""
        self._tools = tools
        self._on_open = on_open
        self._lock = threading.Lock()
        self._equipped: dict[int, Drive | None] = {}  # slot index -> its parts (None: failed)
        self._in_use: dict[str, Drive] = {}
        self._primary: Store | None = None
        self._closed = False
        self.stores = DriveStores.open(
            roots, stores, create=True, max_bytes=max_bytes, tag_key=tag_key,
            deadline_s=tools.lookup_deadline_s, probe_interval_s=tools.probe_interval_s,
            prepare=prepare, on_open=self._opened)
        self.policy: DrivePolicy = self.stores.policy
        with self._lock:
            if self._primary is None:
                opened = self.stores.opened()
                self._primary = opened[0].store if opened else None

    def _opened(self, slot: DriveSlot) -> None:
        with self._lock:
            if self._primary is None:
                self._primary = slot.store
        if self._on_open is not None:
            self._on_open(slot)

    # -- what is open --------------------------------------------------------------------------

    @property
    def slots(self) -> list[DriveSlot]:
        return self.stores.slots

    @property
    def primary(self) -> Store | None:
        """The rank's first open store (its root and id name the rank in the handshake)."""
        with self._lock:
            return self._primary

    def pending(self) -> list[DriveSlot]:
        return self.stores.pending()

    # -- equipping and use -------------------------------------------------------------------

    def equip_open(self) -> list[Drive]:
        """Equip every open drive not equipped yet (each once), in configured order."""
        opened = self.stores.opened()
        with self._lock:
            todo = [(self.slots.index(s), s) for s in opened]
            todo = [(i, s) for i, s in todo if i not in self._equipped]
            for i, _ in todo:
                self._equipped[i] = None
        return [self._keep(i, self._equip(i, slot)) for i, slot in todo]

    def claim(self, slot: DriveSlot) -> bool:
        """Reserve ``slot`` for equipping by its caller (False: equipped or being so)."""
        index = self.slots.index(slot)
        with self._lock:
            if index in self._equipped:
                return False
            self._equipped[index] = None
            return True

    def equip_claimed(self, slot: DriveSlot) -> Drive:
        """Equip a slot ``claim`` reserved (raises what equipping raised)."""
        index = self.slots.index(slot)
        return self._keep(index, self._equip(index, slot))

    def _keep(self, index: int, drive: Drive) -> Drive:
        """Record ``drive`` as equipped; after ``close`` it is closed at once."""
        with self._lock:
            closed = self._closed
            if not closed:
                self._equipped[index] = drive
        if closed:
            drive.close()
        return drive

    def _equip(self, index: int, slot: DriveSlot) -> Drive:
        store = slot.store
        assert store is not None
        tools = self._tools
        guard = guard_for(store, deadline_s=tools.lookup_deadline_s,
                          probe_interval_s=tools.probe_interval_s)
        pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix=f"spoolctl-restore-d{index}")
        drive = Drive(slot, store, guard, pool, _record_guard(store, guard))
        drive.ledger = tools.ledger(store)
        drive.maintainer = tools.maintainer(store)
        return drive

    def use(self, drive: Drive) -> None:
        """Count ``drive`` as one the worker's parts serve (engine thread)."""
        self._in_use = {**self._in_use, drive.id: drive}

    @property
    def in_use(self) -> list[Drive]:
        return list(self._in_use.values())

    def ids(self) -> list[str]:
        return list(self._in_use)

    # -- health and routing --------------------------------------------------------------------

    def guard_of(self, drive: str) -> DiskGuard | None:
        one = self._in_use.get(drive)
        return one.guard if one is not None else None

    def up(self, drive: str) -> bool:
        """``drive`` serves: in use and its guard has it in."""
        one = self._in_use.get(drive)
        return one is not None and not one.guard.down

    def any_up(self) -> bool:
        return any(not one.guard.down for one in self._in_use.values())

    def inventory_up(self, drive: str) -> bool:
        """Whether the rank's inventory counts what ``drive`` holds (memory only)."""
        if not self.policy.inventory_follows_health:
            return True
        one = self._in_use.get(drive)
        return one is None or not one.guard.down

    def route(self, key: str, avoid: Collection[str] = ()) -> tuple[str, str] | None:
        """``(drive written to, home)`` for chunk ``key``: the first drive of its ranking
        that is up and not in ``avoid`` (full drives); None when there is none."""
        ids = self.ids()
        drive = placement.route(key, ids, {d for d in ids if d not in avoid and self.up(d)})
        return (drive, placement.home(key, ids)) if drive is not None else None

    def down_flags(self) -> list[tuple[str, float]]:
        """Per configured drive (its base root): 1.0 while it does not serve (not open, not
        in use yet, or its guard has it out), else 0.0."""
        flags = []
        for slot in self.slots:
            one = self._in_use.get(slot.drive_id) if slot.store is not None else None
            flags.append((slot.base, 1.0 if one is None or one.guard.down else 0.0))
        return flags

    # -- closing -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every equipped drive's threads and release every open store."""
        with self._lock:
            self._closed = True
            drives = [d for d in self._equipped.values() if d is not None]
            self._equipped = {i: None for i in range(len(self.slots))}
        self._in_use = {}
        for drive in drives:
            drive.close()
        self.stores.close()  # the last user of a store closes it


def _record_guard(store: Store, guard: DiskGuard) -> OutOfServiceRecorder:
    """Say beside ``store`` when ``guard`` takes it out and brings it back, for ``spoolctl
    status``; a previous engine's record goes now."""
    recorder = OutOfServiceRecorder(store.root)
    guard.listen(lambda down: recorder.update(down, guard.reason))
    recorder.update(guard.down, guard.reason)
    return recorder
