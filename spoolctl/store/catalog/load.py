"""Loading a catalog in bulk: a rebuild from the manifests in one transaction.

``load``, inside the caller's write transaction, drops the secondary indexes and triggers,
inserts every row, re-creates them from the catalog's DDL and computes both totals tables
and the malformed rows from the rows. Another connection sees the catalog before or after,
never half-loaded; a crash rolls the whole load back. ``page_cache`` enlarges the
connection's page cache around the transaction (``LOAD_CACHE_KIB``) and restores it after.
Pure SQL over a connection the caller holds; no file system access.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

Row = tuple[Any, ...]  # an ``entries`` row in the catalog's column order
Ref = tuple[str, str, int]  # (entry id, object digest, object size)
# Page cache of the loading connection (KiB): a rebuild of 100,000 entries fits.
LOAD_CACHE_KIB = 64 << 10


def load(db: sqlite3.Connection, batches: Iterable[tuple[list[Row], list[Ref]]], *,
         ddl: str, columns: str, fill_malformed: str) -> int:
    """Replace every entry of the catalog on ``db`` with the batches of (rows, refs), in the
    caller's transaction; return the number of entries indexed.

    Rows already there (an earlier rebuild interrupted midway) are deleted first; ``meta``
    (generations, schema) is kept. ``ddl`` re-creates what was dropped (it is ``IF NOT
    EXISTS`` throughout); ``fill_malformed`` records the malformed rows."""
    dropped = db.execute("SELECT type, name FROM sqlite_master WHERE type IN "
                         "('index', 'trigger') AND sql IS NOT NULL").fetchall()
    for kind, name in dropped:  # names come from our own DDL, quoted all the same
        db.execute(f'DROP {"INDEX" if kind == "index" else "TRIGGER"} "{name}"')
    # The manifests are the whole truth: rows left by an earlier, interrupted rebuild go.
    for table in ("entry_objects", "entries", "objects", "malformed_rows"):
        db.execute(f"DELETE FROM {table}")
    marks = ",".join("?" * (columns.count(",") + 1))
    count = 0
    for rows, refs in batches:
        db.executemany(f"INSERT INTO entries({columns}) VALUES ({marks})", rows)
        db.executemany("INSERT OR IGNORE INTO objects VALUES (?, ?)",
                       [(digest, size) for _, digest, size in refs])
        db.executemany("INSERT OR IGNORE INTO entry_objects VALUES (?, ?)",
                       [(entry_id, digest) for entry_id, digest, _ in refs])
        count += len(rows)
    for statement in _statements(ddl):
        db.execute(statement)
    db.execute(
        "UPDATE totals SET entries = (SELECT COUNT(*) FROM entries), "
        "objects = (SELECT COUNT(*) FROM objects), "
        "bytes = (SELECT COALESCE(SUM(manifest_size), 0) FROM entries) "
        "+ (SELECT COALESCE(SUM(size), 0) FROM objects) WHERE id = 0")
    db.execute("DELETE FROM kind_totals")
    db.execute("INSERT INTO kind_totals SELECT kind, hint, state, COUNT(*), "
               "COALESCE(SUM(size), 0) FROM entries GROUP BY kind, hint, state")
    db.execute("INSERT OR REPLACE INTO meta VALUES ('kind_totals', '1')")
    db.execute(fill_malformed)
    return count


@contextmanager
def page_cache(db: sqlite3.Connection) -> Iterator[None]:
    """``LOAD_CACHE_KIB`` of page cache on ``db`` while inside (outside any transaction:
    shrinking it back before a commit would spill the dirty pages)."""
    cache = int(db.execute("PRAGMA cache_size").fetchone()[0])
    db.execute(f"PRAGMA cache_size=-{LOAD_CACHE_KIB}")
    try:
        yield
    finally:
        db.execute(f"PRAGMA cache_size={cache}")
        db.execute("PRAGMA shrink_memory")  # the pages beyond it, back to the process


def _statements(ddl: str) -> list[str]:
    """The statements of ``ddl`` one by one (``executescript`` would commit the caller's
    transaction). Trigger bodies hold ``;`` too, so statements are split where SQLite says
    one is complete."""
    out, current = [], ""
    for line in ddl.splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            out.append(current.strip())
            current = ""
    if current.strip():
        out.append(current.strip())
    return out
