"""Issue 30.8 and 30.9: an import keeps what an entry is (its hint), and what export and
import report is true also when two of them run at once (decisions 2311, 2312)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from operator_cli import run_json
from test_operator_interrupts import Paused, start
from transfer_support import fill

from spoolctl.store import Store
from spoolctl.store.transfer.archive import FdSink
from spoolctl.store.transfer.exporter import export


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, set[str]]:
    """A store of 6 entries, 2 of them released (the old host's cleanup backlog)."""
    root = tmp_path / "src"
    ids = fill(root, 6, size=3000)
    with Store.open(root) as st:
        for entry_id in ids[:2]:
            st.release(entry_id)
    return root, set(ids[:2])


def hints(root: Path) -> dict[str, str]:
    with Store.open(root) as st:
        return {r.entry_id: r.hint for r in st.entries()}


# -- 30.8: the hint travels ---------------------------------------------------------------


def test_released_entries_stay_released_through_an_archive(tmp_path: Path, source) -> None:
    """Before: ``export --hint any`` then import brought the 2 released entries back as
    retained, and ``clean --released`` on the new host never removed them."""
    root, released = source
    archive = tmp_path / "all.tar"
    run_json("export", "--root", str(root), "--hint", "any", "-o", str(archive))
    target = tmp_path / "dst"
    doc = run_json("import", str(archive), "--root", str(target))
    got = hints(target)
    assert {e for e, h in got.items() if h == "release"} == released
    assert len(got) == 6
    assert (doc["imported"], doc["released"]) == (6, 2)
    cleaned = run_json("clean", "--released", "--yes", "--root", str(target))
    assert cleaned["steps"]["released"]["entries"] == 2
    assert set(hints(target)) == set(got) - released


def test_released_entries_stay_released_from_a_peer_root(tmp_path: Path, source) -> None:
    root, released = source
    target = tmp_path / "dst"
    doc = run_json("import", str(root), "--root", str(target))
    assert {e for e, h in hints(target).items() if h == "release"} == released
    assert (doc["imported"], doc["released"]) == (6, 2)


def test_an_archive_of_live_entries_is_unchanged(tmp_path: Path, source) -> None:
    """The default export (retained only) writes no ``released`` key: earlier importers
    read it as before."""
    root, _ = source
    archive = tmp_path / "live.tar"
    run_json("export", "--root", str(root), "-o", str(archive))
    head = archive.read_bytes()[512:8192].split(b"\0", 1)[0]
    index = json.loads(head)
    assert all("released" not in s for s in index["stores"])
    doc = run_json("import", str(archive), "--root", str(tmp_path / "dst"))
    assert (doc["imported"], doc["released"]) == (4, 0)


# -- 30.9: reports true under concurrency -------------------------------------------------


def test_two_concurrent_imports_do_not_both_claim_the_entries(tmp_path: Path, source) -> None:
    """Import A records its commit intents and stops there (pause checkpoint); import B of
    the same archive runs start to end meanwhile; then A finishes. Each entry is claimed by
    exactly one of them. Before: both reported ``imported: 4, present: 0``."""
    root, _ = source
    archive = tmp_path / "a.tar"
    run_json("export", "--root", str(root), "-o", str(archive))
    target = tmp_path / "dst"
    run_json("init", "--root", str(target))
    pause = Paused("catalog.intent")
    first = start("import", str(archive), "--root", str(target), "--json", env=pause.env)
    try:
        pause.wait_reached(first)
        second = run_json("import", str(archive), "--root", str(target))
    finally:
        (pause.dir / "resume").write_text("go\n")
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    first_doc = json.loads(out)
    assert (first_doc["imported"], first_doc["present"]) == (4, 0)
    assert (second["imported"], second["present"]) == (0, 4)
    with Store.open(target) as st:
        rows = st.entries()
        assert len(rows) == 4
        for row in rows:
            st.read_all(st.manifest(row.entry_id))
    assert not any((target / "tmp").iterdir())


def test_export_progress_counts_entries_as_it_goes_and_never_overshoots(
        tmp_path: Path, source) -> None:
    """Before: the entry count stayed 0 until the end and the bytes written passed the
    planned total (tar headers and padding were not planned: ``9.6/7.1 MiB``)."""
    root, _ = source
    calls: list[tuple[int, int, int | None]] = []
    out = tmp_path / "p.tar"
    with open(out, "wb") as f:
        report = export(root, FdSink(f.fileno()), progress=lambda *a: calls.append(a))
    assert [entries for _done, entries, _total in calls[:-1]] == [1, 2, 3, 4]
    assert all(total is not None and done <= total for done, _e, total in calls)
    assert calls[-1] == (out.stat().st_size, 4, out.stat().st_size)
    assert report.entries == 4
    # the first call already plans at least the whole archive
    assert calls[0][2] >= out.stat().st_size


def test_no_progress_bar_text_overshoots_on_a_terminal(tmp_path: Path, source) -> None:
    """The CLI's bar (rich) is given a total never below what is done."""
    from spoolctl.cli.transfer_progress import TransferProgress

    bar = TransferProgress("export", True)
    with bar:
        bar(5000, 1, 4000)  # an estimate passed: the bar grows, not overshoots
        assert bar.shown() == (5000, 5000, 1)
