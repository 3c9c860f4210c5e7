"""Several drives per host: the placement rule and drive ids (issue 32 item 4, decision 2711).

Only the rule, the route and the ids are here (the connector over several roots, in-process:
tests/connector/test_vllm_drives_parts.py, decisions 2731 and 2732; the CLI's operator view across
drive roots: tests/cli/test_operator_drives.py, decision 2712).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from spoolctl.connector.drives import placement as drives
from spoolctl.errors import ConfigError

KEYS = [f"{i * 2654435761 % (1 << 64):016x}" * 4 for i in range(2000)]


def test_a_chunks_drive_depends_on_the_set_of_drives_not_their_order():
    ids = [f"{i:032x}" for i in range(4)]
    placed = {k: drives.home(k, ids) for k in KEYS}
    assert placed == {k: drives.home(k, list(reversed(ids))) for k in KEYS}
    assert placed == {k: drives.home(k, ids[2:] + ids[:2]) for k in KEYS}
    # Even: each of 4 drives holds about a quarter (2000 keys: 500 +- 15%).
    counts = Counter(placed.values())
    assert set(counts) == set(ids) and all(425 <= c <= 575 for c in counts.values()), counts


def test_losing_a_drive_moves_only_its_chunks_and_adding_one_only_what_it_wins():
    ids = [f"{i:032x}" for i in range(4)]
    placed = {k: drives.home(k, ids) for k in KEYS}
    gone = ids[1]
    after = {k: drives.home(k, [d for d in ids if d != gone]) for k in KEYS}
    moved = {k for k in KEYS if after[k] != placed[k]}
    assert moved == {k for k in KEYS if placed[k] == gone}
    assert all(after[k] == drives.ranked(k, ids)[1] for k in moved)  # its runner-up
    new = f"{99:032x}"
    grown = {k: drives.home(k, [*ids, new]) for k in KEYS}
    assert {k for k in KEYS if grown[k] != placed[k]} == {k for k in KEYS if grown[k] == new}
    with pytest.raises(ValueError):
        drives.home(KEYS[0], [])


def test_a_drive_keeps_its_id_across_mount_points_and_a_new_drive_gets_a_new_one(
        tmp_path: Path):
    a, b = tmp_path / "nvme0", tmp_path / "nvme1"
    a.mkdir()
    b.mkdir()
    first = drives.drive_id(a)
    assert drives.drive_id(a) == first and drives.read_drive_id(a) == first
    assert drives.drive_id(b) != first
    moved = tmp_path / "mnt-elsewhere"
    os.rename(a, moved)  # the same drive mounted somewhere else
    assert drives.drive_id(moved) == first
    assert sorted(p.name for p in moved.iterdir()) == [drives.MARKER]  # no temp left


@pytest.mark.parametrize("damage", ["symlink", "garbage", "fifo"])
def test_a_damaged_drive_marker_is_one_line_naming_it(tmp_path: Path, damage: str):
    root = tmp_path / "nvme0"
    root.mkdir()
    marker = root / drives.MARKER
    if damage == "symlink":
        (tmp_path / "elsewhere").write_text("{}")
        marker.symlink_to(tmp_path / "elsewhere")
    elif damage == "garbage":
        marker.write_text('{"schema": "spoolctl-drive/v1", "drive_id": "../../etc"}')
    else:
        os.mkfifo(marker)
    with pytest.raises(ConfigError) as info:
        drives.drive_id(root)
    assert str(marker) in str(info.value) and "\n" not in str(info.value)
    why = {"symlink": "is a symbolic link", "garbage": "is not a drive marker",
           "fifo": "is not a regular file"}[damage]
    assert info.value.message == f"{marker} {why}"  # word for word, whichever reader


def test_the_drive_marker_is_read_by_the_stores_one_small_file_reader(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """One bounded, link-refusing, FIFO-safe reader (``fsio.read_small``) for every small
    file: the drive marker, the deployment records and the store's own markers."""
    from spoolctl.store.disk import fsio

    root = tmp_path / "nvme0"
    root.mkdir()
    first = drives.drive_id(root)
    opened: list[Path] = []
    real = fsio.open_for_read

    def spy(path: Path) -> int:
        opened.append(Path(path))
        return real(path)

    monkeypatch.setattr(fsio, "open_for_read", spy)
    assert drives.read_drive_id(root) == first
    assert opened == [root / drives.MARKER]


def test_a_chunk_is_written_to_its_home_while_up_else_to_the_next_drive_up():
    """``route`` (decision 2714): the home when every drive is up; while the home is down
    the runner-up, i.e. where removing the home from the set would place the chunk; None
    when no drive is up."""
    ids = [f"{i:032x}" for i in range(4)]
    for key in KEYS[:200]:
        order = drives.ranked(key, ids)
        assert drives.route(key, ids, set(ids)) == drives.home(key, ids) == order[0]
        assert drives.route(key, ids, set(ids) - {order[0]}) == order[1] == \
            drives.home(key, [d for d in ids if d != order[0]])
        assert drives.route(key, ids, set(order[2:3])) == order[2]
        assert drives.route(key, ids, set()) is None
