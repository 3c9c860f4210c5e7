"""The store's SQLite databases (catalog, scrub progress, request queue): opened one way,
their errors classified one way by SQLite's result codes.

Whoever can write the store can plant symlinks, FIFOs, views and triggers in these files.
So before SQLite sees a path, ``check_files`` requires regular files; every connection has
a per-statement deadline (``STATEMENT_DEADLINE``); and before any statement touches a
table, ``check_schema`` requires every schema object to be one spoolctl's DDL creates.
Any of these failing is damage (``DamagedDatabaseError``: rebuilt or reset like a corrupt
file). ``trusted_schema=OFF`` is not used: it rejects our own ``json_valid()`` triggers.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import sqlite3
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

from ...errors import BusyError, SpoolError, StoreIOError
from . import dirfd
from .fsio import file_kind, precreate_private
from .space import INODE_FIX, inodes_short, no_inodes_detail

# Primary result codes (https://sqlite.org/rescode.html); sqlite3 exports them only on 3.11+.
SQLITE_ERROR = 1
SQLITE_PERM = 3
SQLITE_BUSY = 5
SQLITE_LOCKED = 6
SQLITE_INTERRUPT = 9
SQLITE_READONLY = 8
SQLITE_IOERR = 10
SQLITE_CORRUPT = 11
SQLITE_FULL = 13
SQLITE_CANTOPEN = 14
SQLITE_NOTADB = 26
SUFFIXES = ("", "-wal", "-shm")

# A static statement of ours failing with SQLITE_ERROR means the schema it names is gone or
# altered ("no such table", "no such column"): the database is not the one we created.
DAMAGE_CODES = frozenset({SQLITE_ERROR, SQLITE_CORRUPT, SQLITE_NOTADB})

# Python 3.10 fallback: message fragments -> primary code, first match wins. The texts are
# SQLite's own (sqlite3_errstr, and the schema errors of the SQL compiler).
_TEXT_CODES: tuple[tuple[str, int], ...] = (
    ("database disk image is malformed", SQLITE_CORRUPT),
    ("malformed database schema", SQLITE_CORRUPT),
    ("file is not a database", SQLITE_NOTADB),
    ("database table is locked", SQLITE_LOCKED),
    ("database is locked", SQLITE_BUSY),
    ("interrupted", SQLITE_INTERRUPT),
    ("database or disk is full", SQLITE_FULL),
    ("disk i/o error", SQLITE_IOERR),
    ("attempt to write a readonly database", SQLITE_READONLY),
    ("unable to open database file", SQLITE_CANTOPEN),
    ("no such table", SQLITE_ERROR),
    ("no such column", SQLITE_ERROR),
    ("has no column named", SQLITE_ERROR),
)


class DamagedDatabaseError(sqlite3.DatabaseError):
    """The file opened as SQLite but is not what spoolctl wrote (foreign schema, failed
    quick_check, malformed row, special file)."""


def error_code(exc: sqlite3.Error) -> int | None:
    """The primary SQLite result code of ``exc``, or None if SQLite did not raise it."""
    # Python 3.10 has no sqlite_errorcode: recover the code from SQLite's fixed messages
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF
    text = str(exc).lower()
    for fragment, value in _TEXT_CODES:
        if fragment in text:
            return value
    return None


def is_damaged(exc: sqlite3.Error) -> bool:
    """True if ``exc`` shows the database file is damaged or foreign (quarantine and rebuild
    it); False for a transient or environmental failure (busy, I/O, full, read-only...)."""
    return isinstance(exc, DamagedDatabaseError) or error_code(exc) in DAMAGE_CODES


def sqlite_error(exc: sqlite3.Error, path: Path, what: str = "catalog") -> SpoolError:
    """The store's error for a failure of the database at ``path`` that is not damage."""
    code = error_code(exc)
    if code in (SQLITE_BUSY, SQLITE_LOCKED):
        return BusyError(f"{what} is locked by another process", path=path,
                         fix="retry; if it persists check `spoolctl status` for the owner")
    if code == SQLITE_INTERRUPT:
        return StoreIOError(f"{what} query ran past its {STATEMENT_DEADLINE:.0f} s deadline",
                            path=path, fix="run `spoolctl doctor`: a file planted in the "
                            "store's state/ can make queries endless")
    if no_space(exc, path):
        if (short := inodes_short(path.parent)) is not None:
            return StoreIOError(f"{what} write failed: No space left on device: "
                                f"{no_inodes_detail(short)}", path=path, errno=errno.ENOSPC,
                                fix=INODE_FIX)
        return StoreIOError(f"{what} write failed: No space left on device", path=path,
                            errno=errno.ENOSPC,
                            fix="free disk space: `spoolctl clean --released` and lowering "
                                "the max size work on a full disk (docs/runbook.md)")
    if code in (SQLITE_READONLY, SQLITE_PERM, SQLITE_CANTOPEN):
        return StoreIOError(f"{what} cannot be written ({exc})", path=path,
                            fix="the file, its directory or the filesystem is read-only or "
                                "owned by another user: `spoolctl doctor` names which",
                            errno=errno.EACCES)
    return StoreIOError(f"{what} I/O failed: {exc}", path=path,
                        fix="check free space and the disk (`spoolctl doctor`)")


