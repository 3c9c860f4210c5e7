"""Which rank store a running engine took out, said beside it: ``out-of-service-rank-NNNN.json``.

A worker's ``DiskGuard`` takes a drive's rank store out of service when its reads or commits
stop answering (decisions 2700, 2770); the engine's metrics say so (``spoolctl_drive_down``),
but an operator running ``spoolctl status`` on the host may not scrape them. So the worker
records it in the deployment directory of that drive, beside the rank store (like the write
ledger, decision 2710; the store's own format is untouched): the reason, when, and which
process (pid, host, the process's start time). The record is removed when the guard's probe
brings the store back, at the worker's shutdown, and, for a record a previous engine left,
when a worker opens that rank store again. For people only: nothing decides from it.

Writes run on a daemon thread, one at a time per record, the latest state winning: the drive
being recorded is the sick one, so a write may hang or fail (then one warning, and ``status``
shows that drive by its own bounded read, decision 2701: down when it does not answer). A
record outlives a process killed without its exit path; ``status`` calls it ``stale`` when it
names a process of this host that is gone (its pid absent, or reused: the start time differs),
and cannot tell for a record written on another host (a shared mount): ``stale`` is None then.
"""

from __future__ import annotations

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
    stale = None
    if doc["host"] == socket.gethostname():
        stale = process_started(doc["pid"]) != doc["started"] if doc["started"] else \
            not _exists(doc["pid"])  # written without /proc: the pid alone
    return {**doc, "stale": stale}


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
                    self._path.unlink(missing_ok=True)
                else:
                    self._put(*wanted)
            except Exception as exc:  # only people read it: serving is unaffected
                log.warning("spoolctl: could not record the drive's state in %s: %s",
                            self._path, getattr(exc, "message", exc))
            with self._lock:
                self._done = wanted

    def _put(self, reason: str, since: float) -> None:
        where = self._path.parent
        if not stat.S_ISDIR(os.lstat(where).st_mode):
            return
        pid = os.getpid()
        doc = {"schema": SCHEMA, "since": since, "reason": reason, "pid": pid,
               "host": socket.gethostname(), "started": process_started(pid) or 0}
        tmp, _, _ = write_tmp(where, [json.dumps(doc, sort_keys=True).encode() + b"\n"])
        os.replace(tmp, self._path)  # no fsync: a crash makes it stale anyway


__all__ = ["DescriptionError", "OutOfServiceRecorder", "process_started", "read",
           "record_path"]
