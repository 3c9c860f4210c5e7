"""The catalog's schema: its tables, indexes and triggers (``DDL``) and the column order of
an ``entries`` row (``COLUMNS``). Kept apart from ``catalog`` (the typed access) so a bulk
load (``catalog_load``) and the catalog share one definition.

Every statement is ``IF NOT EXISTS``: applying ``DDL`` to a catalog made by an older
spoolctl adds what it lacks (indexes, triggers, tables) and changes nothing else.
"""

from __future__ import annotations

from .rows import WELL_FORMED, WELL_FORMED_COLUMNS, well_formed

# 2: malformed rows are recorded in their own table by triggers (was: a partial index over
# ``NOT WELL_FORMED``); a catalog of version 1 is migrated when opened writable (``MIGRATE``).
SCHEMA_VERSION = "2"

DDL = """
CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS totals(
    id INTEGER PRIMARY KEY CHECK (id = 0),
    entries INTEGER NOT NULL, objects INTEGER NOT NULL, bytes INTEGER NOT NULL);
INSERT OR IGNORE INTO totals VALUES (0, 0, 0, 0);
CREATE TABLE IF NOT EXISTS entries(
    entry_id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    namespace TEXT NOT NULL,
    key TEXT NOT NULL,
    size INTEGER NOT NULL,
    manifest_size INTEGER NOT NULL,
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    hint TEXT NOT NULL CHECK (hint IN ('retain', 'release')),
    state TEXT NOT NULL CHECK (state IN ('pending', 'committed')),
    supersedes TEXT,
    index_json TEXT NOT NULL DEFAULT '{}'
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_ns ON entries(kind, namespace, hint);
CREATE INDEX IF NOT EXISTS entries_lru ON entries(hint, last_access);
CREATE TABLE IF NOT EXISTS entry_objects(
    entry_id TEXT NOT NULL, digest TEXT NOT NULL, PRIMARY KEY (entry_id, digest)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entry_objects_digest ON entry_objects(digest);
CREATE TABLE IF NOT EXISTS objects(digest TEXT PRIMARY KEY, size INTEGER NOT NULL) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS objects_ins AFTER INSERT ON objects BEGIN
    UPDATE totals SET objects = objects + 1, bytes = bytes + NEW.size WHERE id = 0; END;
CREATE TRIGGER IF NOT EXISTS objects_del AFTER DELETE ON objects BEGIN
    UPDATE totals SET objects = objects - 1, bytes = bytes - OLD.size WHERE id = 0; END;
CREATE TRIGGER IF NOT EXISTS entries_ins AFTER INSERT ON entries BEGIN
    UPDATE totals SET entries = entries + 1, bytes = bytes + NEW.manifest_size WHERE id = 0; END;
CREATE TRIGGER IF NOT EXISTS entries_del AFTER DELETE ON entries BEGIN
    UPDATE totals SET entries = entries - 1, bytes = bytes - OLD.manifest_size WHERE id = 0; END;
"""
# Entries and bytes per (kind, hint, state), kept by triggers like ``totals``: ``status``
# and the metrics read them in O(kinds) instead of grouping every row of the store. A
# catalog made before this table is filled once when first opened writable (``meta``
# ``kind_totals``); until then a read-only open groups the rows instead.
DDL += """
CREATE TABLE IF NOT EXISTS kind_totals(
    kind TEXT NOT NULL, hint TEXT NOT NULL, state TEXT NOT NULL,
    entries INTEGER NOT NULL, bytes INTEGER NOT NULL,
    PRIMARY KEY (kind, hint, state)) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS kind_totals_ins AFTER INSERT ON entries BEGIN
    INSERT INTO kind_totals VALUES (NEW.kind, NEW.hint, NEW.state, 1, NEW.size)
    ON CONFLICT(kind, hint, state) DO UPDATE
    SET entries = entries + 1, bytes = bytes + NEW.size; END;
CREATE TRIGGER IF NOT EXISTS kind_totals_del AFTER DELETE ON entries BEGIN
    UPDATE kind_totals SET entries = entries - 1, bytes = bytes - OLD.size
    WHERE kind = OLD.kind AND hint = OLD.hint AND state = OLD.state; END;
CREATE TRIGGER IF NOT EXISTS kind_totals_upd AFTER UPDATE OF kind, hint, state, size ON entries
BEGIN
    UPDATE kind_totals SET entries = entries - 1, bytes = bytes - OLD.size
    WHERE kind = OLD.kind AND hint = OLD.hint AND state = OLD.state;
    INSERT INTO kind_totals VALUES (NEW.kind, NEW.hint, NEW.state, 1, NEW.size)
    ON CONFLICT(kind, hint, state) DO UPDATE
    SET entries = entries + 1, bytes = bytes + NEW.size; END;
"""
# Pending rows (commits in flight or interrupted), indexed by themselves: every writable
# open looks for them, which must not scan a store of a million entries.
DDL += "CREATE INDEX IF NOT EXISTS entries_pending ON entries(entry_id) WHERE state='pending';\n"
# Released rows in id order, indexed by themselves: `clean` pages through them
# in O(released), not by walking every row of the store for each page.
DDL += "CREATE INDEX IF NOT EXISTS entries_released ON entries(entry_id) WHERE hint='release';\n"
_COMMON = DDL
# Version 1 kept malformed rows in a partial index over ``NOT WELL_FORMED``: building it
# evaluated the expression once more per row after a rebuild's load, the costliest step of
# the load. Kept here so that a version-1 file is recognised as ours
# (``check_schema``) and migrated.
DDL_V1 = _COMMON + ("CREATE INDEX IF NOT EXISTS entries_malformed ON entries(entry_id) "
                    f"WHERE NOT {WELL_FORMED};\n")
