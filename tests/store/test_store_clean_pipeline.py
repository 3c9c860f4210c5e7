"""``clean --released`` deletes batches in a pipeline (decision 1407): one batch's catalog
rows while the next batch's manifests and the previous batch's objects are unlinked. Per
entry the order stays manifest, row, objects; an error midway leaves only clean misses,
which the next pass removes."""

from __future__ import annotations

import pytest

from spoolctl.store import Store
from spoolctl.store.maintain import gc as gc_mod


def _fill(store: Store, n: int) -> dict[str, str]:
    """entry id -> its object's digest, every entry released."""
    out = {}
    for i in range(n):
        m = store.put(kind="vllm", namespace="ns", key=f"k{i}", objects={"o": b"%05d" % i * 9})
        store.release(m.entry_id)
        out[m.entry_id] = m.objects[0].digest
    return out


def test_each_entry_goes_manifest_then_row_then_objects(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    # Batches of 40: above unlink_many's threshold, so the unlinks really run on the pool
    # while the catalog works.
    monkeypatch.setattr(gc_mod, "DELETE_BATCH", 40)
    entries = _fill(store, 150)
    real = store.catalog.delete_entries
    batches: list[list[str]] = []

    def check(entry_ids):
        entry_ids = list(entry_ids)
        for entry_id in entry_ids:
            assert not store.layout.manifest_path(entry_id).exists()  # manifest first
            assert store.layout.object_path(entries[entry_id]).exists()  # objects after
        batches.append(entry_ids)
        return real(entry_ids)

    monkeypatch.setattr(store.catalog, "delete_entries", check)
    report = store.clean_released()
    assert [len(b) for b in batches] == [40, 40, 40, 30]
    assert sorted(e for b in batches for e in b) == sorted(entries)
    assert report.entries == 150 and report.objects == 150 and not report.failed
    assert report.entry_ids == [e for b in batches for e in b]
    assert not any(store.layout.object_path(d).exists() for d in entries.values())
    assert store.totals().entries == 0 and store.totals().bytes == 0


def test_an_error_midway_leaves_clean_misses_the_next_pass_removes(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc_mod, "DELETE_BATCH", 40)
    entries = _fill(store, 150)
    real = store.catalog.delete_entries
    calls = 0

    def failing_second(entry_ids):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError(5, "Input/output error")
        return real(entry_ids)

    monkeypatch.setattr(store.catalog, "delete_entries", failing_second)
    with pytest.raises(Exception, match="Input/output error"):
        store.clean_released()
    monkeypatch.undo()
    left = {r.entry_id for r in store.entries(hint="release")}
    assert len(left) == 110  # the first batch went; the rest is still in the catalog
    whole = 0
    for entry_id in left:  # each is a whole entry or a clean miss, never half of one
        if store.layout.manifest_path(entry_id).exists():
            assert store.layout.object_path(entries[entry_id]).exists()
            whole += 1
    assert 0 < whole < 110  # the next batch's manifests were gone already: misses
    report = store.clean_released()
    assert report.entries == 110
    assert store.totals().entries == 0
    assert not any(store.layout.object_path(d).exists() for d in entries.values())
