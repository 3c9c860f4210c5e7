"""The catalog at scale: per-kind totals kept by triggers, pending rows by index, id paging.

``status`` and the metrics read entries and bytes per kind from ``kind_totals`` (O(kinds))
instead of grouping every row of a million-entry store, so the table must always equal the
GROUP BY it replaces: after every kind of write, and for a catalog made before the table
existed (filled once when opened writable; a read-only open groups the rows). Query plans,
not times, show that pending rows, the newest rows and cleanup pages need no scan.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from query_plans import query_plans

from spoolctl.store import PutRequest, QuarantineReason, Store, entry_id_for
from spoolctl.store.maintain import gc as gc_mod


def _grouped(db: sqlite3.Connection) -> dict[tuple[str, str, str], tuple[int, int]]:
    return {(k, h, s): (n, b) for k, h, s, n, b in db.execute(
        "SELECT kind, hint, state, COUNT(*), SUM(size) FROM entries GROUP BY kind, hint, state")}


def _kept(db: sqlite3.Connection) -> dict[tuple[str, str, str], tuple[int, int]]:
    return {(k, h, s): (n, b) for k, h, s, n, b in db.execute(
        "SELECT kind, hint, state, entries, bytes FROM kind_totals WHERE entries != 0 "
        "OR bytes != 0")}


def _expected_by_kind(db: sqlite3.Connection) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for kind, hint, n, b in db.execute(
            "SELECT kind, hint, COUNT(*), SUM(size) FROM entries WHERE state='committed' "
            "GROUP BY kind, hint"):
        slot = out.setdefault(kind, {"entries": 0, "bytes": 0, "released": 0})
        slot["entries"] += n
        slot["bytes"] += b
        slot["released"] += n if hint == "release" else 0
    return out


def _expected_released(db: sqlite3.Connection) -> tuple[int, int]:
    n, b = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries "
                      "WHERE hint='release'").fetchone()
    return n, b


def _check(store: Store) -> None:
    db = store.catalog.connection_for_inspection()
    assert _kept(db) == _grouped(db)
    assert store.by_kind() == _expected_by_kind(db)
    assert store.released() == _expected_released(db)


def _put(store: Store, kind: str, key: str, size: int = 100, **kw) -> str:
    store.put(kind=kind, namespace="ns", key=key, objects={"o": key.encode() * size}, **kw)
    return entry_id_for(kind, "ns", key)


def test_kind_totals_follow_every_write(store: Store) -> None:
    ids = [_put(store, kind, f"{kind}{i}", size=10 + i) for kind in ("vllm", "genai", "mlx")
           for i in range(6)]
    _check(store)
    outcomes = store.put_many([
        PutRequest("vllm", "ns", f"batch{i}", {"o": b"b" * (50 + i)}) for i in range(5)
    ] + [PutRequest("vllm", "ns", "bad key \x00", {"o": b"x"})])
    assert [o.status for o in outcomes] == ["committed"] * 5 + ["failed"]
    _check(store)
    assert store.by_kind()["vllm"]["entries"] == 11
    for entry_id in ids[:4]:
        assert store.release(entry_id)
    _check(store)
    _put(store, "vllm", "v2", supersedes=ids[5])  # releases what it supersedes
    _check(store)
    _put(store, "vllm", "vllm0")  # revives a released entry
    _check(store)
    store.quarantine_entry(ids[7], QuarantineReason.MANIFEST_VALIDATION, "test")
    _check(store)
    assert store.delete_released([ids[1]]).entries == 1
    _check(store)
    assert store.clean_released().entries >= 2
    _check(store)
    assert store.by_kind()["vllm"]["released"] == 0
    store.set_max_bytes(store.totals().bytes // 2)
    assert store.enforce_capacity().entries > 0
    _check(store)
    assert sum(s["entries"] for s in store.by_kind().values()) == store.totals().entries


def _make_old(root: Path) -> None:
    """Turn the store's catalog into one made before ``kind_totals`` and
    ``entries_pending`` existed, then write to it as an older spoolctl would (no triggers)."""
    db = sqlite3.connect(root / "state" / "catalog.sqlite3")
    with db:
        for trigger in ("kind_totals_ins", "kind_totals_del", "kind_totals_upd"):
            db.execute(f"DROP TRIGGER {trigger}")
        db.execute("DROP TABLE kind_totals")
        db.execute("DROP INDEX entries_pending")
        db.execute("DELETE FROM meta WHERE k='kind_totals'")
        db.execute("UPDATE entries SET hint='release' WHERE key IN ('vllm1', 'genai2')")
    db.close()


def test_catalog_made_before_kind_totals(store_root: Path) -> None:
    with Store.open(store_root, create=True) as s:
        for kind in ("vllm", "genai"):
            for i in range(5):
                _put(s, kind, f"{kind}{i}", size=20 + i)
    _make_old(store_root)
    catalog = store_root / "state" / "catalog.sqlite3"
    with sqlite3.connect(catalog) as db:
        by_kind, released = _expected_by_kind(db), _expected_released(db)
    assert released[0] == 2 and by_kind["vllm"]["released"] == 1

    with Store.open(store_root, read_only=True) as ro:  # groups the rows, writes nothing
        assert ro.by_kind() == by_kind
        assert ro.released() == released
        assert ro.catalog.pending() == []
        assert ro.facts().to_json()["by_kind"] == by_kind
    with sqlite3.connect(catalog) as db:
        assert db.execute("SELECT name FROM sqlite_master WHERE name IN "
                          "('kind_totals', 'entries_pending')").fetchall() == []

    with Store.open(store_root) as s:  # writable: the table is made and filled once
        _check(s)
        assert s.by_kind() == by_kind
        _put(s, "vllm", "after-upgrade")
        s.release(entry_id_for("genai", "ns", "genai0"))
        _check(s)
    with Store.open(store_root, read_only=True) as ro:  # now read from kind_totals
        assert ro.catalog.has_kind_totals
        with sqlite3.connect(catalog) as db:
            assert ro.by_kind() == _expected_by_kind(db)
            assert ro.released() == _expected_released(db) == (3, ro.released()[1])


def test_pending_rows_come_from_their_index(store: Store) -> None:
    for i in range(30):
        _put(store, "vllm", f"k{i}")
    plans = query_plans(store, store.catalog.pending)
    assert plans and all("entries_pending" in p and "SCAN entries" not in p.replace(
        "SCAN entries USING INDEX entries_pending", "") for p in plans), plans
    with store.catalog.write_transaction() as db:  # an interrupted commit, as a crash leaves it
        db.execute("UPDATE entries SET state='pending' WHERE key='k3'")
    assert store.catalog.pending() == [entry_id_for("vllm", "ns", "k3")]


def test_newest_rows_walk_the_lru_index(store: Store) -> None:
    ids = [_put(store, "vllm", f"k{i}") for i in range(12)]
    with store.catalog.write_transaction() as db:  # distinct access times, interleaving both hints
        for n, entry_id in enumerate(ids):
            db.execute("UPDATE entries SET last_access=?, hint=? WHERE entry_id=?",
                       (1000.0 + n, "release" if n % 3 == 0 else "retain", entry_id))
    everything = store.entries(sort="access")
    assert [r.entry_id for r in everything] == ids[::-1]
    newest = store.entries(sort="access", limit=5)
    assert [r.entry_id for r in newest] == ids[::-1][:5]
    assert [r.entry_id for r in store.entries(sort="access", limit=3, hint="release")] == \
        [ids[9], ids[6], ids[3]]
    for plan in query_plans(store, lambda: store.entries(sort="access", limit=5)):
        assert "entries_lru" in plan and "TEMP B-TREE" not in plan, plan


def test_released_pages_walk_the_released_index(store: Store) -> None:
    """Clean pages through released rows by id on their own partial index (decision 1406),
    never sorting a page, and gets only what it may delete: committed rows, not held for
    a remote delete, with each manifest's size."""
    ids = sorted(_put(store, "vllm", f"k{i}") for i in range(10))
    kept = sorted(_put(store, "vllm", f"keep{i}") for i in range(10))
    for entry_id in ids:
        store.release(entry_id)
    with store.catalog.write_transaction() as db:  # one held for a remote delete, one mid-commit
        db.execute("UPDATE entries SET index_json='{\"remote_pending\": true}' "
                   "WHERE entry_id=?", (ids[1],))
        db.execute("UPDATE entries SET state='pending' WHERE entry_id=?", (ids[2],))
    got, after = [], ""
    while page := store.catalog.released_page(after, 3):
        got += page
        after = page[-1][0]
    assert [e for e, _ in got] == [e for e in ids if e not in (ids[1], ids[2])]
    assert all(size == store.layout.manifest_path(e).stat().st_size for e, size in got)
    assert not set(kept) & {e for e, _ in got}
    plans = query_plans(store, lambda: store.catalog.released_page(ids[2], 3))
    assert plans
    for plan in plans:
        assert "INDEX entries_released (entry_id>?)" in plan and "TEMP B-TREE" not in plan, \
            plan


