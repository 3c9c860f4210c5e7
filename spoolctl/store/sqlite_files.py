"""Opening the store's SQLite databases (catalog, scrub progress, request queue) one way."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Literal

from .fsio import precreate_private


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
