"""The catalog's schema: its tables, indexes and triggers (``DDL``) and the column order of
an ``entries`` row (``COLUMNS``). Kept apart from ``catalog`` (the typed access) so a bulk
load (``catalog_load``) and the catalog share one definition.

Every statement is ``IF NOT EXISTS``: applying ``DDL`` to a catalog made by an older
spoolctl adds what it lacks (indexes, triggers, tables) and changes nothing else.
"""

from __future__ import annotations

from .rows import WELL_FORMED

SCHEMA_VERSION = "1"

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
# Released rows in id order, indexed by themselves: `clean` pages through them (decision
# 1406) in O(released), not by walking every row of the store for each page.
DDL += "CREATE INDEX IF NOT EXISTS entries_released ON entries(entry_id) WHERE hint='release';\n"
# Malformed rows, indexed by themselves: counting them (status, metrics) costs O(malformed),
# not a scan of the catalog. The expression never raises (rows.WELL_FORMED), so maintaining
# the index can never make a write fail.
DDL += ("CREATE INDEX IF NOT EXISTS entries_malformed ON entries(entry_id) "
         f"WHERE NOT {WELL_FORMED};\n")

COLUMNS = (
    "entry_id, kind, namespace, key, size, manifest_size, created, last_access, hint, state, "
    "supersedes, index_json"
)