def no_space(exc: sqlite3.Error, path: Path) -> bool:
    """True if ``exc`` means the disk under the database at ``path`` is full. SQLite
    reports a failed -shm/-wal extension on a full disk as an I/O error, not SQLITE_FULL."""
    code = error_code(exc)
    if code in (SQLITE_IOERR, SQLITE_CANTOPEN) and inodes_short(path.parent) is not None:
        return True  # no inode for the -wal/-shm file: SQLite says "unable to open"
    return code == SQLITE_FULL or (code == SQLITE_IOERR and _disk_full(path))


def _disk_full(path: Path) -> bool:
    try:
        return shutil.disk_usage(path.parent).free < (64 << 10)
    except OSError:
        return False


def check_files(path: Path) -> None:
    """Raise DamagedDatabaseError if the database at ``path`` or its -wal/-shm file exists
    and is not a regular file (a FIFO, a symlink, a directory...)."""
    for suffix in SUFFIXES:
        p = path.with_name(path.name + suffix)
        try:
            st = dirfd.lstat(p)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            raise DamagedDatabaseError(f"{p.name} is not a regular file ({file_kind(st.st_mode)})")


# Seconds one statement may run before the progress handler interrupts it: spoolctl's own
# take under a second on a million-entry catalog, a bulk rebuild seconds; only a planted
# query gets near this.
STATEMENT_DEADLINE = 120.0
# The handler runs every this many SQLite VM instructions (about a millisecond of work).
_PROGRESS_STEPS = 10_000


class _Guarded(sqlite3.Connection):
    """A connection whose every statement has a deadline (``STATEMENT_DEADLINE``): each
    ``execute``/``executemany``/``executescript`` starts a new one, and the rows of a
    query fetched later still count against the statement's own."""

    deadline_s: float = STATEMENT_DEADLINE
    _until: float = 0.0

    def _start(self) -> None:
        self._until = time.monotonic() + self.deadline_s

    def _late(self) -> int:
        return 1 if time.monotonic() > self._until else 0  # nonzero: SQLITE_INTERRUPT

    def execute(self, *args: Any, **kwargs: Any) -> sqlite3.Cursor:
        self._start()
        return super().execute(*args, **kwargs)

    def executemany(self, *args: Any, **kwargs: Any) -> sqlite3.Cursor:
        self._start()
        return super().executemany(*args, **kwargs)

    def executescript(self, *args: Any, **kwargs: Any) -> sqlite3.Cursor:
        self._start()
        return super().executescript(*args, **kwargs)


