"""The scrub's progress database, ``state/scrub.sqlite3``: cycles (cursor, in-flight entry,
counts) and findings, written by ``scrub.Scrubber``, read by status, metrics and doctor.
Apart from the scrubber so code below the ``Store`` facade can read it.
"""

from __future__ import annotations

import logging
import re
import sqlite3
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import QuarantineReason, StoreIOError
from ..disk.sqlite_files import DamagedDatabaseError, connect_private, connect_read_only, is_damaged

if TYPE_CHECKING:
    from ..disk.root import StorePaths
    from .quarantine import Quarantine

log = logging.getLogger("spoolctl.store")


class StoreDirs(Protocol):
    """What the progress database needs of a store: its layout and its quarantine."""

    layout: StorePaths
    quarantine: Quarantine

SCRUB_DB = "scrub.sqlite3"
_ID_OR_EMPTY = re.compile(r"(?:[0-9a-f]{64})?")
# The findings reason of an entry whose object could not be read (not a quarantine).
UNREADABLE = "unreadable"

_DDL = """
CREATE TABLE IF NOT EXISTS cycles(
    cycle_id INTEGER PRIMARY KEY AUTOINCREMENT,
    started REAL NOT NULL,
    finished REAL,
    total_at_start INTEGER NOT NULL,
    cursor TEXT NOT NULL DEFAULT '',
    inflight TEXT,
    checked INTEGER NOT NULL DEFAULT 0,
    bytes INTEGER NOT NULL DEFAULT 0,
    quarantined INTEGER NOT NULL DEFAULT 0,
    absent INTEGER NOT NULL DEFAULT 0,
    orphan_objects INTEGER NOT NULL DEFAULT 0,
    orphan_bytes INTEGER NOT NULL DEFAULT 0,
    tmp_files INTEGER NOT NULL DEFAULT 0,
    tmp_bytes INTEGER NOT NULL DEFAULT 0,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS findings(
    cycle_id INTEGER NOT NULL, entry_id TEXT NOT NULL, reason TEXT NOT NULL, time REAL NOT NULL
);
"""


@dataclass(frozen=True)
class Cycle:
    """One scrub cycle's recorded state (finished is None while in progress)."""

    cycle_id: int
    started: float
    finished: float | None
    total_at_start: int
    cursor: str
    inflight: str | None
    checked: int
    bytes: int
    quarantined: int
    absent: int
    orphan_objects: int
    orphan_bytes: int
    tmp_files: int
    tmp_bytes: int
    updated: float
    unreadable: int = 0  # entries with an object that could not be read (findings)

    @property
    def done(self) -> int:
        """Entries this cycle has passed, whatever their outcome."""
        return self.checked + self.quarantined + self.absent + self.unreadable

    def progress(self, total_now: int) -> float:
        """Fraction of the cycle done (by entries), 0..1."""
        if self.finished is not None:
            return 1.0
        denom = max(self.total_at_start, total_now, 1)
        return min(1.0, self.done / denom)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ScrubSummary:
    """What ``status`` shows: the last finished cycle and the one in progress."""

    last_cycle: Cycle | None
    current_cycle: Cycle | None
    last_findings: list[dict[str, Any]]

    def to_json(self, total_now: int) -> dict[str, Any]:
        cur = self.current_cycle
        return {
            "last_cycle": self.last_cycle.to_json() if self.last_cycle else None,
            "last_findings": self.last_findings,
            "current": None if cur is None else {
                **cur.to_json(), "progress": round(cur.progress(total_now), 4)},
        }


