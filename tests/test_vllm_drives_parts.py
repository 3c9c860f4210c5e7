"""The vLLM connector on several drives, in-process (issue 32 item 4, decision 2714):
``spoolctl_roots`` and its refusals, and drive stores opened without ever waiting on a
disk that hangs at start (decision 2720's open, bounded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spoolctl import metrics as m
from spoolctl.connector.deployment import settings as settings_mod
from spoolctl.connector.deployment.settings import MAX_ROOTS, parse_settings
from spoolctl.errors import ConfigError
from spoolctl.store import Store


def _dirs(tmp_path: Path, n: int) -> list[str]:
    base = Path(os.path.realpath(tmp_path))
    return [str(base / f"nvme{i}" / "spool") for i in range(n)]


@pytest.fixture
def several(monkeypatch):
    """The connector takes several drive roots (decision 2714)."""
    monkeypatch.setattr(settings_mod, "SEVERAL_DRIVES", True)


def test_spoolctl_roots_and_a_colon_list_in_spoolctl_root_name_the_drives(
        tmp_path: Path, several) -> None:
    roots = _dirs(tmp_path, 3)
    got = parse_settings({"spoolctl_roots": roots}, block_size=32, env={})
    assert got.roots == tuple(roots) and got.root == roots[0]
    # The variable, read as the CLI reads it (decision 2712), only when no key is given.
    got = parse_settings({}, block_size=32, env={"SPOOLCTL_ROOT": ":".join(roots)})
    assert got.roots == tuple(roots)
    assert parse_settings({"spoolctl_root": roots[1]}, block_size=32,
                          env={"SPOOLCTL_ROOT": ":".join(roots)}).roots == (roots[1],)
    # One root: exactly today's settings.
    one = parse_settings({"spoolctl_root": roots[0]}, block_size=32, env={})
    assert one.roots == (roots[0],) and one.root == roots[0]


@pytest.mark.parametrize(("extra", "env", "says", "fix"), [
    ({"spoolctl_root": "/a", "spoolctl_roots": ["/a", "/b"]}, {}, "both set", "keep one"),
    ({"spoolctl_roots": []}, {}, "is empty", "at least one"),
    ({"spoolctl_roots": "/a:/b"}, {}, "must be a list", "spoolctl_roots"),
    ({"spoolctl_roots": ["/a", "/b/../a"]}, {}, "one root twice", "once"),
    ({"spoolctl_roots": ["/a", "b"]}, {}, "absolute paths", "full path"),
    ({"spoolctl_roots": ["/a", "/r{rank}"]}, {}, "rank placeholders", "one base directory"),
    ({}, {"SPOOLCTL_ROOT": "/a::/b"}, "empty root", "single ':'"),
    ({"spoolctl_roots": [f"/d{i}" for i in range(MAX_ROOTS + 1)]}, {}, "at most 64",
     "at most 64"),
])
def test_each_refused_list_of_roots_is_one_config_error_line_naming_the_fix(
        several, extra, env, says, fix) -> None:
    with pytest.raises(ConfigError, match=says) as exc:
        parse_settings(extra, block_size=32, env=env)
    assert fix in (exc.value.fix or "") and "\n" not in str(exc.value)


def test_a_store_given_as_a_drive_root_is_refused(tmp_path: Path, several) -> None:
    roots = _dirs(tmp_path, 2)
    Store.open(roots[1], create=True).close()
    with pytest.raises(ConfigError, match="spoolctl_roots is a single store") as exc:
        parse_settings({"spoolctl_roots": roots}, block_size=32, env={})
    assert exc.value.path == roots[1] and "spoolctl_roots" in (exc.value.fix or "")


def test_several_roots_on_one_filesystem_start_with_one_warning(tmp_path: Path) -> None:
    from spoolctl.connector.deployment.preflight import check_roots

    roots = _dirs(tmp_path, 2)
    warnings = check_roots(roots, bound_s=5)
    assert [w for w in warnings if "one filesystem" in w] == [
        f"spoolctl roots {roots[0]} and {roots[1]} are on one filesystem: one failure "
        "domain, not two drives"]
    assert not [w for w in check_roots(roots[:1], bound_s=5) if "one filesystem" in w]


# -- drive stores opened without waiting on a hung disk (decisions 2714, 2720) ------------------

# What a test thread waits for an operation that must not hang (a safety net: a broken bound
# fails the test instead of wedging the suite; no result depends on it).
NET_S = 60


def _needs_fuse() -> None:
    from fusemount import fuse_missing

    missing = fuse_missing()
    if missing:
        pytest.skip(missing)


def _hung_rank_store(tmp_path: Path, root: Path):
    """A rank store at ``root`` (one entry) whose ``objects/`` is a FUSE mount, hung: as a
    disk that stopped answering before the engine started (``Store.open`` scans it)."""
    from fusemount import ControlledMount

    with Store.open(root, create=True) as store:
        store.put(kind="vllm", namespace="ns", key="a" * 64, objects={"kv": b"x" * 100})
    mount = ControlledMount(root / "objects", tmp_path / "fuse")
    mount.hang()
    return mount


def test_a_drive_hung_at_start_is_pending_and_taken_into_use_when_it_answers(
        tmp_path: Path, caplog) -> None:
    """``DriveStores.open`` returns within its bound on a hung disk (the drive pending, one
    warning naming it), other roots open meanwhile, and the retry opens the drive once
    the disk answers (``on_open``, off the caller's thread)."""
    _needs_fuse()
    import threading

    from waiting import wait_until

    from spoolctl.connector.drivestores import OPEN, PENDING, DriveStores
    from spoolctl.connector.rankstores import OpenStores

    base = Path(os.path.realpath(tmp_path)) / "spool"
    root = base / "vllm-v1-x" / "rank-0000"
    stores = OpenStores()
    opened: list[object] = []
    with _hung_rank_store(tmp_path, root) as mount:
        got: list[DriveStores] = []
        opener = threading.Thread(target=lambda: got.append(DriveStores.open(
            [(str(base), str(root))], stores, create=True, deadline_s=0.05,
            probe_interval_s=0.05, on_open=lambda slot: opened.append(
                (slot.state, threading.current_thread().name)))), daemon=True)
        opener.start()
        opener.join(NET_S)  # 0.2 s when bounded; the old open waits for the disk
        try:
            assert got, "opening a rank store waited on a hung disk"
            (slot,) = got[0].slots
            assert slot.state == PENDING and slot.store is None and not opened
            assert [r.message for r in caplog.records if str(root) in r.message] == [
                f"spoolctl: rank store {root} not open (no answer within 0.2 s); serving "
                "without it (misses) and trying again every 0.05 s"]
            # Another root opens meanwhile: the hung opening holds no shared lock.
            other = stores.acquire(str(tmp_path / "other"), create=True, max_bytes=None)
            stores.release(other)
            mount.release()
            wait_until(lambda: opened, NET_S, what="the drive opened once it answers")
            assert opened == [(OPEN, "spoolctl-drive-open")] and slot.drive_id == ""
            assert slot.store is not None and slot.store.live_keys("vllm", "ns") == {"a" * 64}
            # One root: no drive marker is written (today's layout).
            assert not (base / ".spoolctl-drive").exists()
        finally:
            mount.release()
            if got:
                got[0].close()
    assert stores.roots() == []


@pytest.mark.extended  # a FUSE mount, vLLM's import and two connector starts (~10 s)
def test_a_worker_started_on_a_hung_disk_serves_misses_then_takes_its_store_into_use(
        tmp_path: Path) -> None:
    """Decision 2720's open: an engine started on an already hung disk hung in
    ``Store.open``. Now the worker starts (its store pending), the scheduler counts the
    rank as holding nothing (every lookup a miss) without waiting either, and once the
    disk answers the worker's store is used: its next report restates what it holds."""
    _needs_fuse()
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    import threading
    from types import SimpleNamespace

    from fusemount import ControlledMount
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_configs import vllm_configs
    from waiting import wait_until

    from spoolctl.connector import SpoolConnector

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    base = str(Path(os.path.realpath(tmp_path)) / "spool")
    before, kcfg = vllm_configs(base, [spec], num_blocks=8, spoolctl_scrub_rate="0")
    vcfg, kcfg = vllm_configs(base, [spec], num_blocks=8, spoolctl_scrub_rate="0",
                              spoolctl_lookup_deadline=0.05, spoolctl_probe_interval=0.05)
    first = SpoolConnector(before, KVConnectorRole.WORKER, kcfg)  # a run before: one chunk
    first.register_kv_caches({"layer.0": torch.zeros(8, 2, 32, 64)})
    (root,) = first.store_roots
    ns = first.worker._namespace
    first.shutdown()
    with Store.open(root) as store:
        store.put(kind="vllm", namespace=ns, key="d" * 64, objects={"kv": b"x" * 100})
    with ControlledMount(Path(root) / "objects", tmp_path / "fuse") as mount:
        mount.hang()
        got: list[SpoolConnector] = []

        def start() -> None:
            worker = SpoolConnector(vcfg, KVConnectorRole.WORKER, kcfg)
            worker.register_kv_caches({"layer.0": torch.zeros(8, 2, 32, 64)})
            got.append(worker)

        starting = threading.Thread(target=start, daemon=True)
        starting.start()
        starting.join(NET_S)
        sched = None
        try:
            assert got, "the worker's start waited on the hung disk"
            worker = got[0]
            assert worker.store_roots == []
            hs = worker.get_handshake_metadata()
            assert hs is not None and hs.store_id == "" and hs.report.added == ()
            sched = SpoolConnector(vcfg, KVConnectorRole.SCHEDULER, kcfg)
            sched.set_xfer_handshake_metadata({0: hs})
            # Known, from its reports, to hold nothing: every lookup is a miss.
            assert sched.inventory_state == {0: {"source": "reports", "known": 0}}
            assert worker.build_connector_worker_meta() is None
            # Out of service, for the operator too: spoolctl_disk_down counts it.
            assert worker.worker.take_stats()["gauges"][m.DISK_DOWN.name] == {"0": 1.0}
            mount.release()
            reports: list[object] = []
            wait_until(lambda: reports.append(worker.build_connector_worker_meta()) or
                       reports[-1] is not None, NET_S, what="the store taken into use")
            (report,) = reports[-1].reports
            assert report.reset and report.epoch > hs.report.epoch and len(report.added) == 1
            assert worker.store_roots == [root]
            sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=reports[-1]))
            assert sched.inventory_state == {0: {"source": "reports", "known": 1}}
            assert worker.worker.take_stats()["gauges"][m.DISK_DOWN.name] == {"0": 0.0}
        finally:
            mount.release()
            if sched is not None:
                sched.shutdown()
            if got:
                got[0].shutdown()