def _guarded(target: str, *, uri: bool = False, timeout: float,
             deadline: float | None = None) -> _Guarded:
    """``sqlite3.connect`` in autocommit mode with the guards of the module docstring."""
    db = sqlite3.connect(target, uri=uri, timeout=timeout, isolation_level=None,
                         check_same_thread=False, factory=_Guarded)
    assert isinstance(db, _Guarded)
    if deadline is not None:
        db.deadline_s = deadline
    db._start()
    db.set_progress_handler(db._late, _PROGRESS_STEPS)
    return db


@contextlib.contextmanager
def _pinned(path: Path) -> Iterator[str]:
    """The name to give SQLite for ``path``: under a guarded root ``/proc/self/fd/N/NAME``
    of its directory opened by ``open_dir``'s walk, else ``path`` itself."""
    if not dirfd.guarded(path) or not os.path.isdir(_PROC_FD):
        yield str(path)
        return
    fd = dirfd.open_dir(path.parent)
    try:
        yield f"{_PROC_FD}/{fd}/{path.name}"
    finally:
        os.close(fd)


_PROC_FD = "/proc/self/fd"


def _check_opened(db: sqlite3.Connection, path: Path) -> None:
    """Under a guarded root: prove every file SQLite holds for ``db`` is the one in
    ``path``'s directory reached without a link; else close ``db`` and raise StoreIOError
    (ELOOP: the directory was swapped while SQLite opened it)."""
    if not dirfd.guarded(path) or not os.path.isdir(_PROC_FD):
        return
    try:
        db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        held = _held_files()
        with dirfd.opened(path.parent) as fd:
            for suffix in SUFFIXES:
                name = path.name + suffix
                wanted = [link for link, _ in held if link.endswith(os.sep + name)]
                if suffix and not wanted:
                    continue  # not opened (no WAL yet, or a read-only snapshot)
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    st = None
                ours = st is not None and any(key == (st.st_dev, st.st_ino)
                                              for link, key in held if link in wanted)
                if not ours:
                    raise OSError(errno.ELOOP, "store directory swapped while SQLite opened "
                                  "it", str(path.with_name(name)))
    except BaseException as exc:
        db.close()
        if isinstance(exc, OSError):
            raise StoreIOError(f"opening {path.name} failed: {exc.strerror}", path=path,
                               errno=exc.errno, fix="a store directory was swapped for a "
                               "symlink: inspect the store before using it again") from None
        raise


def _held_files() -> list[tuple[str, tuple[int, int]]]:
    """(target path, (device, inode)) of every file this process holds open."""
    out = []
    for name in os.listdir(_PROC_FD):
        try:
            link = os.readlink(f"{_PROC_FD}/{name}")
            st = os.stat(f"{_PROC_FD}/{name}")
        except OSError:
            continue
        out.append((link, (st.st_dev, st.st_ino)))
    return out


def connect_pinned(path: Path, *, timeout: float) -> sqlite3.Connection:
    """A plain autocommit connection to the existing database at ``path``, opened through
    the checked directory under a guarded root (``_check_opened``)."""
    with _pinned(path) as target:
        db = sqlite3.connect(target, timeout=timeout, isolation_level=None,
                             check_same_thread=False)
    _check_opened(db, path)
    return db


@functools.lru_cache(maxsize=8)
def _expected_schema(ddl: str) -> frozenset[tuple[str, str, str, str | None]]:
    """(type, name, table, sql) of every object ``ddl`` creates, in SQLite's normal form."""
    mem = sqlite3.connect(":memory:")
    try:
        mem.executescript(ddl)
        return frozenset(mem.execute("SELECT type, name, tbl_name, sql FROM sqlite_master"))
    finally:
        mem.close()