class ScrubState:
    """Typed access to ``state/scrub.sqlite3`` (one connection, one thread at a time)."""

    def __init__(self, path: Path, *, read_only: bool = False):
        self.path = path
        # NORMAL in WAL mode survives kill -9 (the case resumption is for); a power
        # cut may lose the last few progress saves, which only repeats some work.
        self._db = connect_read_only(path, ddl=_DDL) if read_only else \
            connect_private(path, ddl=_DDL, synchronous="NORMAL")

    @classmethod
    def of(cls, store: StoreDirs) -> ScrubState:
        return cls(store.layout.state / SCRUB_DB)

    @classmethod
    def summary_of(cls, store: StoreDirs) -> ScrubSummary:
        """Summary for status/metrics, read-only; an absent or unreadable database reads
        as empty."""
        if not (store.layout.state / SCRUB_DB).exists():
            return ScrubSummary(None, None, [])
        try:
            state = cls(store.layout.state / SCRUB_DB, read_only=True)
        except sqlite3.DatabaseError:
            return ScrubSummary(None, None, [])
        try:
            return state.summary()
        except sqlite3.DatabaseError:
            return ScrubSummary(None, None, [])
        finally:
            state.close()

    def close(self) -> None:
        self._db.close()

    def entry_ids_found(self, cycle_id: int, reason: str, limit: int) -> list[str]:
        """Up to ``limit`` entry ids the cycle ``cycle_id`` recorded with ``reason``."""
        rows = self._db.execute(
            "SELECT entry_id FROM findings WHERE cycle_id=? AND reason=? LIMIT ?",
            (cycle_id, reason, limit)).fetchall()
        return [str(r[0]) for r in rows]

    def check(self) -> None:
        """Raise ``sqlite3.DatabaseError`` unless the file is sound and the open cycle's
        cursor and in-flight id are well formed (a corrupt page can read as a bogus row)."""
        result = self._db.execute("PRAGMA quick_check").fetchone()
        if not result or result[0] != "ok":
            raise DamagedDatabaseError(f"scrub state failed quick_check: {result}")
        cur = self.current()
        if cur is not None and not (
                isinstance(cur.started, float) and isinstance(cur.cursor, str)
                and _ID_OR_EMPTY.fullmatch(cur.cursor)
                and (cur.inflight is None or (isinstance(cur.inflight, str)
                                              and _ID_OR_EMPTY.fullmatch(cur.inflight)))):
            raise DamagedDatabaseError("scrub state holds a malformed cycle row")

    @classmethod
    def open_checked(cls, store: StoreDirs) -> ScrubState:
        """Open the progress database for a scrubber (which holds ``scrub.lock``). A
        damaged one is quarantined and a fresh one started (progress is advisory);
        transient errors raise StoreIOError."""
        path = store.layout.state / SCRUB_DB
        try:
            state = cls(path)
            try:
                state.check()
            except BaseException:
                state.close()
                raise
            return state
        except sqlite3.DatabaseError as exc:
            if not is_damaged(exc):
                raise StoreIOError(f"scrub state unavailable: {exc}", path=path,
                                   fix="check free space and the disk (`spoolctl doctor`)"
                                   ) from None
            why = f"scrub state unreadable: {exc}"
        files = [(path.with_name(SCRUB_DB + suffix), "scrub_state")
                 for suffix in ("", "-wal", "-shm")]
        store.quarantine.add(QuarantineReason.SCRUB_STATE, why, files)
        log.warning("scrub progress database quarantined and reset: %s", why)
        return cls(path)

    def _cycle(self, where: str) -> Cycle | None:
        row = self._db.execute(
            "SELECT cycle_id, started, finished, total_at_start, cursor, inflight, checked, "
            "bytes, quarantined, absent, orphan_objects, orphan_bytes, tmp_files, tmp_bytes, "
            f"updated FROM cycles WHERE {where} ORDER BY cycle_id DESC LIMIT 1").fetchone()
        if not row:
            return None
        # Unreadable entries are counted from their findings: no schema change, so an
        # older progress database (or a read-only one) reads the same way.
        (unreadable,) = self._db.execute(
            "SELECT COUNT(*) FROM findings WHERE cycle_id=? AND reason=?",
            (row[0], UNREADABLE)).fetchone()
        return replace(Cycle(*row), unreadable=unreadable)

    def current(self) -> Cycle | None:
        return self._cycle("finished IS NULL")

    def last_finished(self) -> Cycle | None:
        return self._cycle("finished IS NOT NULL")

    def findings(self, cycle_id: int, limit: int = 100) -> list[dict[str, Any]]:
        return [
            {"entry_id": e, "reason": r, "time": t} for e, r, t in self._db.execute(
                "SELECT entry_id, reason, time FROM findings WHERE cycle_id=? ORDER BY time "
                "LIMIT ?", (cycle_id, limit))
        ]

    def summary(self) -> ScrubSummary:
        last = self.last_finished()
        return ScrubSummary(last, self.current(), self.findings(last.cycle_id) if last else [])

    def start_cycle(self, now: float, total: int) -> Cycle:
        self._db.execute(
            "INSERT INTO cycles(started, total_at_start, updated) VALUES (?, ?, ?)",
            (now, total, now))
        cycle = self.current()
        assert cycle is not None
        return cycle

    def save(self, cycle_id: int, *, cursor: str, inflight: str | None, checked: int = 0,
             nbytes: int = 0, quarantined: int = 0, absent: int = 0) -> None:
        """Advance the cursor, set the next in-flight entry, add counts (one transaction)."""
        self._db.execute(
            "UPDATE cycles SET cursor=?, inflight=?, checked=checked+?, bytes=bytes+?, "
            "quarantined=quarantined+?, absent=absent+?, updated=? WHERE cycle_id=?",
            (cursor, inflight, checked, nbytes, quarantined, absent, time.time(), cycle_id))

    def add_finding(self, cycle_id: int, entry_id: str, reason: str) -> None:
        self._db.execute("INSERT INTO findings VALUES (?, ?, ?, ?)",
                         (cycle_id, entry_id, reason, time.time()))

    def finish(self, cycle_id: int, *, orphan_objects: int, orphan_bytes: int, tmp_files: int,
               tmp_bytes: int) -> None:
        now = time.time()
        self._db.execute(
            "UPDATE cycles SET finished=?, inflight=NULL, orphan_objects=?, orphan_bytes=?, "
            "tmp_files=?, tmp_bytes=?, updated=? WHERE cycle_id=?",
            (now, orphan_objects, orphan_bytes, tmp_files, tmp_bytes, now, cycle_id))
        # Keep a bounded history: the last 100 cycles and their findings.
        self._db.execute("DELETE FROM findings WHERE cycle_id <= ?", (cycle_id - 100,))
        self._db.execute("DELETE FROM cycles WHERE cycle_id <= ?", (cycle_id - 100,))