def test_a_catalog_without_the_released_index_still_pages_read_only(store_root: Path) -> None:
    """A catalog made before the released index (opened read-only, so not upgraded) pages
    released rows by the primary key instead."""
    import sqlite3

    with Store.open(store_root, create=True) as s:
        ids = sorted(_put(s, "vllm", f"k{i}") for i in range(5))
        for entry_id in ids:
            s.release(entry_id)
    db = sqlite3.connect(store_root / "state" / "catalog.sqlite3")
    db.execute("DROP INDEX entries_released")
    db.commit()
    db.close()
    with Store.open(store_root, read_only=True) as s:
        assert [e for e, _ in s.catalog.released_page("", 100)] == ids
        for plan in query_plans(s, lambda: s.catalog.released_page(ids[0], 3)):
            assert "PRIMARY KEY (entry_id>?)" in plan and "TEMP B-TREE" not in plan, plan


def test_clean_pages_in_id_order_and_ends_with_an_undeletable_manifest(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc_mod, "DELETE_BATCH", 3)
    ids = sorted(_put(store, "vllm", f"k{i}") for i in range(11))
    kept = ids[4]
    for entry_id in ids:
        store.release(entry_id)
    # A manifest that cannot be unlinked (a directory in its place; root ignores modes).
    path = store.layout.manifest_path(kept)
    sizes = {e: store.catalog.get(e).size for e in ids}  # objects + manifest
    path.unlink()
    path.mkdir()
    (path / "x").write_bytes(b"")
    deleted: list[list[str]] = []
    pages = 0
    real_delete, real_page = store.catalog.delete_entries, store.catalog.released_page

    def spy_delete(entry_ids):
        deleted.append(list(entry_ids))
        return real_delete(entry_ids)

    def counting_page(after, limit):
        nonlocal pages
        pages += 1
        assert pages <= 10, "clean keeps asking for the same rows"
        return real_page(after, limit)

    monkeypatch.setattr(store.catalog, "delete_entries", spy_delete)
    monkeypatch.setattr(store.catalog, "released_page", counting_page)
    report = store.clean_released()
    flat = [e for batch in deleted for e in batch]
    assert flat == [e for e in ids if e != kept]  # id order, each once
    assert report.entries == 10 and str(path) in report.failed
    # The bytes freed: every deleted manifest (sizes from the catalog) and object.
    assert report.objects == 10
    assert report.bytes == sum(sizes[e] for e in ids if e != kept)
    assert pages == 4  # ceil(11 / 3) pages, the last one short
    monkeypatch.undo()
    assert [r.entry_id for r in store.entries(hint="release")] == [kept]
    assert store.clean_released().entries == 0  # still there, still terminates