def test_several_drives_are_identified_a_missing_one_joins_later_and_a_twin_is_not_used(
        tmp_path: Path, caplog) -> None:
    """Each drive gets its id (the worker writes the marker; a reader only reads it); a
    drive whose base is missing at start is pending and joins when it appears; of two
    roots carrying one drive id the one listed later is not used, with one error line
    naming both marker files."""
    import shutil

    from waiting import wait_until

    from spoolctl.connector.deployment import drives
    from spoolctl.connector.drivestores import OPEN, PENDING, REFUSED, DriveStores
    from spoolctl.connector.rankstores import OpenStores

    bases = [Path(b) for b in _dirs(tmp_path, 4)]
    for b in bases[:2]:
        b.mkdir(parents=True)
    roots = [(str(b), str(b / "vllm-v1-x" / "rank-0000")) for b in bases]
    stores, joined = OpenStores(), []
    # A reader first: it creates nothing and identifies no drive.
    reader = DriveStores.open(roots[:2], stores, create=False, deadline_s=1,
                              probe_interval_s=60)
    assert [s.state for s in reader.slots] == [PENDING] * 2
    reader.close()
    assert not (bases[0] / drives.MARKER).exists()
    worker = DriveStores.open(roots[:2], stores, create=True, deadline_s=1,
                              probe_interval_s=60)
    ids = [s.drive_id for s in worker.slots]
    assert [s.state for s in worker.slots] == [OPEN] * 2 and len(set(ids)) == 2
    assert ids == [drives.read_drive_id(b) for b in bases[:2]]
    worker.close()
    assert stores.roots() == []
    # The fourth drive's marker copied from the second's; the third not mounted yet.
    bases[3].mkdir(parents=True)
    shutil.copy(bases[1] / drives.MARKER, bases[3] / drives.MARKER)
    caplog.clear()
    worker = DriveStores.open(roots, stores, create=True, deadline_s=1,
                              probe_interval_s=0.05, on_open=joined.append)
    try:
        assert [s.state for s in worker.slots] == [OPEN, OPEN, PENDING, REFUSED]
        errors = [r.message for r in caplog.records if r.levelname == "ERROR"]
        assert errors == [f"spoolctl: {bases[1] / drives.MARKER} and {bases[3] / drives.MARKER}"
                          f" carry one drive id (a copied marker or a bind mount); {bases[3]}"
                          f" is not used: remove {bases[3] / drives.MARKER} and restart (that "
                          "drive then gets a new id)"]
        assert "does not exist" in worker.slots[2].why
        bases[2].mkdir(parents=True)  # mounted: it joins with a new id
        wait_until(lambda: joined, NET_S, what="the missing drive identified")
        assert joined == [worker.slots[2]] and worker.slots[2].state == OPEN
        assert worker.slots[2].drive_id not in ids[:2]
    finally:
        worker.close()
    assert stores.roots() == []


def test_one_root_that_is_not_a_store_still_refuses_the_start(tmp_path: Path) -> None:
    """Only a disk that is late or fails makes a store pending: with one root, a mistake
    (a non-empty directory that is not a store where the rank store goes) is the one
    error line it was before, not a cache that silently never opens."""
    from spoolctl.connector.drivestores import DriveStores
    from spoolctl.connector.rankstores import OpenStores

    base = Path(_dirs(tmp_path, 1)[0])
    root = base / "vllm-v1-x" / "rank-0000"
    root.mkdir(parents=True)
    (root / "notes.txt").write_text("someone else's files")
    stores = OpenStores()
    with pytest.raises(ConfigError) as exc:
        DriveStores.open([(str(base), str(root))], stores, create=True, deadline_s=1,
                         probe_interval_s=60)
    assert str(root) in str(exc.value) and "\n" not in str(exc.value)
    assert stores.roots() == []