def check_schema(db: sqlite3.Connection, ddl: str, *, earlier: tuple[str, ...] = ()) -> None:
    """Raise DamagedDatabaseError if the database holds a schema object that ``ddl`` (or
    one of the ``earlier`` versions' DDL) does not create, or one with other SQL. Missing
    objects are fine. Reading ``sqlite_master`` runs none of them."""
    expected: frozenset[tuple[str, str, str, str | None]] = frozenset().union(
        *(_expected_schema(d) for d in (ddl, *earlier)))
    found = db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall()
    for row in found:
        if tuple(row) not in expected:
            kind, name = str(row[0])[:20], str(row[1])[:80]
            raise DamagedDatabaseError(f"holds a {kind} {name!r} that spoolctl did not create "
                                       "(or altered)")


def connect_read_only(path: Path, *, timeout: float = 30, ddl: str | None = None,
                      deadline: float | None = None, snapshot: bool = False,
                      earlier_ddl: tuple[str, ...] = ()) -> sqlite3.Connection:
    """A connection that never writes or creates anything (``mode=ro``), falling back to
    ``immutable=1`` (the main file only: maybe missing a running writer's newest commits,
    never torn) where SQLite cannot set up its shared-memory index.

    ``ddl``/``earlier_ddl``: the schema the file must keep to (``check_schema``).
    ``deadline``: seconds per statement. ``snapshot``: immutable at once, creating not even
    -shm/-wal. Raises sqlite3 errors as they come (absent file: SQLITE_CANTOPEN),
    DamagedDatabaseError (the connection closed)."""
    check_files(path)
    with _pinned(path) as target:
        return _read_only(path, target, timeout=timeout, ddl=ddl, deadline=deadline,
                          snapshot=snapshot, earlier_ddl=earlier_ddl)


def _read_only(path: Path, target: str, *, timeout: float, ddl: str | None,
               deadline: float | None, snapshot: bool, earlier_ddl: tuple[str, ...]
               ) -> sqlite3.Connection:
    """``connect_read_only`` of ``path``, named ``target`` for SQLite (``_pinned``)."""
    try:
        dirfd.lstat(path)
    except FileNotFoundError:
        raise sqlite3.OperationalError("unable to open database file") from None
    uri = "file:" + quote(target, safe="/")
    db = None
    try:
        if not snapshot:
            db = _guarded(f"{uri}?mode=ro", uri=True, timeout=timeout, deadline=deadline)
            try:
                db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            except BaseException:
                db.close()
                raise
    except sqlite3.OperationalError as exc:
        if error_code(exc) not in (SQLITE_CANTOPEN, SQLITE_READONLY, SQLITE_IOERR,
                                   SQLITE_PERM):
            raise
        db = None
    if db is None:
        db = _guarded(f"{uri}?mode=ro&immutable=1", uri=True, timeout=timeout,
                      deadline=deadline)
    _check_opened(db, path)
    if ddl is not None:
        try:
            check_schema(db, ddl, earlier=earlier_ddl)
        except BaseException:
            db.close()
            raise
    return db


def connect_private(
    path: Path, *, ddl: str, synchronous: Literal["NORMAL", "FULL"], timeout: float = 30,
    earlier_ddl: tuple[str, ...] = (),
) -> sqlite3.Connection:
    """An autocommit WAL-mode connection to ``path`` (created 0600), with ``ddl`` applied
    once the schema proved ours (``check_schema``; migrating ``earlier_ddl`` is the
    caller's job). DamagedDatabaseError for a special file or a foreign schema; the
    connection is closed if setup fails."""
    check_files(path)
    precreate_private(path)
    for suffix in SUFFIXES[1:] if dirfd.guarded(path) else ():
        precreate_private(path.with_name(path.name + suffix))  # the owner's from the start
    with _pinned(path) as target:
        db = _guarded(target, timeout=timeout)
    try:
        _check_opened(db, path)
        check_schema(db, ddl, earlier=earlier_ddl)
        db.execute("PRAGMA journal_mode=WAL")
        _check_opened(db, path)  # the -wal/-shm files a new database opens only now
        db.execute(f"PRAGMA synchronous={synchronous}")
        db.executescript(ddl)
    except BaseException:
        db.close()
        raise
    return db