def _schema(db) -> set[tuple[str, str]]:
    return {(t, n) for t, n in db.execute(
        "SELECT type, name FROM sqlite_master WHERE type IN ('index', 'trigger') "
        "AND sql IS NOT NULL")}


def test_rebuild_loads_every_manifest_with_indexes_triggers_and_totals(
        store_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebuild loads in bulk (decision 1405): afterwards the catalog has every manifest,
    the same totals, every index and trigger (writes keep the totals right again), and
    manifests that do not decode are quarantined on the way."""
    from spoolctl.store.maintain import recovery

    monkeypatch.setattr(recovery, "PREFETCH_SAMPLE", 0)  # prefetch every directory
    with Store.open(store_root, create=True) as s:
        ids = sorted(_put(s, kind, f"{kind}{i}", size=30 + i) for kind in ("vllm", "mlx")
                     for i in range(40))
        assert s.release(ids[0])
        before, schema = s.totals(), _schema(s.catalog.connection_for_inspection())
        bad = s.layout.manifest_path(ids[-1])
    bad.write_bytes(bad.read_bytes()[:-20])  # truncated: quarantined by the rebuild
    for suffix in ("", "-wal", "-shm"):
        (store_root / "state" / f"catalog.sqlite3{suffix}").unlink(missing_ok=True)
    with Store.open(store_root) as s:
        assert sorted(r.entry_id for r in s.entries()) == ids[:-1]
        # the release survives (state/hints.log); every other entry is retained
        assert [r.entry_id for r in s.entries() if r.hint != "retain"] == [ids[0]]
        assert s.totals().entries == before.entries - 1
        assert _schema(s.catalog.connection_for_inspection()) == schema
        _check(s)
        assert [i.entry_id for i in s.quarantine_items()] == [ids[-1]]
        for entry_id in ids[:-1]:
            s.verify(entry_id)
        _put(s, "genai", "after")  # the triggers are back: totals follow new writes
        assert s.release(ids[1])
        _check(s)
        assert s.totals().entries == before.entries


def test_a_rebuild_that_fails_midway_leaves_the_catalog_as_it_was(
        store_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load is one transaction: a failure while reading the manifests leaves the empty
    catalog with its indexes and triggers (never a half-loaded one without them), and the
    next open rebuilds it."""
    from spoolctl.store.maintain import recovery

    with Store.open(store_root, create=True) as s:
        ids = sorted(_put(s, "vllm", f"k{i}") for i in range(60))
        schema = _schema(s.catalog.connection_for_inspection())
    for suffix in ("", "-wal", "-shm"):
        (store_root / "state" / f"catalog.sqlite3{suffix}").unlink(missing_ok=True)
    real, calls = recovery._read_fan, []

    def failing(fan: Path):
        calls.append(fan)
        if len(calls) == 5:
            raise OSError(5, "Input/output error")
        return real(fan)
    monkeypatch.setattr(recovery, "_read_fan", failing)
    with pytest.raises(OSError, match="Input/output error"):
        Store.open(store_root)
    import sqlite3

    db = sqlite3.connect(store_root / "state" / "catalog.sqlite3")
    assert db.execute("SELECT COUNT(*) FROM entries").fetchone() == (0,)
    assert db.execute("SELECT entries FROM totals").fetchone() == (0,)
    assert _schema(db) == schema
    db.close()
    monkeypatch.undo()
    with Store.open(store_root) as s:  # no longer fresh, but empty with manifests: rebuilt
        assert sorted(r.entry_id for r in s.entries()) == ids
        _check(s)
