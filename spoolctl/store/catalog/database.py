"""The catalog's one SQLite connection: opening it (writable or read-only, refusing a newer
schema, migrating version 1), the lock that guards it, read and write transactions, the
parsing of rows on the way out and background WAL checkpoints."""

from __future__ import annotations

import re
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ...errors import RootError
from ..disk import faults
from ..disk.sqlite_files import DamagedDatabaseError, connect_private, connect_read_only
from ..disk.wal_checkpoints import BackgroundCheckpoints
from .rows import CatalogRow, MalformedRow, parse_row
from .schema import DDL, DDL_V1, MIGRATE_V1, SCHEMA_VERSION

# Malformed rows remembered for reports (the rest are counted by ``malformed_count``).
MAX_MALFORMED_SEEN = 1000
HEX64 = re.compile(r"[0-9a-f]{64}")
_META_SQL = "CREATE TABLE meta(k TEXT PRIMARY KEY, v TEXT NOT NULL)"

Raw = tuple[Any, ...]  # a row as SQLite returns it


class CatalogDb:
    """The open catalog database at ``path``; every use holds ``lock`` (SQLite connections
    are not thread-safe). Raises DamagedDatabaseError for a file that is not a catalog of a
    known schema, RootError for a newer schema (nothing changed)."""

    def __init__(self, path: Path, *, read_only: bool = False):
        self.path = path
        self.lock = threading.RLock()
        self.checkpointer: BackgroundCheckpoints | None = None
        # Malformed rows met while reading (entry id -> reason), for reports.
        self.malformed_seen: dict[str, str] = {}
        try:
            if read_only:
                self.connection = connect_read_only(path, timeout=60, ddl=DDL,
                                                    earlier_ddl=(DDL_V1,))
            else:
                # NORMAL in WAL mode: a power cut may lose the last transactions, which is
                # safe because the catalog is derived (docs/decisions/0003-catalog-intent-rows.md).
                self.connection = connect_private(path, ddl=DDL, synchronous="NORMAL",
                                                  timeout=60, earlier_ddl=(DDL_V1,))
        except DamagedDatabaseError:
            # A newer spoolctl's catalog is not damage: never quarantined and rebuilt.
            refuse_newer(stored_schema(path), path)
            raise
        db = self.connection
        try:
            if not read_only:
                db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
            row = db.execute("SELECT v FROM meta WHERE k='schema'").fetchone()
            version = row[0] if row else None
        except BaseException:
            db.close()
            raise
        refuse_newer(version, path, close=db)
        # A read-only open reads a version-1 catalog as it is (it cannot migrate it).
        if version != SCHEMA_VERSION and not (version == "1" and (read_only or self._migrate())):
            db.close()
            raise DamagedDatabaseError(f"catalog schema {version!r} is not {SCHEMA_VERSION!r}")
        # Malformed rows are in their own table (version 2); else found by a scan.
        self.malformed_table = version == SCHEMA_VERSION or not read_only
        try:
            if not read_only:
                self._fill_kind_totals()
            self.has_kind_totals = bool(db.execute(
                "SELECT 1 FROM meta WHERE k='kind_totals'").fetchone())
            # A catalog made before the index, opened read-only, does not have it.
            self.released_index = bool(db.execute(
                "SELECT 1 FROM sqlite_master WHERE type='index' AND name='entries_released'"
            ).fetchone())
        except BaseException:
            db.close()
            raise

    def _migrate(self) -> bool:
        """Migrate a version-1 catalog in one write transaction (the connection applied the
        new DDL already); True when done. A crash midway leaves version 1, migrated again by
        the next writable open."""
        try:
            with self.write_transaction() as db:
                row = db.execute("SELECT v FROM meta WHERE k='schema'").fetchone()
                if row is None or row[0] == SCHEMA_VERSION:
                    return row is not None  # another process migrated it meanwhile
                for statement in MIGRATE_V1:
                    db.execute(statement)
                faults.checkpoint("catalog.migrated")  # crash tests: before the commit
                db.execute("UPDATE meta SET v=? WHERE k='schema'", (SCHEMA_VERSION,))
        except BaseException:
            self.connection.close()
            raise
        return True

    def _fill_kind_totals(self) -> None:
        """Fill ``kind_totals`` from the rows once, for a catalog made before it existed
        (its triggers keep it from then on, also for older writers of this file)."""
        if self.connection.execute("SELECT 1 FROM meta WHERE k='kind_totals'").fetchone():
            return
        with self.write_transaction() as db:
            if db.execute("SELECT 1 FROM meta WHERE k='kind_totals'").fetchone():
                return  # another process filled it meanwhile
            db.execute("DELETE FROM kind_totals")
            db.execute("INSERT INTO kind_totals SELECT kind, hint, state, COUNT(*), "
                       "COALESCE(SUM(size), 0) FROM entries GROUP BY kind, hint, state")
            db.execute("INSERT INTO meta VALUES ('kind_totals', '1')")

    def close(self) -> None:
        with self.lock:
            self.connection.close()

    @contextmanager
    def background_checkpoints(self) -> Iterator[None]:
        """While inside, commits do not checkpoint the WAL: a helper thread does after each
        write transaction and the next one waits for it (``wal_checkpoints``), so the file
        work of a long run of large write transactions overlaps the checkpoints. Nested
        uses leave the outer one in charge."""
        with self.lock:
            nested = self.checkpointer is not None
            if not nested:
                previous = int(self.connection.execute(
                    "PRAGMA wal_autocheckpoint").fetchone()[0])
                self.connection.execute("PRAGMA wal_autocheckpoint=0")
                self.checkpointer = BackgroundCheckpoints(self.path)
        if nested:
            yield
            return
        try:
            yield
        finally:
            with self.lock:
                checkpoints, self.checkpointer = self.checkpointer, None
                try:
                    if checkpoints is not None:
                        checkpoints.close()
                finally:
                    self.connection.execute(f"PRAGMA wal_autocheckpoint={previous}")

    @contextmanager
    def write_transaction(self) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction on the connection, committed on success and
        rolled back on any exception."""
        with self.lock:
            if self.checkpointer is not None:
                self.checkpointer.wait()  # the log restarts at this write, not grows
            self.connection.execute("BEGIN IMMEDIATE")
            try:
                yield self.connection
            except BaseException:
                self.connection.execute("ROLLBACK")
                raise
            else:
                self.connection.execute("COMMIT")
            if self.checkpointer is not None:
                self.checkpointer.start()

    def read(self, sql: str, params: Iterable[Any] = ()) -> list[Raw]:
        """Every row ``sql`` returns."""
        with self.lock:
            rows: list[Raw] = self.connection.execute(sql, tuple(params)).fetchall()
            return rows

    def rows(self, raw: list[Raw]) -> list[CatalogRow]:
        """Parse rows; skip (and remember in ``malformed_seen``) malformed ones."""
        out = []
        for values in raw:
            try:
                out.append(parse_row(values))
            except MalformedRow as exc:
                if len(self.malformed_seen) < MAX_MALFORMED_SEEN:
                    self.malformed_seen[exc.entry_id] = exc.reason
        return out

    def quick_check(self) -> str:
        return str(self.read("PRAGMA quick_check")[0][0])


def chunks(items: list[str], n: int) -> Iterator[list[str]]:
    """``items`` in slices of at most ``n`` (SQLite bounds the parameters of a statement)."""
    for i in range(0, len(items), n):
        yield items[i:i + n]


def stored_schema(path: Path) -> str | None:
    """The schema version a catalog file says it has, read without running anything of
    the file's (its ``meta`` table must be exactly ours); None when it cannot be told."""
    try:
        db = connect_read_only(path, timeout=5, snapshot=True)  # creates no -wal, -shm
    except sqlite3.Error:
        return None
    try:
        meta = db.execute("SELECT sql FROM sqlite_master WHERE name='meta'").fetchone()
        if meta is None or meta[0] != _META_SQL:
            return None
        row = db.execute("SELECT v FROM meta WHERE k='schema'").fetchone()
        return str(row[0]) if row else None
    except sqlite3.Error:
        return None
    finally:
        db.close()


def refuse_newer(version: str | None, path: Path,
                 close: sqlite3.Connection | None = None) -> None:
    """RootError (nothing changed; ``close`` closed first) when ``version`` is a catalog
    schema newer than this spoolctl's: rebuilding it would lose what it holds."""
    if version is None or not version.isdigit() or int(version) <= int(SCHEMA_VERSION):
        return
    if close is not None:
        close.close()
    raise RootError(f"the catalog has schema {version}, newer than this spoolctl reads (up "
                    f"to {SCHEMA_VERSION}): a newer version wrote it; nothing was changed",
                    path=path, fix="run the spoolctl version that wrote the store (or newer)")
