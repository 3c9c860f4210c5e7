"""The operator's view across a host's several drives (issue 32 item 4, decision 2712):
`status`, `metrics`, `clean` and `scrub` take several roots (repeated ``--root``, or
``SPOOLCTL_ROOT`` with ':' between them), show a row per drive and totals, and a drive that
is missing or unreadable costs only its own row while the others are still served. A hung
drive is in tests/store/test_disk_faults.py (a real FUSE mount)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from operator_cli import run, run_json

from spoolctl.cli.json_contract import DRIVES
from spoolctl.cli.transfer_cmds import drive_archive_name
from spoolctl.store import Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

DEP = "vllm-v1-" + "a1" * 24


def _fill(rank_root: Path, n: int, released: int) -> None:
    with Store.open(rank_root, create=True) as store:
        ids = [store.put(kind="vllm", namespace="vllm-v1-ns", key=f"{i:064x}",
                         objects={"kv": os.urandom(1024)}).entry_id for i in range(n)]
        for entry_id in ids[:released]:
            store.release(entry_id)


@pytest.fixture
def drives(tmp_path: Path) -> list[Path]:
    """Three drive roots as the connector lays them out (``<drive>/<deployment>/rank-NNNN``):
    3 and 2 chunks (one released on each), the third drive missing (never mounted, or
    gone)."""
    base = Path(os.path.realpath(tmp_path))
    roots = [base / "nvme0" / "spool", base / "nvme1" / "spool", base / "nvme2" / "spool"]
    for root, n in zip(roots[:2], (3, 2), strict=True):
        _fill(root / DEP / "rank-0000", n, released=1)
    return roots


def _roots(*roots: Path) -> list[str]:
    return [arg for root in roots for arg in ("--root", str(root))]


def test_status_across_drives_shows_each_drive_and_totals_and_a_missing_one_costs_its_row(
        drives: list[Path]) -> None:
    doc = run_json("status", *_roots(*drives), expect=2)  # exit 2: as for a store down
    assert set(doc) == set(DRIVES.keys) and doc["roots"] == [str(r) for r in drives]
    rows = {Path(d["root"]): d for d in doc["drives"]}
    for root, chunks in zip(drives[:2], (2, 1), strict=True):  # retained; served in full
        dep = rows[root]["result"]["deployments"][DEP]
        assert rows[root]["exit"] == 0 and [r["chunks"] for r in dep["ranks"]] == [chunks]
    missing = rows[drives[2]]
    assert missing["exit"] == 2 and str(drives[2]) in missing["error"] and "result" not in missing
    assert doc["totals"] == {"drives": 3, "drives_down": 1, "stores": 2, "entries": 5,
                             "bytes": doc["totals"]["bytes"]} and doc["totals"]["bytes"] > 0
    code, out, err = run("status", *_roots(*drives))
    assert code == 2 and f"drive {drives[2]}" in out and "3 drives, 1 down or unreadable" in out
    assert err.count("\n") == 1 and f"error: drive {drives[2]}:" in err  # one line on stderr


def test_spoolctl_root_names_several_drives_with_colons_and_one_root_is_as_before(
        drives: list[Path]) -> None:
    """SPOOLCTL_ROOT with ':' between roots (like PATH) is the drives; a single --root (or
    a SPOOLCTL_ROOT without ':') prints the one-root document, not a document of drives."""
    both = run_json("status", env={"SPOOLCTL_ROOT": f"{drives[0]}:{drives[1]}"})
    assert [d["root"] for d in both["drives"]] == [str(drives[0]), str(drives[1])]
    assert both["exit"] == 0 and both["totals"]["entries"] == 5
    one = run_json("status", "--root", str(drives[0]))
    assert "drives" not in one and set(one["deployments"]) == {DEP}


def test_metrics_across_drives_label_every_gauge_with_its_drive(drives: list[Path]) -> None:
    code, out, err = run("metrics", *_roots(*drives))
    assert code == 2 and f"error: drive {drives[2]}:" in err
    up = {line for line in out.splitlines() if line.startswith("spoolctl_store_up{")}
    assert up == {
        *(f'spoolctl_store_up{{deployment="{DEP}",drive="{root}",rank="0000"}} 1.0'
          for root in drives[:2]),
        f'spoolctl_store_up{{deployment="",drive="{drives[2]}",rank=""}} 0.0'}


def test_clean_and_scrub_act_on_every_drive(drives: list[Path]) -> None:
    code, out, err = run("clean", *_roots(*drives))  # no --yes, not a terminal: one line
    assert code == 2 and out == "" and err.count("\n") == 1 and "add --yes" in err
    cleaned = run_json("clean", "--released", "--yes", *_roots(*drives), expect=2)
    assert cleaned["totals"]["entries"] == 2 and cleaned["totals"]["drives_down"] == 1
    assert cleaned["totals"]["stores"] == 2  # the stores of the drives that are there
    scrubbed = run_json("scrub", *_roots(*drives[:2]))
    assert scrubbed["totals"]["checked"] == 3 and scrubbed["totals"]["quarantined"] == 0
    for root, left in zip(drives[:2], (2, 1), strict=True):
        with Store.open(root / DEP / "rank-0000", read_only=True) as store:
            assert store.totals().entries == left  # the released one is gone


@pytest.mark.parametrize("argv, env, says", [
    (("--root", "{0}", "--root", "{0}/"), {}, "the same root is given twice"),
    ((), {"SPOOLCTL_ROOT": "{0}::{1}"}, "has an empty root between its ':'"),
])
def test_a_root_named_twice_or_an_empty_one_is_one_line(tmp_path: Path, argv: tuple,
                                                        env: dict, says: str) -> None:
    fill = {"0": str(tmp_path / "nvme0"), "1": str(tmp_path / "nvme1")}
    code, out, err = run("status", *(a.format(*fill.values()) for a in argv),
                         env={k: v.format(*fill.values()) for k, v in env.items()})
    assert code == 2 and says in err and err.strip().count("\n") == 0, (out, err)


def test_a_one_root_command_given_several_roots_is_one_line_and_acts_on_none(
        tmp_path: Path) -> None:
    """Only status, metrics, clean, scrub and export take several roots. Before, every other
    command kept the last ``--root`` silently (``keys rotate --root a --root b`` rotated b
    only, exit 0) and took ``SPOOLCTL_ROOT=a:b`` for one path (``import`` created a store
    in a directory named ``a:b``)."""
    base = Path(os.path.realpath(tmp_path))
    a, b = base / "a", base / "b"
    for root in (a, b):
        Store.open(root, create=True).close()
    before = sorted(p.name for p in base.iterdir())
    code, _, err = run("init", "--root", str(a), "--root", str(b), "--max-size", "1G")
    assert code == 2 and "`spoolctl init` takes one --root, and 2 were given" in err, err
    assert err.strip().count("\n") == 0 and "run it once per root" in err
    doc = run_json("ls", "--root", str(a), "--root", str(b), expect=2)
    assert doc["error"]["kind"] == "ConfigError" and "takes one --root" in doc["error"]["message"]
    code, _, err = run("init", env={"SPOOLCTL_ROOT": f"{a}:{base / 'new'}"})
    assert code == 2 and "SPOOLCTL_ROOT names several roots" in err, err
    assert err.strip().count("\n") == 0 and "pass the one root with --root" in err
    assert sorted(p.name for p in base.iterdir()) == before  # no store named "a:new"
    for root in (a, b):
        with Store.open(root, read_only=True) as store:
            assert store.marker.max_bytes is None  # neither store was changed
    assert run_json("ls", "--root", str(b))["entries"] == []  # one --root: as before


def test_export_across_drives_writes_one_archive_per_drive_and_each_imports_back(
        drives: list[Path], tmp_path: Path) -> None:
    """Decision 2713: several --root with -o DIR write DIR/<drive>.tar per drive (the
    archive format has no drive: each imports onto the matching drive of the new host); the
    missing drive is one error row and one stderr line, the others are exported, exit 2.
    (Before, export kept only the last --root and refused a directory as -o.)"""
    out = tmp_path / "archives"
    out.mkdir()
    code, stdout, err = run("export", *_roots(*drives), "-o", str(out), "--json")
    assert code == 2, (stdout, err)
    doc = json.loads(stdout)
    assert set(doc) == set(DRIVES.keys) and doc["roots"] == [str(r) for r in drives]
    names = [drive_archive_name(r) for r in drives]
    assert names[0].endswith("nvme0-spool.tar") and len(set(names)) == 3
    assert sorted(p.name for p in out.iterdir()) == sorted(names[:2])  # nothing for the 3rd
    rows = doc["drives"]
    for row, name, n in zip(rows[:2], names[:2], (2, 1), strict=True):
        assert row["exit"] == 0 and row["result"]["output"] == str(out / name)
        assert row["result"]["entries"] == n  # retained chunks of that drive
    assert rows[2]["exit"] == 2 and str(drives[2]) in rows[2]["error"]
    assert doc["totals"]["archives"] == 2 and doc["totals"]["entries"] == 3
    assert doc["totals"]["drives_down"] == 1 and err.count("\n") == 1
    assert f"error: drive {drives[2]}:" in err
    # moving the host: each archive onto the matching drive of the new one
    new = [tmp_path / "new" / f"nvme{i}" / "spool" for i in (0, 1)]
    for root, name, n in zip(new, names[:2], (2, 1), strict=True):
        imported = run_json("import", "--root", str(root), str(out / name))
        assert imported["imported"] == n
        with Store.open(root / DEP / "rank-0000", read_only=True) as store:
            assert store.totals().entries == n


def test_export_across_drives_needs_a_directory_not_one_stream(drives: list[Path],
                                                               tmp_path: Path) -> None:
    code, out, err = run("export", *_roots(*drives[:2]))  # -o - (the default)
    assert code == 2 and out == "" and "one archive per drive" in err
    assert err.strip().count("\n") == 0
    code, out, err = run("export", *_roots(*drives[:2]), "-o", str(tmp_path / "none"))
    assert code == 2 and "-o is a directory" in err and str(tmp_path / "none") in err
    (tmp_path / drive_archive_name(drives[1])).write_bytes(b"an older archive")
    code, out, err = run("export", *_roots(*drives[:2]), "-o", str(tmp_path))
    assert code == 2 and "the output file exists" in err and "--force" in err
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".tar") == \
        [drive_archive_name(drives[1])]  # refused before the first drive was written