# Malformed rows, recorded by themselves: counting them (status, metrics) costs
# O(malformed), not a scan of the catalog. Triggers keep the table whatever writes a row
# (spoolctl, a person with ``sqlite3``); an UPDATE of the hint or state (every commit)
# cannot change the verdict and does not fire them. The expression never raises
# (rows.WELL_FORMED), so a trigger can never make a write fail. A bulk load (``load``)
# fills the table with one statement instead.
_NEW_OK = well_formed("NEW.")
DDL = _COMMON + f"""
CREATE TABLE IF NOT EXISTS malformed_rows(entry_id PRIMARY KEY) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS malformed_ins AFTER INSERT ON entries WHEN NOT {_NEW_OK}
BEGIN INSERT OR IGNORE INTO malformed_rows VALUES (NEW.entry_id); END;
CREATE TRIGGER IF NOT EXISTS malformed_upd AFTER UPDATE OF {WELL_FORMED_COLUMNS} ON entries
BEGIN
    DELETE FROM malformed_rows WHERE entry_id = OLD.entry_id;
    INSERT OR IGNORE INTO malformed_rows SELECT NEW.entry_id WHERE NOT {_NEW_OK}; END;
CREATE TRIGGER IF NOT EXISTS malformed_del AFTER DELETE ON entries BEGIN
    DELETE FROM malformed_rows WHERE entry_id = OLD.entry_id; END;
"""
# Every malformed row recorded afresh from the rows (a bulk load, the migration).
FILL_MALFORMED = ("INSERT OR IGNORE INTO malformed_rows SELECT entry_id FROM entries "
                  f"WHERE NOT {WELL_FORMED}")
# Version 1 -> 2, in one write transaction after ``DDL`` was applied (the table and its
# triggers exist, perhaps from an earlier attempt a crash cut short: the table is filled
# afresh). SQLite's DDL is transactional: a crash leaves version 1 with its index, and the
# next writable open migrates again.
MIGRATE_V1 = (
    "DROP INDEX IF EXISTS entries_malformed",
    "DELETE FROM malformed_rows",
    FILL_MALFORMED,
)

COLUMNS = (
    "entry_id, kind, namespace, key, size, manifest_size, created, last_access, hint, state, "
    "supersedes, index_json"
)
