"""Issue 15.7: one bad catalog row never stops the cron job.

A row with a malformed value (a GenAI record whose ``expire_time`` is text, an index that
is not JSON, a size that is not a number, an id that is not hex) used to make every
``spoolctl clean`` fail, so no released entry was deleted again. Rows are validated one by
one: a bad one is skipped, reported (clean's JSON, ``status``, the
``spoolctl_store_malformed_rows`` gauge, a ``doctor`` finding) and the rest is cleaned;
``clean --orphans`` re-indexes it from its manifest, keeping the catalog-only facts that
are still good (a pending remote delete is not forgotten)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from operator_cli import run, run_json

from spoolctl.store import ConfigError, Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

GENAI_NS = "gemini-" + "0" * 24


def _edit(root: Path, sql: str, *params) -> None:
    """What an operator with ``sqlite3`` (or a damaged disk) does to the catalog."""
    db = sqlite3.connect(root / "state" / "catalog.sqlite3")
    with db:
        db.execute(sql, params)
    db.close()


@pytest.fixture
def root(store_root: Path) -> tuple[Path, dict[str, str]]:
    ids = {}
    with Store.open(store_root, create=True) as store:
        for name in ("a", "b", "c"):
            m = store.put(kind="pytorch", namespace="ns", key=name, objects={"kv": b"x" * 500})
            store.release(m.entry_id)
            ids[name] = m.entry_id
        g = store.put(kind="genai", namespace=GENAI_NS, key="ctl/cachedContents/g1",
                      objects={}, meta={"name": "cachedContents/g1"},
                      index={"name": "cachedContents/g1", "expire_time": 4e9})
        store.update_index(g.entry_id, {"remote_pending": True})
        ids["genai"] = g.entry_id
        ids["keep"] = store.put(kind="pytorch", namespace="ns", key="keep",
                                objects={"kv": b"k" * 500}).entry_id
    return store_root, ids


def test_a_malformed_genai_record_does_not_stop_clean(root) -> None:
    store_root, ids = root
    _edit(store_root, "UPDATE entries SET index_json=json_set(index_json, '$.expire_time', "
          "'soon') WHERE entry_id=?", ids["genai"])
    _edit(store_root, "UPDATE entries SET size='big' WHERE entry_id=?", ids["a"])
    doc = run_json("clean", "--yes", "--root", str(store_root), expect=1)  # 1: findings
    assert doc["steps"]["released"]["entries"] == 2  # b and c; a is skipped
    assert doc["malformed_rows"]["count"] == 2
    reasons = {r["entry_id"]: r["reason"] for r in doc["malformed_rows"]["rows"]}
    assert "expire_time is not a number" in reasons[ids["genai"]]
    assert "size" in reasons[ids["a"]]
    assert doc["steps"]["orphans"]["repaired_rows"] == 2  # re-indexed from the manifests
    with Store.open(store_root) as store:
        assert store.malformed_count() == 0
        genai = store.row(ids["genai"])
        assert genai.index["expire_time"] == 4e9 and genai.index["remote_pending"] is True
        assert store.row(ids["a"]).hint == "release"  # the hint survived the repair
        assert store.row(ids["keep"]) is not None
    again = run_json("clean", "--yes", "--root", str(store_root))
    assert again["steps"]["released"]["entries"] == 1 and again["malformed_rows"]["count"] == 0


@pytest.mark.parametrize(("column", "value", "why"), [
    ("index_json", "{not json", "index is not a JSON object"),
    ("created", "yesterday", "created or last_access"),
    ("entry_id", "../../etc/passwd", "entry_id"),
    ("kind", "tensorflow", "kind"),
])
def test_every_reader_skips_and_reports_a_bad_row(root, column: str, value: str,
                                                  why: str) -> None:
    store_root, ids = root
    _edit(store_root, f"UPDATE entries SET {column}=? WHERE entry_id=?", value, ids["b"])
    status = run_json("status", "--root", str(store_root))
    assert status["malformed_rows"] == 1
    code, out, _ = run("status", "--check", "--root", str(store_root))
    assert code == 1 and "malformed rows" in out
    code, out, err = run("metrics", "--root", str(store_root))
    assert code == 0 and "spoolctl_store_malformed_rows 1.0" in out, err
    doctor = run_json("doctor", "--root", str(store_root), expect=1)
    rows = {c["name"]: c for c in doctor["checks"]}["catalog.rows"]
    assert rows["status"] == "fail" and why in rows["detail"] and "--orphans" in rows["fix"]
    listed = run_json("ls", "--root", str(store_root))
    assert listed["count"] == 4  # everything but the bad row
    dry = run_json("clean", "--yes", "--dry-run", "--root", str(store_root), expect=1)
    assert dry["malformed_rows"]["count"] == 1
    doc = run_json("clean", "--yes", "--root", str(store_root), expect=1)
    assert "errors" not in doc or not doc["errors"]
    with Store.open(store_root) as store:
        assert store.malformed_count() == 0
        assert {r.entry_id for r in store.entries(hint="release")} <= {ids["b"]}


def test_clients_cannot_write_a_malformed_fact(store_root: Path) -> None:
    with Store.open(store_root, create=True) as store:
        g = store.put(kind="genai", namespace=GENAI_NS, key="k", objects={},
                      index={"expire_time": 1e9})
        with pytest.raises(ConfigError, match="expire_time is not a number"):
            store.update_index(g.entry_id, {"expire_time": "soon"})
        with pytest.raises(ConfigError, match="remote_pending is not true or false"):
            store.update_index(g.entry_id, {"remote_pending": "yes"})
        with pytest.raises(ConfigError, match="expire_time"):
            store.put(kind="genai", namespace=GENAI_NS, key="k2", objects={},
                      index={"expire_time": [1]})
        assert store.malformed_count() == 0


def test_a_malformed_index_never_makes_a_remote_record_deletable(root) -> None:
    store_root, ids = root
    # the remote delete is still owed; the index is damaged so that fact cannot be read
    _edit(store_root, "UPDATE entries SET index_json='{\"remote_pending\": tru' "
          "WHERE entry_id=?", ids["genai"])
    with Store.open(store_root) as store:
        store.release(ids["genai"])
        assert store.clean_released().entries == 3  # a, b, c: never the held record
        assert store.row(ids["genai"]) is None  # skipped by readers until repaired
    doc = run_json("clean", "--yes", "--root", str(store_root), expect=1)
    assert doc["steps"]["orphans"]["repaired_rows"] == 1
    with Store.open(store_root) as store:
        # its facts are lost: the record comes back retained (nothing deleted on a guess)
        row = store.row(ids["genai"])
        assert row.hint == "retain" and row.index["expire_time"] == 4e9
