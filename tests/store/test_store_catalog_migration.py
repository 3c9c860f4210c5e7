"""Catalog schema 2 (decision 2920): malformed rows are recorded in ``malformed_rows`` by
triggers instead of a partial index over ``NOT WELL_FORMED``.

The table must always hold exactly the rows the expression calls malformed, whatever wrote
them (spoolctl, a person with ``sqlite3``, a rebuild), and a catalog written by the previous
version must open: read as it is by a read-only open, migrated once by a writable one with
its rows, hints and clocks kept (a migration, not a rebuild), and a crash in the middle of
the migration (a real process killed there) must leave a catalog that still opens and is
migrated by the next open.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from faultseam import CRASH_EXIT_CODE
from operator_cli import run

from spoolctl.store import Store, entry_id_for
from spoolctl.store.catalog.rows import WELL_FORMED
from spoolctl.store.catalog.schema import DDL_V1, SCHEMA_VERSION
from spoolctl.store.format.manifest import Manifest, encode


def _put(store: Store, key: str) -> str:
    store.put(kind="mlx", namespace="ns", key=key, objects={"o": key.encode() * 20})
    return entry_id_for("mlx", "ns", key)


def _by_scan(db: sqlite3.Connection) -> set:
    return {r[0] for r in db.execute(f"SELECT entry_id FROM entries WHERE NOT {WELL_FORMED}")}


def _recorded(db: sqlite3.Connection) -> set:
    return {r[0] for r in db.execute("SELECT entry_id FROM malformed_rows")}


def _names(db: sqlite3.Connection) -> set[str]:
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master")}


def test_malformed_rows_follow_every_write(store: Store) -> None:
    db = store.catalog.connection_for_inspection()
    ids = [_put(store, f"k{i}") for i in range(6)]
    assert _recorded(db) == _by_scan(db) == set() and store.malformed_count() == 0
    # Hand edits of the kinds people make: each breaks one rule of WELL_FORMED.
    db.execute("UPDATE entries SET index_json='not json' WHERE entry_id=?", (ids[0],))
    db.execute("UPDATE entries SET size=-1 WHERE entry_id=?", (ids[1],))
    db.execute("UPDATE entries SET entry_id=? WHERE entry_id=?", (ids[2].upper(), ids[2]))
    db.execute("INSERT INTO entries SELECT 'x' || entry_id, kind, namespace, key, size, "
               "manifest_size, created, last_access, hint, state, supersedes, index_json "
               "FROM entries WHERE entry_id=?", (ids[3],))
    bad = {ids[0], ids[1], ids[2].upper(), "x" + ids[3]}
    assert _recorded(db) == _by_scan(db) == bad
    assert store.malformed_count() == 4
    assert {e for e, _ in store.catalog.malformed(10)} == bad
    # Writes that cannot change the verdict (state, hint) keep it; repairs and deletes drop it.
    store.release(ids[4])
    db.execute("UPDATE entries SET state='committed', hint='release' WHERE entry_id=?",
               (ids[0],))
    db.execute("UPDATE entries SET size=10 WHERE entry_id=?", (ids[1],))
    db.execute("DELETE FROM entries WHERE entry_id=?", ("x" + ids[3],))
    store.touch([ids[5]])
    assert _recorded(db) == _by_scan(db) == {ids[0], ids[2].upper()}
    report = store.collect_orphans(min_age=0)  # re-indexes malformed rows from manifests
    assert report.repaired_rows == 1  # the upper-case id has no manifest: its row is dropped
    assert _recorded(db) == _by_scan(db) == set() and store.malformed_count() == 0


def _make_v1(root: Path) -> None:
    """Turn the catalog into what the previous spoolctl wrote (schema 1)."""
    db = sqlite3.connect(root / "state" / "catalog.sqlite3", isolation_level=None)
    for name in ("malformed_ins", "malformed_upd", "malformed_del"):
        db.execute(f"DROP TRIGGER {name}")
    db.execute("DROP TABLE malformed_rows")
    db.execute(DDL_V1.strip().splitlines()[-1])  # the partial index of version 1
    db.execute("UPDATE meta SET v='1' WHERE k='schema'")
    db.close()


def _old_store(root: Path) -> tuple[list[str], dict[str, tuple]]:
    """A schema-1 store: entries, one released, one malformed row; (ids, rows as stored)."""
    with Store.open(root, create=True) as s:
        ids = [_put(s, f"k{i}") for i in range(8)]
        s.release(ids[1])
        s.catalog.connection_for_inspection().execute(
            "UPDATE entries SET index_json='[' WHERE entry_id=?", (ids[2],))
    _make_v1(root)
    db = sqlite3.connect(root / "state" / "catalog.sqlite3")
    rows = {r[0]: r for r in db.execute("SELECT * FROM entries")}
    assert "entries_malformed" in _names(db) and "malformed_rows" not in _names(db)
    db.close()
    return ids, rows


def _assert_migrated(root: Path, ids: list[str], rows: dict[str, tuple]) -> None:
    db = sqlite3.connect(root / "state" / "catalog.sqlite3")
    assert db.execute("SELECT v FROM meta WHERE k='schema'").fetchone() == (SCHEMA_VERSION,)
    assert "entries_malformed" not in _names(db)
    assert _recorded(db) == _by_scan(db) == {ids[2]}
    # Migrated, not rebuilt: every row as it was (the release and the clocks kept).
    assert {r[0]: r for r in db.execute("SELECT * FROM entries")} == rows
    db.close()
    assert not (root / "quarantine").exists() or not any((root / "quarantine").iterdir())


def test_a_catalog_of_the_previous_version_is_read_then_migrated_once(
        store_root: Path) -> None:
    ids, rows = _old_store(store_root)
    _, out, _ = run("doctor", "--root", str(store_root), "--json")  # reads, never migrates
    check = {c["name"]: c for c in json.loads(out)["checks"]}["sqlite.catalog.sqlite3"]
    assert check["status"] == "ok", check  # version 1's objects are ours, not damage
    with Store.open(store_root, read_only=True) as ro:  # cannot migrate: reads it as it is
        assert ro.malformed_count() == 1
        assert [e for e, _ in ro.catalog.malformed(5)] == [ids[2]]
        assert ro.released()[0] == 1
    with Store.open(store_root) as s:
        assert s.malformed_count() == 1
        assert s.lookup("mlx", "ns", "k0") is not None
    _assert_migrated(store_root, ids, rows)
    with Store.open(store_root) as s:  # once: the next open finds version 2
        _put(s, "after")
        assert s.malformed_count() == 1


def test_a_crash_in_the_middle_of_the_migration_leaves_a_usable_catalog(
        store_root: Path) -> None:
    ids, rows = _old_store(store_root)
    env = {**os.environ, "SPOOLCTL_CRASH_AT": "catalog.migrated"}
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from spoolctl.store import Store; "
         "Store.open(sys.argv[1]).close()", str(store_root)],
        env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == CRASH_EXIT_CODE, proc.stderr
    db = sqlite3.connect(store_root / "state" / "catalog.sqlite3")
    assert db.execute("SELECT v FROM meta WHERE k='schema'").fetchone() == ("1",)
    assert "entries_malformed" in _names(db)  # the transaction was rolled back whole
    db.close()
    with Store.open(store_root, read_only=True) as ro:
        assert ro.malformed_count() == 1 and ro.released()[0] == 1
    with Store.open(store_root) as s:
        assert s.malformed_count() == 1
    _assert_migrated(store_root, ids, rows)


def test_a_rebuild_records_the_malformed_rows_its_manifests_make(store_root: Path) -> None:
    """A manifest may carry an index fact of the wrong type (another tool wrote it): the
    rebuild's bulk load fills ``malformed_rows`` in one pass, as the triggers would have."""
    with Store.open(store_root, create=True) as s:
        ids = [_put(s, f"k{i}") for i in range(4)]
        odd = Manifest.new(kind="genai", namespace="ns", key="odd", created=1.0, objects=(),
                           index={"expire_time": "soon"})
        path = s.layout.manifest_path(odd.entry_id)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(encode(odd))
        path.chmod(0o600)
    for suffix in ("", "-wal", "-shm"):
        (store_root / "state" / f"catalog.sqlite3{suffix}").unlink(missing_ok=True)
    with Store.open(store_root) as s:
        db = s.catalog.connection_for_inspection()
        assert {r[0] for r in db.execute("SELECT entry_id FROM entries")} == {*ids,
                                                                          odd.entry_id}
        assert _recorded(db) == _by_scan(db) == {odd.entry_id}
        assert s.malformed_count() == 1
