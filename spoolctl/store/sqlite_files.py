"""The store's SQLite databases (catalog, scrub progress, request queue): opened one way,
and their errors classified one way, by SQLite's result codes.

``error_code`` reads the primary result code of a ``sqlite3`` exception: Python 3.11+
carries it (``sqlite_errorcode``); on 3.10 it is recovered from the message, which SQLite
builds from fixed per-code strings (``sqlite3_errstr``). ``is_damaged`` says whether an
error means the file itself is not what spoolctl wrote (rebuild or reset it);
``sqlite_error`` turns any other error into the store's own error with its fix.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Literal

from .errors import BusyError, SpoolError, StoreIOError
from .fsio import precreate_private

# Primary result codes (https://sqlite.org/rescode.html); sqlite3 exports them only on 3.11+.
SQLITE_ERROR = 1
SQLITE_BUSY = 5
SQLITE_LOCKED = 6
SQLITE_IOERR = 10
SQLITE_CORRUPT = 11
SQLITE_FULL = 13
SQLITE_NOTADB = 26

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
    ("database or disk is full", SQLITE_FULL),
    ("disk i/o error", SQLITE_IOERR),
    ("no such table", SQLITE_ERROR),
    ("no such column", SQLITE_ERROR),
    ("has no column named", SQLITE_ERROR),
)


class DamagedDatabaseError(sqlite3.DatabaseError):
    """Raised by spoolctl's own checks: the file opened as SQLite but is not what spoolctl
    wrote (another schema version, a failed quick_check, a malformed row)."""


def error_code(exc: sqlite3.Error) -> int | None:
    """The primary SQLite result code of ``exc``, or None if SQLite did not raise it."""
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
    if code == SQLITE_FULL:
        return StoreIOError(f"{what} write failed: No space left on device", path=path,
                            fix="free disk space or lower the store's max size")
    return StoreIOError(f"{what} I/O failed: {exc}", path=path,
                        fix="check free space and the disk (`spoolctl doctor`)")


def connect_private(
    path: Path, *, ddl: str, synchronous: Literal["NORMAL", "FULL"], timeout: float = 30
) -> sqlite3.Connection:
    """A WAL-mode connection to ``path`` (created 0600: SQLite would make it 0644, and its
    -wal/-shm files inherit the mode), with ``ddl`` applied. Autocommit mode; the caller
    manages transactions. The connection is closed again if setup fails."""
    precreate_private(path)
    db = sqlite3.connect(str(path), timeout=timeout, isolation_level=None,
                         check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={synchronous}")
        db.executescript(ddl)
    except BaseException:
        db.close()
        raise
    return db
