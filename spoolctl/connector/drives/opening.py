"""A rank's stores on one or several drives, opened without ever waiting on a hung disk.

``DriveStores.open`` opens one rank store per drive root (``<base>/<deployment digest>/
rank-<NNNN>``). Each drive is opened on a daemon thread, all of them at
once, and waited for at most ``4 x`` the lookup deadline (the probe's bound):
``Store.open`` stats the store's directories and hangs on a hung disk, and a hung disk
must not keep the engine from starting. A drive that is late,
missing (several drives: its base directory does not exist, e.g. not mounted) or
unreadable (a base this user may not read, write and enter, or on a read-only
filesystem: the warning names the fix) is ``pending``: one warning line names it, and
it is tried again every probe interval, one attempt at a time. When it opens,
``on_open(slot)`` is called on the opening thread (never the engine's); a late attempt
that ends after ``close`` releases what it opened. The set's ``DrivePolicy`` (from the
number of roots) says what a configuration mistake found in time (a ``ConfigError``: a
directory that is not a store, another user's root) does: one root raises it; several
refuse that drive (one error line with the fix, not retried: the other drives serve).

One root is a set of one drive ``""``: no drive marker is written. With several roots each
drive is identified (``placement.drive_id``: a worker creates the marker, a reader only
reads it; a drive without one is pending until its worker marked it). Of two roots
carrying one drive id (a copied marker, a bind mount) the one listed later is not used:
one error line naming both marker files and the fix.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from spoolctl.errors import ConfigError, SpoolError
from spoolctl.store import MARKER, Store, TagKey

from . import placement as drives
from .policy import DrivePolicy
from .rankstores import OpenStores

log = logging.getLogger("spoolctl.connector")

PENDING, OPEN, REFUSED = "pending", "open", "refused"


@dataclass(eq=False)
class DriveSlot:
    """One drive of a rank: its base root as configured, the rank store's root under it,
    its drive id ("" for a single root, or until identified), the open store (None until
    ``state`` is ``open``) and, while pending or refused, why."""

    base: str
    root: str
    drive_id: str = ""
    store: Store | None = None
    state: str = PENDING
    why: str = ""


class _Attempt:
    """One opening of a slot on a daemon thread; ``future`` ends with (drive id, store)."""

    def __init__(self, slot: DriveSlot) -> None:
        self.slot = slot
        self.future: Future = Future()


class DriveStores:
    """See the module docstring. Thread-safe; ``slots`` keep the configured order."""

    def __init__(self, slots: list[DriveSlot], stores: OpenStores, *, create: bool,
                 max_bytes: int | None, tag_key: TagKey | None, bound_s: float,
                 probe_interval_s: float,
                 prepare: Callable[[Store], None] | None,
                 on_open: Callable[[DriveSlot], None] | None):
        self.slots = slots
        self.policy = DrivePolicy.for_roots(len(slots))
        self._stores = stores
        self._create, self._max_bytes, self._tag_key = create, max_bytes, tag_key
        self._bound_s, self._interval_s = bound_s, probe_interval_s
        self._prepare, self._on_open = prepare, on_open
        self._lock = threading.Lock()
        self._attempts: dict[int, _Attempt] = {}  # slot index -> the attempt in flight
        self._started = False  # ``open`` returned: late attempts settle themselves
        self._closed = threading.Event()
        self._retry: threading.Thread | None = None

    @classmethod
    def open(cls, roots: Sequence[tuple[str, str]], stores: OpenStores, *, create: bool,
             max_bytes: int | None = None, tag_key: TagKey | None = None,
             deadline_s: float, probe_interval_s: float,
             prepare: Callable[[Store], None] | None = None,
             on_open: Callable[[DriveSlot], None] | None = None) -> DriveStores:
        """Open ``roots`` (``(base, rank store root)`` per drive, in configured order),
        each bounded by ``4 x deadline_s``; see the module docstring. ``create``: a worker
        (creates stores and drive markers); a reader opens what exists. ``prepare(store)``
        runs on the opening thread after a store opened (its own small writes, e.g. the
        deployment's description), ``on_open(slot)`` for a drive that opens after this
        returned."""
        found = cls([DriveSlot(base, root) for base, root in roots], stores, create=create,
                    max_bytes=max_bytes, tag_key=tag_key, bound_s=4 * deadline_s,
                    probe_interval_s=probe_interval_s, prepare=prepare, on_open=on_open)
        attempts = [found._begin(i) for i in range(len(found.slots))]
        wait([a.future for a in attempts], timeout=found._bound_s)
        with found._lock:
            found._started = True
            done = [a for a in attempts if a.future.done()]
        first_error = done[0].future.exception() if done else None
        if not found.policy.mistakes_refused and isinstance(first_error, ConfigError):
            # A configuration mistake (a directory that is not a store, another user's
            # root) refuses the start; only a late or failing disk makes the store pending.
            raise first_error
        for attempt in done:  # in configured order: of two equal drive ids, the first wins
            found._settle(attempt, late=False)
        with found._lock:
            for i, slot in enumerate(found.slots):
                if i in found._attempts and slot.state == PENDING and not slot.why:
                    slot.why = f"no answer within {found._bound_s:g} s"
                    found._warn_pending(slot)
            found._start_retry()
        return found

    # -- what is open --------------------------------------------------------------------------

    def opened(self) -> list[DriveSlot]:
        """The open drives, in configured order."""
        with self._lock:
            return [s for s in self.slots if s.state == OPEN]

    def pending(self) -> list[DriveSlot]:
        with self._lock:
            return [s for s in self.slots if s.state == PENDING]

    def close(self) -> None:
        """Stop retrying and release every open store (a late attempt releases its own)."""
        self._closed.set()
        with self._lock:
            held = [s.store for s in self.slots if s.store is not None]
            for slot in self.slots:
                slot.store = None
        for store in held:
            self._stores.release(store)

    # -- opening -------------------------------------------------------------------------------

    def _begin(self, index: int) -> _Attempt:
        slot = self.slots[index]
        attempt = self._attempts[index] = _Attempt(slot)

        def body() -> None:
            try:
                result: Any = self._open_one(slot)
                error: BaseException | None = None
            except BaseException as exc:
                result, error = None, exc
            with self._lock:
                late = self._started
                if error is not None:
                    attempt.future.set_exception(error)
                else:
                    attempt.future.set_result(result)
            if late:
                self._settle(attempt, late=True)

        threading.Thread(target=body, name="spoolctl-drive-open", daemon=True).start()
        return attempt

    def _open_one(self, slot: DriveSlot) -> tuple[str, Store]:
        """On the attempt's thread: identify the drive and open its rank store."""
        if os.path.lexists(os.path.join(slot.base, MARKER)):
            raise _Refused(f"{slot.base} is a single store (it holds {MARKER}), not a base "
                           "directory; set the connector's root to a directory of its own")
        drive = ""
        if self.policy.identify:
            if not os.path.isdir(slot.base):
                if os.path.lexists(slot.base):  # a file: no mount makes it a directory
                    raise _Refused(f"{slot.base} is not a directory; list a drive's "
                                   "directory (its mount point) in spoolctl_roots")
                raise FileNotFoundError(f"{slot.base} does not exist (not mounted?)")
            _check_access(slot.base, write=self._create)
            found = drives.drive_id(slot.base) if self._create \
                else drives.read_drive_id(slot.base)
            if found is None:
                raise FileNotFoundError(f"{slot.base} has no drive id yet")
            drive = found
        store = self._stores.acquire(slot.root, create=self._create,
                                     max_bytes=self._max_bytes, tag_key=self._tag_key)
        try:
            if self._prepare is not None:
                self._prepare(store)
        except BaseException:
            self._stores.release(store)
            raise
        return drive, store

    def _settle(self, attempt: _Attempt, *, late: bool) -> None:
        """Take an ended attempt's result into its slot (or release what it opened)."""
        slot = attempt.slot
        error = attempt.future.exception()
        release: Store | None = None
        opened = False
        with self._lock:
            index = self.slots.index(slot)
            if self._attempts.get(index) is attempt:
                del self._attempts[index]
            if error is None:
                drive, store = attempt.future.result()
                twin = next((s for s in self.slots if s is not slot and s.state == OPEN
                             and drive and s.drive_id == drive), None)
                if self._closed.is_set():
                    release = store
                elif twin is not None:
                    release, slot.state = store, REFUSED
                    slot.why = f"same drive id as {twin.base}"
                    log.error("spoolctl: %s and %s carry one drive id (a copied marker or a "
                              "bind mount); %s is not used: remove %s and restart (that "
                              "drive then gets a new id)", os.path.join(twin.base,
                                                                        drives.MARKER),
                              os.path.join(slot.base, drives.MARKER), slot.base,
                              os.path.join(slot.base, drives.MARKER))
                else:
                    slot.drive_id, slot.store, slot.state, slot.why = drive, store, OPEN, ""
                    opened = True
            elif self._closed.is_set():
                pass  # a late attempt after close: nothing to say
            elif isinstance(error, _Refused):
                slot.state, slot.why = REFUSED, str(error)
                log.error("spoolctl: drive root not used: %s", error)
            elif isinstance(error, ConfigError) and self.policy.mistakes_refused:
                # A mistake, not a disk (a root through a symlink, e.g. a drive listed twice,
                # a damaged marker): retrying cannot mend it, and the other drives serve.
                slot.state, slot.why = REFUSED, str(error)
                log.error("spoolctl: drive root %s not used until the engine restarts: %s",
                          slot.base, error)
            elif isinstance(error, (OSError, SpoolError)):
                why = getattr(error, "message", None) or str(error)
                if why != slot.why:
                    slot.why = why
                    self._warn_pending(slot)
        if release is not None:
            self._stores.release(release)
        if opened and late:
            log.warning("spoolctl: drive root %s answers; its rank store is in use: %s",
                        slot.base, slot.root)
            if self._on_open is not None:
                self._on_open(slot)
        if error is not None and not isinstance(error, (OSError, SpoolError, _Refused)):
            log.error("spoolctl: opening %s failed: %r", slot.root, error)

    def _warn_pending(self, slot: DriveSlot) -> None:
        log.warning("spoolctl: rank store %s not open (%s); serving without it (misses) and "
                    "trying again every %g s", slot.root, slot.why, self._interval_s)

    def _start_retry(self) -> None:
        """With the lock held: the retry thread, while some drive is pending."""
        if self._retry is not None or not any(s.state == PENDING for s in self.slots):
            return
        self._retry = threading.Thread(target=self._retry_loop, name="spoolctl-drive-retry",
                                       daemon=True)
        self._retry.start()

    def _retry_loop(self) -> None:
        while not self._closed.wait(self._interval_s):
            with self._lock:
                waiting = [i for i, s in enumerate(self.slots) if s.state == PENDING]
                if not waiting:
                    self._retry = None
                    return
                for i in waiting:
                    if i not in self._attempts:  # one attempt at a time per drive
                        self._begin(i)


def _check_access(base: str, *, write: bool) -> None:
    """PermissionError naming ``base`` and the fix when this user cannot use it (a drive
    left ``chmod 000``, owned by another user): said before its marker is read, whose own
    refusal would suggest removing the marker (a new drive id: its chunks lost)."""
    need = os.R_OK | os.X_OK | (os.W_OK if write else 0)
    if not os.access(base, need):
        if write and os.access(base, os.R_OK | os.X_OK) and \
                os.statvfs(base).f_flag & os.ST_RDONLY:
            raise PermissionError(f"{base} is on a read-only filesystem; remount it "
                                  "read-write, or remove it from spoolctl_roots")
        what = "read, write and search" if write else "read and search"
        raise PermissionError(f"{base}: permission denied for uid {os.geteuid()}; give that "
                              f"user {what} permission on it (chown or chmod)")


class _Refused(Exception):
    """A drive root that must not be used (not retried)."""
