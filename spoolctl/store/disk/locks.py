"""Inter-process locks on one store (``flock(2)``: POSIX hosts, where the store lives).

* ``maintenance.lock``: commits take it shared, anything that deletes exclusive, so a
  deletion never races a commit still publishing and a commit never revives an entry
  being deleted.
* ``owner.lock``: the owner lease a live worker holds for its whole life (``owner.json``
  names it); it dies with the process.

Each acquisition opens its own file description, so threads exclude each other like
processes. Lock files are opened only as regular files under real directories.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ...errors import BusyError, StoreIOError
from .fsio import FILE_MODE, ensure_real_dirs, io_error, open_regular, read_small, write_tmp

_POLL = 0.01
# flock's "someone else holds it" answers; any other error is the disk's or the kernel's
_HELD_ERRNOS = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES})


def _try_lock(fh: IO[bytes], exclusive: bool) -> bool:
    """``flock`` without waiting: True if taken, False if another holder has it."""
    try:
        fcntl.flock(fh.fileno(), (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _HELD_ERRNOS:
            return False
        raise
    return True


def _unlock(fh: IO[bytes]) -> None:
    fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _open_lock_file(path: Path) -> IO[bytes]:
    try:
        ensure_real_dirs(path.parent.parent, path.parent)
        fd = open_regular(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    except OSError as exc:
        raise io_error(exc, "opening a lock file", path) from exc
    return os.fdopen(fd, "r+b")


def _open_lock_file_read_only(path: Path) -> IO[bytes] | None:
    """The lock file opened for reading only (flock works on it), or None if it does not
    exist: a read-only store process creates nothing."""
    try:
        ensure_real_dirs(path.parent.parent, path.parent)
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise io_error(exc, "opening a lock file", path) from exc
    return os.fdopen(fd, "rb")


def _acquire(path: Path, exclusive: bool, timeout: float | None) -> IO[bytes] | None:
    """Take a lock on ``path``; None timeout = wait forever, 0 = try once. A lock the
    filesystem cannot give (ENOLCK on some network mounts) is a StoreIOError, not "busy"."""
    fh = _open_lock_file(path)
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = _POLL
    while True:
        try:
            taken = _try_lock(fh, exclusive)
        except OSError as exc:
            fh.close()
            raise io_error(exc, "locking", path) from exc
        if taken:
            return fh
        if deadline is not None and time.monotonic() >= deadline:
            fh.close()
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


@contextlib.contextmanager
def hold(path: Path, *, exclusive: bool, timeout: float | None, what: str) -> Iterator[None]:
    """Hold the lock at ``path`` for the block, or raise BusyError after ``timeout``."""
    fh = _acquire(path, exclusive, timeout)
    if fh is None:
        raise BusyError(
            f"{what}: the store is busy (lock held by another process)",
            path=path,
            fix="retry later; `spoolctl status` shows the owner if a worker holds it",
        )
    try:
        yield
    finally:
        try:
            _unlock(fh)
        finally:
            fh.close()


@contextlib.contextmanager
def try_hold(path: Path, *, exclusive: bool) -> Iterator[bool]:
    """Like ``hold`` with no waiting; yields whether the lock was taken."""
    fh = _acquire(path, exclusive, 0)
    try:
        yield fh is not None
    finally:
        if fh is not None:
            _unlock(fh)
            fh.close()


def _release(*handles: IO[bytes] | None) -> None:
    """Unlock and close each lock file handle that is not None."""
    for handle in handles:
        if handle is not None:
            try:
                _unlock(handle)
            finally:
                handle.close()


def _busy(what: str, path: Path) -> BusyError:
    return BusyError(
        f"{what}: the store is busy (lock held by another process)",
        path=path,
        fix="retry later; `spoolctl status` shows the owner if a worker holds it",
    )


@contextlib.contextmanager
def hold_gated(
    path: Path, gate: Path, *, exclusive: bool, timeout: float | None, what: str
) -> Iterator[None]:
    """The maintenance lock with writer preference; BusyError after ``timeout``.

    flock has no fairness, so everyone passes a turnstile first: shared takers hold ``gate``
    only while they take ``path``, exclusive takers for their whole critical section.
    """
    deadline = None if timeout is None else time.monotonic() + timeout

    def left() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    gate_fh = _acquire(gate, exclusive, timeout)
    if gate_fh is None:
        raise _busy(what, path)
    fh = None
    try:
        fh = _acquire(path, exclusive, left())
        if not exclusive:  # through the turnstile: let a waiting deleter in
            _release(gate_fh)
            gate_fh = None
        if fh is None:
            raise _busy(what, path)
        yield
    finally:
        _release(fh, gate_fh)


@contextlib.contextmanager
def try_hold_gated(path: Path, gate: Path) -> Iterator[bool]:
    """Exclusive ``hold_gated`` with no waiting; yields whether it was taken."""
    gate_fh = _acquire(gate, True, 0)
    fh = _acquire(path, True, 0) if gate_fh is not None else None
    try:
        yield fh is not None
    finally:
        _release(fh, gate_fh)


@dataclass(frozen=True)
class OwnerInfo:
    """Who holds the owner lease."""

    pid: int
    host: str
    role: str
    since: float

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "host": self.host, "role": self.role, "since": self.since}


class OwnerLease:
    """The exclusive owner lease of a store, held until ``release()`` or process exit."""

    def __init__(self, lock_path: Path, info_path: Path, role: str):
        self._lock_path = lock_path
        self._info_path = info_path
        self.info = OwnerInfo(os.getpid(), socket.gethostname(), role, time.time())
        self._fh: IO[bytes] | None = None

    def try_acquire(self) -> bool:
        fh = _acquire(self._lock_path, True, 0)
        if fh is None:
            return False
        self._fh = fh
        try:
            # a unique temp file (O_EXCL|O_NOFOLLOW, 0600), never a predictable name
            tmp, _, _ = write_tmp(self._info_path.parent,
                                  [json.dumps(self.info.to_json()).encode()])
            os.replace(tmp, self._info_path)
        except (OSError, StoreIOError):
            # who holds the lease is advisory; the lock itself is the lease
            pass
        return True

    @property
    def held(self) -> bool:
        return self._fh is not None

    def release(self) -> None:
        if self._fh is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self._info_path)
        _unlock(self._fh)
        self._fh.close()
        self._fh = None


def read_owner(lock_path: Path, info_path: Path) -> OwnerInfo | None:
    """The live owner, or None (a lease whose process died is not reported). Creates
    nothing."""
    fh = _open_lock_file_read_only(lock_path)
    if fh is None:
        return None
    try:
        try:
            free = _try_lock(fh, exclusive=False)
        except OSError:
            free = False  # cannot tell: report what owner.json says, as for a live owner
        if free:
            _unlock(fh)
            return None
    finally:
        fh.close()
    try:
        doc = json.loads(read_small(info_path, 1 << 16))
        return OwnerInfo(int(doc["pid"]), str(doc["host"])[:255], str(doc["role"])[:64],
                         float(doc["since"]))
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return OwnerInfo(pid=0, host="?", role="unknown", since=0.0)
