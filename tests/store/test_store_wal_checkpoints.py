"""Background WAL checkpoints during a clean (decision 1407): the cleaning thread's
commits no longer checkpoint, a helper thread does between them, the log restarts at each
write instead of growing, and the connection's own setting comes back afterwards."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from spoolctl.store import Store
from spoolctl.store.disk.wal_checkpoints import BackgroundCheckpoints
from spoolctl.store.maintain import gc as gc_mod


def _autocheckpoint(store: Store) -> int:
    db = store.catalog.connection_for_inspection()
    return int(db.execute("PRAGMA wal_autocheckpoint").fetchone()[0])


def _wal(store: Store) -> Path:
    return Path(f"{store.catalog.path}-wal")


def _fill(store: Store, n: int) -> list[str]:
    ids = []
    for i in range(n):
        m = store.put(kind="vllm", namespace="ns", key=f"k{i}", objects={"o": b"%d" % i * 50})
        ids.append(m.entry_id)
    return ids


def test_clean_checkpoints_on_a_helper_thread_and_keeps_the_log_bounded(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc_mod, "DELETE_BATCH", 20)
    ids = _fill(store, 200)
    for entry_id in ids:
        store.release(entry_id)
    seen: list[tuple[int, int]] = []  # (autocheckpoint, WAL bytes) at each deletion batch
    real = store.catalog.delete_entries

    def spy(entry_ids):
        seen.append((_autocheckpoint(store), _wal(store).stat().st_size))
        return real(entry_ids)

    monkeypatch.setattr(store.catalog, "delete_entries", spy)
    made: list[BackgroundCheckpoints] = []
    real_init = BackgroundCheckpoints.__init__

    def track(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(BackgroundCheckpoints, "__init__", track)
    before = _autocheckpoint(store)
    # the log starts empty
    store.catalog.connection_for_inspection().execute("PRAGMA wal_checkpoint(TRUNCATE)")
    report = store.clean_released()
    assert report.entries == 200 and len(seen) == 10
    assert all(auto == 0 for auto, _ in seen)  # commits left checkpoints to the helper
    assert made and made[0].done >= 9  # one after every batch but the last, at least
    # The log restarts at each write: after nine batches it is about one batch long (it
    # would be nine times that if nothing checkpointed).
    sizes = [size for _, size in seen]
    assert sizes[0] == 0 < sizes[1] and sizes[-1] <= 2 * sizes[1], sizes
    assert _autocheckpoint(store) == before  # the connection's own setting is back
    assert store.entries() == []


def test_the_setting_comes_back_when_a_clean_fails(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = _fill(store, 5)
    for entry_id in ids:
        store.release(entry_id)
    before = _autocheckpoint(store)

    def failing(entry_ids):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(store.catalog, "delete_entries", failing)
    with pytest.raises(Exception, match="disk I/O error"):
        store.clean_released()
    assert _autocheckpoint(store) == before


def test_a_checkpoint_that_fails_is_skipped(tmp_path: Path) -> None:
    db_path = tmp_path / "x.sqlite3"
    db = sqlite3.connect(db_path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE t(x)")
    db.execute("INSERT INTO t VALUES (1)")
    checkpoints = BackgroundCheckpoints(db_path)
    checkpoints.start()
    checkpoints.wait()
    assert checkpoints.done == 1
    checkpoints.close()
    # One that raises (no database there) is skipped, never raised into the writer.
    broken = BackgroundCheckpoints(tmp_path / "missing" / "nothing.sqlite3")
    broken.start()
    broken.wait()
    assert broken.done == 0
    broken.close()
    db.close()


def test_nested_background_checkpoints_leave_the_outer_in_charge(store: Store) -> None:
    before = _autocheckpoint(store)
    with store.catalog.background_checkpoints():
        outer = store.catalog.background_checkpointer
        with store.catalog.background_checkpoints():
            assert store.catalog.background_checkpointer is outer
            store.put(kind="vllm", namespace="ns", key="k", objects={"o": b"x"})
        assert store.catalog.background_checkpointer is outer and _autocheckpoint(store) == 0
    assert store.catalog.background_checkpointer is None and _autocheckpoint(store) == before
    assert outer is not None and outer.done >= 1  # the put's transactions checkpointed
