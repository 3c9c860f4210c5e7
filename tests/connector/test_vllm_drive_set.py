"""The rank's drive set (``drives.DriveSet``): one root is a set of one, several roots a
set of several; what differs is the set's ``DrivePolicy``, chosen from the root count."""

from __future__ import annotations

import os
from pathlib import Path

from spoolctl.connector.drives.driveset import DriveSet, DriveTools
from spoolctl.connector.drives.policy import ONE_ROOT, SEVERAL
from spoolctl.connector.drives.rankstores import OpenStores

KEY = "ab" * 32


def _set(tmp_path: Path, n: int) -> DriveSet:
    base = Path(os.path.realpath(tmp_path))
    roots = []
    for i in range(n):
        (base / f"nvme{i}").mkdir()
        roots.append((str(base / f"nvme{i}"), str(base / f"nvme{i}" / "d" / "rank-0000")))
    tools = DriveTools(1.0, 60.0, ledger=lambda store: None, maintainer=lambda store: None)
    return DriveSet(roots, OpenStores(), tools=tools, max_bytes=None, tag_key=None)


def test_one_root_is_a_set_of_one_drive_whose_inventory_ignores_its_health(
        tmp_path: Path) -> None:
    drives = _set(tmp_path, 1)
    try:
        assert drives.policy == ONE_ROOT
        (one,) = drives.equip_open()
        drives.use(one)
        assert one.id == "" and drives.ids() == [""] and drives.primary is one.store
        assert drives.route(KEY) == ("", "") and drives.down_flags() == [(one.base, 0.0)]
        for _ in range(3):
            one.guard.failed("restore")
        assert one.guard.down
        # Out of service: nothing is written, but the rank keeps counting what it holds
        # (lookups skip the store through its guard).
        assert drives.route(KEY) is None and not drives.any_up()
        assert drives.inventory_up("") and drives.down_flags() == [(one.base, 1.0)]
    finally:
        drives.close()
    assert one.closed and one.guard.closed


def test_several_roots_route_around_a_drive_that_is_down(tmp_path: Path) -> None:
    drives = _set(tmp_path, 3)
    try:
        assert drives.policy == SEVERAL
        equipped = drives.equip_open()
        assert drives.equip_open() == []  # each drive is equipped once
        for one in equipped:
            drives.use(one)
        ids = drives.ids()
        assert len(ids) == 3 and all(len(i) == 32 for i in ids)
        drive, home = drives.route(KEY)
        assert drive == home
        down = drives.guard_of(home)
        assert down is not None
        for _ in range(3):
            down.failed("restore")
        runner_up, same_home = drives.route(KEY)
        assert same_home == home and runner_up != home and drives.up(runner_up)
        assert not drives.inventory_up(home) and drives.any_up()
        assert drives.route(KEY, avoid={runner_up})[0] not in (home, runner_up)
    finally:
        drives.close()
