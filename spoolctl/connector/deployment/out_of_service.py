"""Which rank store a running engine took out, said beside it: ``out-of-service-rank-NNNN.json``.

A worker whose ``DiskGuard`` takes a drive's rank store out of service records it in that
drive's deployment directory (the reason, when, and which process), so ``spoolctl status``
shows it without scraping metrics. The record is removed when the store comes back, at the
worker's shutdown, and when a later worker opens that rank store again. For people only:
nothing decides from it.

Writes run on a daemon thread, one at a time per record, the latest state winning (the
drive being recorded may hang; then one warning).

Liveness is judged by an ``flock`` on ``out-of-service-rank-NNNN.lock``, held by the
writer from before it writes the record until after it removes it: the kernel drops it
when the process dies, whatever PID namespace or host name it had. A record whose lock is
free is ``stale``. A record without a lock file (an older spoolctl) is judged by pid and
start time on the host and PID namespace that wrote it, ``stale`` None elsewhere.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

from spoolctl.store import write_tmp

from .description import DescriptionError, read_record

log = logging.getLogger("spoolctl.connector")

PREFIX = "out-of-service-"
SCHEMA = "spoolctl-out-of-service/v1"
_FIELDS: dict[str, tuple[type, ...]] = {
    "since": (int, float), "reason": (str,), "pid": (int,), "host": (str,),
    "started": (int,),
}


def record_path(store_root: str | Path) -> Path:
    """Where the record of the rank store at ``store_root`` (``.../<deployment>/rank-NNNN``)
    lives: beside it, in the deployment directory."""
    root = Path(store_root)
    return root.parent / f"{PREFIX}{root.name}.json"


def lock_path(store_root: str | Path) -> Path:
    """The file whose ``flock`` the record's writer holds while its record exists."""
    return record_path(store_root).with_suffix(".lock")


def pid_namespace() -> str | None:
    """This process's PID namespace (``pid:[N]``), None without ``/proc``."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def holder_alive(store_root: str | Path) -> bool | None:
    """Whether the writer of the record of ``store_root`` still runs: True when its lock is
    held, False when it is free, None when there is no lock file (an older writer) or it
    cannot be tried (another user's file)."""
    return _lock_held(lock_path(store_root))


def _lock_held(path: Path) -> bool | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            return None
        return False  # closing the descriptor drops the lock at once
    finally:
        os.close(fd)


def process_started(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc``), None when
    there is no such process or no ``/proc``. With the pid it names one process for good."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        # the command name (field 2) may hold spaces and parentheses: split after its end
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def read(store_root: str | Path) -> dict[str, Any] | None:
    """The record of the rank store at ``store_root`` with ``stale`` (True: its process is
    gone; None: written on another host, cannot tell), None when there is none;
    ``DescriptionError`` when it is unreadable or malformed."""
    path = record_path(store_root)
    doc = read_record(path, SCHEMA, _FIELDS, "an out-of-service record",
                      "the engine removes it when the drive answers again; delete it if "
                      "no engine runs")
    if doc is None:
        return None
    alive = holder_alive(store_root)
    stale = None if alive is None else not alive
    if alive is None and doc["host"] == socket.gethostname() and \
            _same_pid_namespace(path):
        stale = process_started(doc["pid"]) != doc["started"] if doc["started"] else \
            not _exists(doc["pid"])  # written without /proc: the pid alone
    return {**doc, "stale": stale}


def _same_pid_namespace(path: Path) -> bool:
    """Whether the record at ``path`` names a pid of this process's PID namespace (a record
    that does not say, from an older writer, is taken to)."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    written = doc.get("pid_ns") if isinstance(doc, dict) else None
    return not isinstance(written, str) or written == pid_namespace()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


class OutOfServiceRecorder:
    """Keeps the record of one rank store in line with its guard (``update(down, reason)``,
    called from the guard's listener). Never blocks its caller: the file is written or
    removed on a daemon thread."""

    def __init__(self, store_root: str | Path) -> None:
        self._path = record_path(store_root)
        self._lock_path = lock_path(store_root)
        self._held: int | None = None  # the lock file's descriptor while a record exists
        self._lock = threading.Lock()
        self._wanted: tuple[str, float] | None = None  # (reason, since) or None: no record
        self._done: object = object()  # what is on the disk (unknown at first)
        self._busy = False
        self._idle = threading.Event()
        self._idle.set()

    def wait(self, timeout: float) -> bool:
        """Wait until the disk says the latest state (tests, shutdown); False on timeout."""
        return self._idle.wait(timeout)

    def update(self, down: bool, reason: str | None = None) -> None:
        """The store was taken out (``down``, why) or is in service: say so soon."""
        with self._lock:
            self._wanted = (reason or "taken out", time.time()) if down else None
            if self._busy:
                return  # the running writer picks the latest state up
            self._busy = True
            self._idle.clear()
        threading.Thread(target=self._write, daemon=True, name="spoolctl-out-of-service").start()

    def _write(self) -> None:
        while True:
            with self._lock:
                wanted = self._wanted
                if wanted == self._done:
                    self._busy = False
                    self._idle.set()
                    return
            try:
                if wanted is None:
                    self._remove()
                else:
                    self._hold()
                    self._put(*wanted)
            except Exception as exc:  # only people read it: serving is unaffected
                log.warning("spoolctl: could not record the drive's state in %s: %s",
                            self._path, getattr(exc, "message", exc))
            with self._lock:
                self._done = wanted

    def _hold(self) -> None:
        """Take the record's lock before the record exists (held until it is removed)."""
        while self._held is None:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            try:
                # a reader holds it for an instant only; a previous engine's lock died with it
                fcntl.flock(fd, fcntl.LOCK_EX)
                # a holder that removed its record unlinked this file meanwhile: a new one
                if os.fstat(fd).st_ino == os.lstat(self._lock_path).st_ino:
                    self._held, fd = fd, -1
            except FileNotFoundError:
                pass
            finally:
                if fd >= 0:
                    os.close(fd)

    def _remove(self) -> None:
        """No record: this process's own goes with its lock file (while still held), then
        the lock; another process's goes only when its lock says that process is gone (a
        live engine of another container keeps its record)."""
        if self._held is None and _lock_held(self._lock_path) is True:
            return
        self._path.unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self._lock_path.unlink()
        if self._held is not None:
            os.close(self._held)
            self._held = None

    def _put(self, reason: str, since: float) -> None:
        where = self._path.parent
        if not stat.S_ISDIR(os.lstat(where).st_mode):
            return
        pid = os.getpid()
        doc = {"schema": SCHEMA, "since": since, "reason": reason, "pid": pid,
               "host": socket.gethostname(), "started": process_started(pid) or 0,
               "pid_ns": pid_namespace()}
        tmp, _, _ = write_tmp(where, [json.dumps(doc, sort_keys=True).encode() + b"\n"])
        os.replace(tmp, self._path)  # no fsync: a crash makes it stale anyway


__all__ = ["DescriptionError", "OutOfServiceRecorder", "holder_alive", "lock_path",
           "process_started", "read", "record_path"]
