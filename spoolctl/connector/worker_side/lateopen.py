"""Drives that open after the worker started: built off the engine thread, taken into use
on it.

The rank's first store to open after ``register_kv_caches`` gets the rank's parts built on
its opening thread (at an epoch above the handshake's, so the scheduler replaces what it
was told); a drive opening once parts exist is equipped there and joins them at the
engine thread's next hook. Everything built after ``close`` is closed at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..drives.driveset import Drive, DriveSet
from ..drives.opening import DriveSlot

if TYPE_CHECKING:
    from ..kv.formats import Copier
    from ..kv.kvio import CopyEngine
    from ..stats import ConnectorCounters
    from ..vllm_api.introspect import Deployment
    from .rankparts import RankBuilder, RankParts

log = logging.getLogger("spoolctl.connector")


class LateOpeningHost(Protocol):
    """What late opening reads of its worker (``WorkerSide``)."""

    @property
    def deployment(self) -> Deployment: ...
    @property
    def copier(self) -> Copier: ...
    @property
    def counters(self) -> ConnectorCounters: ...
    @property
    def drives(self) -> DriveSet: ...
    @property
    def enabled(self) -> bool: ...
    def engine(self) -> CopyEngine | None: ...
    def lost(self, key: str, drive: str | None = None) -> None: ...


class LateOpening:
    """The late-opening state of one ``WorkerSide`` (see the module docstring)."""

    def __init__(self, worker: LateOpeningHost) -> None:
        self._worker = worker
        self._lock = threading.Lock()
        self.bound = False  # the copier is bound: parts can be built
        self._closed = False
        self._started = False  # the rank's parts are built or being built
        self._epoch = 0  # the handshake's epoch while no store was open
        self._ready: RankParts | None = None
        self._joining: list[Drive] = []
        self._changed = False  # a drive joined: the scheduler must hear of the set
        self._builder: RankBuilder | None = None

    def builder(self) -> RankBuilder:
        from .rankparts import RankBuilder

        if self._builder is None:
            w = self._worker
            self._builder = RankBuilder(w.deployment, w.copier, w.counters, w.drives,
                                        engine=w.engine, on_lost=w.lost)
        return self._builder

    def bind(self) -> bool:
        """The copier is bound; True when the caller builds the rank's parts now (a store
        is open), False when the first store to open will."""
        with self._lock:
            self.bound = True
            if self._worker.drives.primary is None:
                return False
            self._started = True
            return True

    def pending_epoch(self, now: int) -> int:
        """The epoch the handshake announced while no store was open (``now`` the first
        time)."""
        with self._lock:
            if self._epoch == 0:
                self._epoch = now
            return self._epoch

    def opened(self, slot: DriveSlot) -> None:
        """On a drive's opening thread: build the rank's parts, or equip a joiner."""
        with self._lock:
            if self._closed or not self.bound or not self._worker.enabled:
                return  # register_kv_caches equips what is open then
            first, self._started = not self._started, True
            floor = self._epoch
        if first:
            self._build(slot, floor)
        else:
            self._equip_joiner(slot)

    def _build(self, slot: DriveSlot, floor: int) -> None:
        drives = self._worker.drives
        try:
            parts = self.builder().build(drives.equip_open(), floor)
        except Exception as exc:  # e.g. the disk failed again at once: stay cold, say so
            log.warning("spoolctl: rank store %s opened but cannot be used (%s); serving "
                        "without it until the engine restarts", slot.root,
                        getattr(exc, "message", exc))
            return
        with self._lock:
            if not self._closed:
                self._ready = parts
                return
        parts.close()  # shut down meanwhile

    def _equip_joiner(self, slot: DriveSlot) -> None:
        drives = self._worker.drives
        if not drives.claim(slot):
            return  # equipped with the others
        assert slot.store is not None
        try:
            drive = drives.equip_claimed(slot)
            self.builder().initial_share(slot.store)  # its host budget record, as at start
        except Exception as exc:  # e.g. the disk failed again at once: its runner-ups serve
            log.warning("spoolctl: drive %s opened but cannot be used (%s); its chunks stay "
                        "on their runner-ups until the engine restarts", slot.base,
                        getattr(exc, "message", exc))
            return
        with self._lock:
            if not self._closed:
                self._joining.append(drive)
                return
        drive.close()  # shut down meanwhile

    def take_ready(self) -> RankParts | None:
        """Engine thread: parts built for a store that opened late, once."""
        if self._ready is None:
            return None
        with self._lock:
            parts, self._ready = self._ready, None
        return parts

    def join_waiting(self, join: Callable[[Drive], None]) -> None:
        """Engine thread: the drives equipped since take part in the running parts."""
        if not self._joining:
            return
        with self._lock:
            joining, self._joining = self._joining, []
        for drive in joining:
            join(drive)
            log.warning("spoolctl: drive %s opened after the engine started; it joins the "
                        "set: its chunks are written to it and read from it from now on",
                        drive.base)
        if joining:
            self._changed = True  # the next step report names the drives

    def take_changed(self) -> bool:
        changed, self._changed = self._changed, False
        return changed

    def close(self) -> RankParts | None:
        """No more building; the parts built and never installed (for the caller to
        close). Equipped drives are the set's to close."""
        with self._lock:
            self._closed = True
            ready, self._ready = self._ready, None
            self._joining = []
        return ready
