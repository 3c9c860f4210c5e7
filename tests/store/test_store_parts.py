"""The store's parts on their own: SQLite error classification (by result code, with the
Python 3.10 fallback), checkpoint names, the publisher's batch steps, the facts snapshot
that status and metrics share, and the cleaning pass as data."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import faultseam
import pytest

from spoolctl import metrics
from spoolctl.store import (
    BusyError,
    ConfigError,
    QuarantineReason,
    Store,
    StoreIOError,
)
from spoolctl.store.disk import faults
from spoolctl.store.disk.publish import Publisher
from spoolctl.store.disk.sqlite_files import (
    SQLITE_BUSY,
    SQLITE_CORRUPT,
    SQLITE_ERROR,
    SQLITE_FULL,
    SQLITE_NOTADB,
    DamagedDatabaseError,
    error_code,
    is_damaged,
    sqlite_error,
)

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

# -- SQLite errors ----------------------------------------------------------------------------


def _real_error(path: Path, setup, query: str) -> sqlite3.DatabaseError:
    setup(path)
    db = sqlite3.connect(str(path), timeout=0)
    try:
        with pytest.raises(sqlite3.DatabaseError) as info:
            db.execute(query).fetchall()
    finally:
        db.close()
    return info.value


def test_real_sqlite_errors_are_classified_by_code(tmp_path: Path) -> None:
    garbage = _real_error(tmp_path / "a.db", lambda p: p.write_bytes(b"garbage" * 1000),
                          "SELECT * FROM sqlite_master")
    assert error_code(garbage) == SQLITE_NOTADB and is_damaged(garbage)

    def dropped(p: Path) -> None:
        db = sqlite3.connect(str(p))
        db.execute("CREATE TABLE t(x)")
        db.commit()
        db.close()

    missing = _real_error(tmp_path / "b.db", dropped, "SELECT * FROM entries")
    assert error_code(missing) == SQLITE_ERROR and is_damaged(missing)  # schema not ours

    holder = sqlite3.connect(str(tmp_path / "c.db"), isolation_level=None)
    holder.execute("CREATE TABLE t(x)")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        locked = _real_error(tmp_path / "c.db", lambda p: None, "SELECT * FROM t")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert error_code(locked) == SQLITE_BUSY and not is_damaged(locked)
    assert isinstance(sqlite_error(locked, tmp_path / "c.db"), BusyError)


@pytest.mark.parametrize(("text", "code", "damaged"), [
    ("file is not a database", SQLITE_NOTADB, True),
    ("database disk image is malformed", SQLITE_CORRUPT, True),
    ("malformed database schema (entries_ins)", SQLITE_CORRUPT, True),
    ("no such table: entries", SQLITE_ERROR, True),
    ("database is locked", SQLITE_BUSY, False),
    ("database or disk is full", SQLITE_FULL, False),
    ("disk I/O error", 10, False),
    ("unable to open database file", 14, False),
    ("attempt to write a readonly database", 8, False),
    ("Cannot operate on a closed database.", None, False),
])
def test_python_310_fallback_reads_the_code_from_the_message(text, code, damaged) -> None:
    exc = sqlite3.DatabaseError(text)  # what 3.10 raises: no sqlite_errorcode attribute
    assert getattr(exc, "sqlite_errorcode", None) is None
    assert error_code(exc) == code
    assert is_damaged(exc) is damaged


def test_codes_win_over_message_text() -> None:
    exc = sqlite3.OperationalError("database is locked")
    exc.sqlite_errorcode = SQLITE_CORRUPT | (1 << 8)  # extended code: primary in the low byte
    assert error_code(exc) == SQLITE_CORRUPT and is_damaged(exc)


def test_our_own_damage_checks_count_as_damage(tmp_path: Path) -> None:
    assert is_damaged(DamagedDatabaseError("catalog schema '0' is not '1'"))
    full = sqlite_error(sqlite3.OperationalError("database or disk is full"), tmp_path)
    assert isinstance(full, StoreIOError) and "No space left" in full.message


# -- checkpoints --------------------------------------------------------------------------------


def test_checkpoint_refuses_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown checkpoint"):
        faults.checkpoint("object.written_somewhere_new")
    for name in faults.CHECKPOINTS:
        faults.checkpoint(name)  # every listed name passes (no crash target set)


def test_unknown_crash_target_is_refused_at_start(tmp_path: Path) -> None:
    env = {**os.environ, faultseam.CRASH_ENV: "manifest.no_such_step"}
    # a process the tests start refuses as soon as the fault seam loads (at start-up)
    proc = subprocess.run([sys.executable, "-c", "from spoolctl.store import Store"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "unknown checkpoint 'manifest.no_such_step'" in proc.stderr
    with pytest.raises(ValueError, match="unknown checkpoint"):
        faultseam.install(fail_at="object.nowhere:EIO")


def test_every_checkpoint_the_store_passes_is_listed(store: Store) -> None:
    seen: list[str] = []
    store.checkpoint = lambda name: (seen.append(name), faults.checkpoint(name))
    m = store.put(kind="mlx", namespace="ns", key="k", objects={"a": b"x" * 10})
    store.release(m.entry_id)
    store.clean_released()
    assert seen and set(seen) <= faults.CHECKPOINTS
    assert [p for p in seen if p in faults.COMMIT_CHECKPOINTS] == list(faults.COMMIT_CHECKPOINTS)


# -- publishing --------------------------------------------------------------------------------


def test_a_batch_renames_many_files_and_syncs_each_directory_once(tmp_path: Path) -> None:
    root = Path(os.path.realpath(tmp_path))
    (root / "tmp").mkdir()
    for fan in ("aa", "bb"):
        (root / "objects" / fan).mkdir(parents=True)
    marks: list[str] = []
    pub = Publisher(root, root / "tmp", marks.append)
    staged = [pub.stage([f"payload {i}".encode()], what="object") for i in range(4)]
    assert marks.count("object.fsynced") == 4
    assert not list((root / "objects").rglob("*.obj"))  # staged: nothing visible yet
    finals = [root / "objects" / ("aa" if i % 2 else "bb") / f"{s.digest}.obj"
              for i, s in enumerate(staged)]
    placed: list[Path] = []
    for s, final in zip(staged, finals, strict=True):
        pub.place(s.tmp, final, what="object", placed=placed)
    pub.sync([f.parent for f in finals], what="object")
    assert placed == finals and all(f.read_bytes().startswith(b"payload") for f in finals)
    assert marks.count("object.published") == 4
    assert marks.count("object.dir_fsynced") == 2  # two directories, one fsync each
    assert list((root / "tmp").iterdir()) == []


def test_publish_refuses_a_directory_swapped_for_a_symlink(tmp_path: Path) -> None:
    root = Path(os.path.realpath(tmp_path)) / "root"
    (root / "tmp").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "objects").symlink_to(tmp_path / "elsewhere")
    pub = Publisher(root, root / "tmp", lambda name: None)
    staged = pub.stage([b"data"], what=None)
    with pytest.raises(StoreIOError, match="symlink"), \
            pub.failing(staged, "publishing an object", root / "objects" / "x.obj"):
        pub.publish(staged.tmp, root / "objects" / "x.obj", what=None)
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert list((root / "tmp").iterdir()) == []  # the staged file was discarded


# -- facts: one snapshot for status and metrics ---------------------------------------------------


def test_status_and_metrics_report_the_same_facts(store: Store) -> None:
    from spoolctl.cli.store_status import status_doc

    a = store.put(kind="mlx", namespace="ns", key="a", objects={"a": b"x" * 1000})
    store.put(kind="vllm", namespace="ns", key="b", objects={"a": b"y" * 3000})
    store.release(a.entry_id)
    store.quarantine_entry(store.put(kind="mlx", namespace="ns", key="c",
                                     objects={"a": b"z"}).entry_id,
                           QuarantineReason.PAYLOAD_DIGEST, "test")
    facts = store.facts()
    doc = status_doc(store, facts)
    samples = {(s.spec.name, s.labels): s.value for s in metrics.store_gauges(facts)}
    assert samples[(metrics.STORE_ENTRIES.name, ())] == doc["entries"] == 2
    assert samples[(metrics.STORE_BYTES.name, ())] == doc["bytes"]
    assert samples[(metrics.RELEASED_ENTRIES.name, ())] == doc["released"]["entries"] == 1
    assert samples[(metrics.QUARANTINED_BYTES.name, ())] == doc["quarantined"]["bytes"]
    reason = ((metrics.QUARANTINED_ITEMS.name, (("reason", "payload_digest"),)))
    assert samples[reason] == doc["quarantined"]["by_reason"]["payload_digest"] == 1
    kind = (metrics.KIND_BYTES.name, (("kind", "vllm"),))
    assert samples[kind] == doc["by_kind"]["vllm"]["bytes"]
    assert facts.needs_attention  # a quarantined item is a finding


# -- cleaning as data ------------------------------------------------------------------------------


def test_clean_plans_as_data_then_deletes_the_same(store: Store) -> None:
    for key in ("a", "b", "c"):
        m = store.put(kind="mlx", namespace="ns", key=key, objects={"a": key.encode() * 100})
        if key != "c":
            store.release(m.entry_id)
    plan = store.clean(["released", "orphans"], min_age=0, dry_run=True)
    assert list(plan.steps_json()) == ["released", "orphans"]
    assert plan.to_json()["total"]["entries"] == 2 and len(store.entries()) == 3
    done = store.clean(["orphans", "released"], min_age=0)  # steps run in their fixed order
    assert done.deleted["released"].entries == 2
    assert sorted(done.deleted["released"].entry_ids) == sorted(plan.deleted["released"].entry_ids)
    assert [r.key for r in store.entries()] == ["c"]
    with pytest.raises(ConfigError, match="unknown clean step"):
        store.clean(["everything"], min_age=0)
