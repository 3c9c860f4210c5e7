"""Drives a same-host rank took into its set after its handshake, opened for the scheduler.

A worker on several drives takes a drive that was missing or hung at start into its set
when the drive answers and names the rank's drives again in its next step
output (``SpoolWorkerMeta.drives``). For a rank whose catalogs it reads, the scheduler
opens the new drive's rank store here: read-only and bounded (``DriveStores.open(create=
False)``, as ``SchedulerSide._adopt_local`` does at the handshake), on a daemon thread per
drive, so vLLM's engine loop never waits on that disk. A drive that does not open in time
is retried by its ``DriveStores`` (every probe interval, one attempt at a time); one that
cannot be opened yet for another reason (no store there yet) is tried again every probe
interval by its thread. The engine loop collects what opened with ``take`` (memory only)
and owns those stores from then on; ``close`` releases the rest.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from spoolctl.errors import SpoolError
from spoolctl.store import Store, TagKey

from ..drives.opening import DriveSlot, DriveStores
from ..drives.rankstores import OpenStores
from ..planning.messages import DriveInfo

log = logging.getLogger("spoolctl.connector")


@dataclass(eq=False)
class _Join:
    """One drive being opened for ``rank``; ``drives`` once its opening returned."""

    rank: int
    info: DriveInfo
    drives: DriveStores | None = None
    taken: bool = False  # its store was handed to the engine loop (which releases it)


class LateDrives:
    """See the module docstring. ``want`` and ``take`` run on the scheduler's thread."""

    def __init__(self, stores: OpenStores, *, tag_key: TagKey | None, deadline_s: float,
                 probe_interval_s: float):
        self._stores, self._tag_key = stores, tag_key
        self._deadline_s, self._interval_s = deadline_s, probe_interval_s
        self._lock = threading.Lock()
        self._joins: dict[tuple[int, str], _Join] = {}
        self._ready: list[tuple[_Join, Store]] = []
        self._stop = threading.Event()

    def want(self, rank: int, info: DriveInfo) -> None:
        """Start opening ``info``'s rank store for ``rank`` (once per drive); returns at
        once."""
        key = (rank, os.path.normpath(info.root))
        with self._lock:
            if self._stop.is_set() or key in self._joins:
                return
            join = self._joins[key] = _Join(rank, info)
        threading.Thread(target=self._open, args=(join,), name="spoolctl-drive-join",
                         daemon=True).start()

    def take(self) -> list[tuple[int, DriveInfo, Store]]:
        """The drives opened since the last call, as (rank, drive, store); the caller owns
        each store (checks its id, reads it or releases it). Memory only."""
        with self._lock:
            ready, self._ready = self._ready, []
            for join, _ in ready:
                join.taken = True
        return [(join.rank, join.info, store) for join, store in ready]

    def close(self) -> None:
        """Stop every opening and retry; release what opened but was not taken."""
        self._stop.set()
        with self._lock:
            joins = [j for j in self._joins.values() if not j.taken and j.drives is not None]
            self._ready = []
        for join in joins:
            join.drives.close()  # type: ignore[union-attr]

    # -- the opening threads ---------------------------------------------------------------------

    def _open(self, join: _Join) -> None:
        said = ""
        while not self._stop.is_set():
            try:
                found = DriveStores.open(
                    [(join.info.base, join.info.root)], self._stores, create=False,
                    tag_key=self._tag_key, deadline_s=self._deadline_s,
                    probe_interval_s=self._interval_s,
                    on_open=lambda slot: self._opened(join, slot))
            except SpoolError as exc:  # found in time, e.g. no store there yet
                if exc.message != said:
                    said = exc.message
                    log.warning("spoolctl: rank %d drive %s not readable here yet (%s); "
                                "trying again every %g s", join.rank, join.info.base,
                                exc.message, self._interval_s)
                if self._stop.wait(self._interval_s):
                    return
                continue
            with self._lock:
                join.drives = found
                stopped = self._stop.is_set()
            if stopped:
                found.close()
                return
            (slot,) = found.slots
            if slot.store is not None:
                self._opened(join, slot)
            return  # pending: its DriveStores retries it and calls ``_opened``

    def _opened(self, join: _Join, slot: DriveSlot) -> None:
        with self._lock:
            if not self._stop.is_set() and slot.store is not None:
                self._ready.append((join, slot.store))
