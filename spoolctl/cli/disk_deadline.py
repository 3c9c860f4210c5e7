"""How long an operator command waits for a store's disk.

Each store's work (opening it, reading its facts) runs in a forked child that hands back
its result and its stderr through a pipe, as JSON (nothing here unpickles bytes): a thread
stuck in the kernel on a hung mount can be neither stopped nor outlived. A store that sends
neither its answer nor a progress tick within ``SPOOLCTL_DISK_TIMEOUT`` seconds (default
10) raises ``DiskNotAnsweringError``; the child, holding none of the command's output
streams, ends when the disk answers
(docs/decisions/2701-hung-disk-under-the-controllers-and-the-cli.md).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import select
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from spoolctl import errors
from spoolctl.errors import ConfigError, DiskNotAnsweringError, SpoolError, StoreIOError
from spoolctl.store import install_progress_sink

ENV_DISK_TIMEOUT = "SPOOLCTL_DISK_TIMEOUT"
#: Far above a healthy store's slowest `status` (a catalog of 100k rows counts in well under
#: a second), far below what an operator waits for before assuming the command hangs.
DEFAULT_DISK_TIMEOUT_S = 10.0
# A read that keeps reporting progress may run this many deadlines in all: the disk answers.
SLOW_FACTOR = 6

T = TypeVar("T")


def disk_timeout() -> float:
    """The bound from ``SPOOLCTL_DISK_TIMEOUT`` (seconds), else the default."""
    raw = os.environ.get(ENV_DISK_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_DISK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ConfigError(f"{ENV_DISK_TIMEOUT}={raw!r} is not a positive number of seconds",
                          fix=f"set e.g. {ENV_DISK_TIMEOUT}=10, or unset it for the default")
    return value


def within_disk_timeout(root: str | Path, fn: Callable[[], T]) -> T:
    """``fn()`` (everything a command reads of the store at ``root``; its result must be
    JSON: dicts with string keys, lists, strings, numbers, booleans, None; a tuple comes
    back a list), run in a child process, or ``DiskNotAnsweringError`` if it has not
    returned within ``disk_timeout()``. A SpoolError ``fn`` raises is raised here as it was
    (its class by name from ``spoolctl.errors``); what it printed on stderr is printed
    here."""
    limit = disk_timeout()
    if not hasattr(os, "fork"):  # no fork (not a platform the store supports): unbounded
        return fn()
    read_end, write_end = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        _child(fn, write_end)
    os.close(write_end)
    try:
        data, progressed = _read_within(read_end, limit)
    finally:
        os.close(read_end)
    if data is None and progressed:
        raise StoreIOError(
            f"the store's disk answers but reading the store did not finish within "
            f"{limit * SLOW_FACTOR:g} s: the disk is slow or a store directory is very large "
            "(not a hung mount)", path=str(root),
            fix="`spoolctl clean --tmp --yes` reclaims a full tmp/; `spoolctl doctor` names "
                f"other damage; {ENV_DISK_TIMEOUT} sets the wait")
    if data is None:
        raise DiskNotAnsweringError(
            f"the store's disk did not answer within {limit:g} s: the store is down "
            "(a hung mount or a stalled drive)", path=str(root),
            fix="check the drive and its mount (`dmesg`, `mount`); the vLLM connector "
                f"serves without it meanwhile; {ENV_DISK_TIMEOUT} sets the wait")
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)  # it has written everything: it is ending
    if not data:  # the child died before answering (killed, out of memory)
        raise StoreIOError("the process reading the store ended without an answer",
                           path=str(root), fix="run the command again; if it repeats, "
                           "run it with --debug and report the output")
    kind, value, err = json.loads(data)
    if err:
        sys.stderr.write(err)
    if kind == "ok":
        return cast(T, value)  # fn's result after a JSON round trip
    if kind == "spool":
        raise _rebuild(*value)
    # A bug in the child: its last traceback line is the one error line; the whole
    # traceback only with --debug (a log line never carries a traceback by default).
    logging.getLogger(__name__).debug("the bounded child failed:\n%s", value)
    raise RuntimeError(str(value).strip().splitlines()[-1] if str(value).strip() else value)


def _read_within(fd: int, limit: float) -> tuple[bytes | None, bool]:
    """(everything the child writes to ``fd`` until it closes it, or None, whether it reported
    progress). None when ``limit`` seconds pass without a word from it -- each progress tick
    (a NUL byte: its JSON answer holds none) starts the wait again -- or ``SLOW_FACTOR`` times
    ``limit`` pass in all."""
    start = time.monotonic()
    end = start + limit
    cap = start + limit * SLOW_FACTOR
    chunks: list[bytes] = []
    progressed = False
    while True:
        left = min(end, cap) - time.monotonic()
        if left <= 0:
            return None, progressed
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return None, progressed
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks), progressed
        if b"\0" in chunk:
            progressed = True
            end = time.monotonic() + limit
            chunk = chunk.replace(b"\0", b"")
        chunks.append(chunk)


def _tick(write_end: int) -> None:
    """Tell the parent the read goes on (a NUL byte: its JSON answer holds none)."""
    os.write(write_end, b"\0")


def _child(fn: Callable[[], Any], write_end: int) -> None:
    """Run ``fn`` holding none of the parent's output streams (a child stuck on the disk
    must not keep a pipe that cron or a test reads open), send the outcome, exit."""
    code = 0
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        err = io.StringIO()
        # "still reading" ticks (see _read_within)
        install_progress_sink(lambda: _tick(write_end))
        with contextlib.suppress(Exception):
            _redirect_log_handlers(sys.stderr, sys.stdout, err)
        sys.stdout, sys.stderr = io.StringIO(), err
        try:
            outcome: tuple[str, Any] = ("ok", fn())
        except (SpoolError, PermissionError) as exc:
            spool = errors.from_os_permission(exc) if isinstance(exc, PermissionError) else exc
            outcome = ("spool", (type(spool).__name__, spool.message, _text(spool.path),
                                 spool.fix, getattr(spool, "errno", None)))
        except BaseException:
            outcome = ("bug", traceback.format_exc())
        try:
            data = json.dumps([*outcome, err.getvalue()]).encode()
        except Exception:
            data = json.dumps(["bug", traceback.format_exc(), err.getvalue()]).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(write_end, view):]
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _redirect_log_handlers(*old_and_new: Any) -> None:
    """Point the log handlers set up before the fork at the child's captured stderr: they
    hold the parent's stream objects, whose descriptors now lead to /dev/null, and a warning
    the store logs (a catalog rebuilt, an entry quarantined) must reach the operator."""

    *old, new = old_and_new
    loggers = [logging.getLogger(), *(logger for logger in
                                      logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    for logger in loggers:
        for handler in list(logger.handlers):
            # best effort: a handler that cannot be moved keeps its stream (its lines are
            # lost, as before), never the child's answer
            with contextlib.suppress(Exception):
                if isinstance(handler, logging.StreamHandler) and \
                        any(handler.stream is stream for stream in old):
                    handler.stream = new


def _text(path: Any) -> str | None:
    return None if path is None else str(path)


def _rebuild(name: str, message: str, path: str | None, fix: str | None,
             errno: int | None) -> SpoolError:
    """The child's error again: its class by name from ``spoolctl.errors`` (the one error
    hierarchy), else a plain ``SpoolError``."""
    found = getattr(errors, name, None) if isinstance(name, str) else None
    cls = found if isinstance(found, type) and issubclass(found, SpoolError) else SpoolError
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.message, exc.path, exc.fix = message, path, fix
    if errno is not None or hasattr(cls, "errno"):
        exc.errno = errno  # type: ignore[attr-defined]
    return exc
