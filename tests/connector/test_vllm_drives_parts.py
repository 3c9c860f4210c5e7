"""The vLLM connector on several drives, in-process (issue 32 item 4, decision 2714):
``spoolctl_roots`` and its refusals, and drive stores opened without ever waiting on a
disk that hangs at start (decision 2720's open, bounded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spoolctl import metrics as m
from spoolctl.connector.deployment.settings import MAX_ROOTS, parse_settings
from spoolctl.errors import ConfigError
from spoolctl.store import Store


def route_over(ids, up):
    """A stager's route over ``ids`` (``DriveSet.route``'s rule): (drive, home) or None."""
    from spoolctl.connector.drives import placement

    def route(key, avoid=()):
        drive = placement.route(key, ids, {d for d in ids if d not in avoid and up(d)})
        return (drive, placement.home(key, ids)) if drive is not None else None

    return route



def _dirs(tmp_path: Path, n: int) -> list[str]:
    base = Path(os.path.realpath(tmp_path))
    return [str(base / f"nvme{i}" / "spool") for i in range(n)]


def test_spoolctl_roots_and_a_colon_list_in_spoolctl_root_name_the_drives(
        tmp_path: Path) -> None:
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
    ({"spoolctl_roots": ["/a", " /b"]}, {}, "spaces around", "remove the spaces"),
    ({}, {"SPOOLCTL_ROOT": "/a: /b"}, "spaces around", "remove the spaces"),
    ({"spoolctl_roots": [f"/d{i}" for i in range(MAX_ROOTS + 1)]}, {}, "at most 64",
     "at most 64"),
    # its base root labels spoolctl_drive_*{drive} (decision 2770): printable UTF-8
    ({"spoolctl_roots": ["/a", "/nvme1/sp\x1bl"]}, {}, "cannot label", "printable characters"),
    ({}, {"SPOOLCTL_ROOT": "/a:/b\tc"}, "cannot label", "printable characters"),
])
def test_each_refused_list_of_roots_is_one_config_error_line_naming_the_fix(
        extra, env, says, fix) -> None:
    with pytest.raises(ConfigError, match=says) as exc:
        parse_settings(extra, block_size=32, env=env)
    assert fix in (exc.value.fix or "") and "\n" not in str(exc.value)
    # The refusal names where the roots came from: the variable or the extra config.
    assert ("SPOOLCTL_ROOT" in str(exc.value.path)) == ("SPOOLCTL_ROOT" in env)


def test_a_store_given_as_a_drive_root_is_refused(tmp_path: Path) -> None:
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

    from spoolctl.connector.drives.opening import OPEN, PENDING, DriveStores
    from spoolctl.connector.drives.rankstores import OpenStores

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
    ns = first.worker.namespace
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

    from spoolctl.connector.drives import placement as drives
    from spoolctl.connector.drives.opening import OPEN, PENDING, REFUSED, DriveStores
    from spoolctl.connector.drives.rankstores import OpenStores

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
    from spoolctl.connector.drives.opening import DriveStores
    from spoolctl.connector.drives.rankstores import OpenStores

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


# -- the worker's parts over several drives (decision 2714 item 4) ------------------------------


class _Drives:
    """Three drive directories with ids, a rank store on each, and which are up (a test's
    stand-in for the guards' flags: memory only, as the worker reads them)."""

    def __init__(self, tmp_path: Path, n: int = 3) -> None:
        from spoolctl.connector.drives import placement as drives

        self.bases = [Path(b) for b in _dirs(tmp_path, n)]
        self.ids, self.stores = [], {}
        for base in self.bases:
            base.mkdir(parents=True)
            drive = drives.drive_id(base)
            self.ids.append(drive)
            self.stores[drive] = Store.open(base / "vllm-v1-x" / "rank-0000", create=True)
        self.labels = {d: str(b) for d, b in zip(self.ids, self.bases, strict=True)}
        self.up = set(self.ids)

    def home(self, key: str) -> str:
        from spoolctl.connector.drives import placement as drives

        return drives.home(key, self.ids)

    def on(self, drive: str) -> set[str]:
        return self.stores[drive].live_keys("vllm", "ns")

    def close(self) -> None:
        for store in self.stores.values():
            store.close()


def _stager(d: _Drives, holdings, counters, *, staging_chunks: int = 64):
    from spoolctl.connector.worker_side.capture import (
        ChunkStager,
        rank_commit,
        rank_commit_many,
    )

    commits = {drive: (rank_commit(store, "ns", holdings, drive=drive),
                       rank_commit_many(store, "ns", holdings, drive=drive), None)
               for drive, store in d.stores.items()}
    return ChunkStager.for_drives(commits, route_over(d.ids, d.up.__contains__), d.labels,
                                  chunk_bytes=4096, staging_bytes=staging_chunks * 4096,
                                  meta={}, counters=counters)


def _fill(key: str):
    from spoolctl.connector.kv.kvio import DONE

    def fill(buf):
        view = buf.numpy()
        view[:] = memoryview(_payload(key, len(view))).cast("B")
        return {"kv": memoryview(view)}, DONE

    return fill


def _payload(key: str, n: int) -> bytes:
    return (key.encode() * (n // len(key) + 1))[:n]


def _keys(n: int, seed: str) -> list[str]:
    from hashlib import sha256

    return [sha256(f"{seed}{i}".encode()).hexdigest() for i in range(n)]


def test_writes_go_to_each_chunks_home_and_to_its_runner_up_while_the_home_is_down(
        tmp_path: Path) -> None:
    """The worker's writes over three drives: each chunk on its home (``drives.home``); a
    down drive's chunks on their runner-ups, counted per home drive, none on the down drive;
    every drive down: skipped ``disk_down``. The rank holds what its up drives hold, and
    ``locate`` names a drive that has the chunk."""
    pytest.importorskip("torch")
    from spoolctl.connector.drives import placement as drives
    from spoolctl.connector.stats import ConnectorCounters
    from spoolctl.connector.worker_side.holdings import RankHoldings

    d = _Drives(tmp_path)
    counters = ConnectorCounters()
    holdings = RankHoldings.for_drives(d.stores, d.up.__contains__, kind="vllm",
                                       namespace="ns", rank=0, epoch=1)
    stager = _stager(d, holdings, counters)
    try:
        first = _keys(30, "a")
        for i, key in enumerate(first):
            stager.stage(key, i, _fill(key), request="A")
        assert stager.flush(NET_S)
        for drive in d.ids:
            assert d.on(drive) == {k for k in first if d.home(k) == drive}
        assert all(d.on(drive) for drive in d.ids)  # 30 keys: every drive got some
        assert all(holdings.locate(k) == d.home(k) for k in first)

        gone = d.ids[1]  # taken out
        d.up.discard(gone)
        holdings.drives_changed()
        assert holdings.held_keys() == {k for k in first if d.home(k) != gone}
        assert all(holdings.locate(k) is None for k in first if d.home(k) == gone)
        # (a restore of such a chunk fails ``disk_down``, not ``absent``: its drive is named)
        assert all(holdings.locate(k, or_down=True) == gone for k in first if d.home(k) == gone)
        second = _keys(30, "b")
        for i, key in enumerate(second):
            stager.stage(key, i, _fill(key), request="B")
        assert stager.flush(NET_S)
        moved = [k for k in second if d.home(k) == gone]
        assert moved and not d.on(gone) & set(second)
        for key in moved:
            runner_up = drives.route(key, d.ids, d.up)
            assert runner_up != gone and key in d.on(runner_up)
            assert holdings.locate(key) == runner_up
        assert counters.total(m.DRIVE_FAILOVER_STORES, drive=d.labels[gone]) == len(moved)
        assert counters.total(m.DRIVE_FAILOVER_STORES) == len(moved)

        d.up.clear()
        stager.stage(_keys(1, "c")[0], 0, _fill("c"), request="C")
        assert counters.total(m.STORES_SKIPPED, reason="disk_down") == 1
        # Back: what it held counts again, where it is.
        d.up.update(d.ids)
        holdings.drives_changed()
        assert holdings.held_keys() == set(first) | set(second)
    finally:
        assert stager.close(NET_S)
        d.close()


def test_a_restore_reads_each_chunk_from_the_drive_holding_it_and_stops_at_a_down_one(
        tmp_path: Path) -> None:
    """``RestorePipeline`` with ``locate``: a prompt's chunks spread over three drives come
    back with identical bytes, each read on its drive's pool; a chunk no up drive holds
    fails at once (``absent``) and one on a drive taken out fails at once (``disk_down``),
    the chunks before it restored; a failed read is lost on that drive only."""
    pytest.importorskip("torch")
    from concurrent.futures import ThreadPoolExecutor

    from spoolctl.connector.diskguard import DiskGuard
    from spoolctl.connector.kv.formats import ChunkRestore
    from spoolctl.connector.stats import ConnectorCounters
    from spoolctl.connector.worker_side.holdings import RankHoldings
    from spoolctl.connector.worker_side.restore import Located, RestorePipeline

    d = _Drives(tmp_path)
    keys = _keys(36, "p")  # every drive (random ids) is some key's home
    for key in keys:
        d.stores[d.home(key)].put(kind="vllm", namespace="ns", key=key,
                                  objects={"kv": _payload(key, 4096)})
    holdings = RankHoldings.for_drives(d.stores, d.up.__contains__, kind="vllm",
                                       namespace="ns", rank=0, epoch=1)
    holdings.rescan()
    pools = {drive: ThreadPoolExecutor(2, thread_name_prefix=f"read-{i}")
             for i, drive in enumerate(d.ids)}
    guards = {drive: DiskGuard(store, probe_interval_s=3600)
              for drive, store in d.stores.items()}
    read_on: dict[str, str] = {}
    copies: dict[str, bytes] = {}

    def locate(key: str) -> Located | None:
        drive = holdings.locate(key)
        return None if drive is None else Located(drive, d.stores[drive], guards[drive],
                                                  pools[drive])

    def item(key: str) -> ChunkRestore:
        import threading

        def fill(store: Store, manifest, buf) -> int:
            read_on[key] = threading.current_thread().name
            store.read(manifest, "kv", into=memoryview(buf.numpy()))
            return 4096

        return ChunkRestore(key=key, valid=lambda manifest: True, fill=fill,
                            copy=lambda buf: copies.__setitem__(key, bytes(buf.numpy())))

    counters, lost = ConnectorCounters(), []
    with ThreadPoolExecutor(1) as unused:
        pipe = RestorePipeline(next(iter(d.stores.values())), "ns", chunk_bytes=4096,
                               pool=unused, counters=counters,
                               on_lost=lambda *a: lost.append(a), locate=locate)
        try:
            assert pipe.run([item(k) for k in keys]) is None
            assert copies == {k: _payload(k, 4096) for k in keys}
            for key in keys:  # each on its own drive's pool
                assert read_on[key].startswith(f"read-{d.ids.index(d.home(key))}")
            # A chunk no drive holds: absent at once, the chunks before it restored.
            missing = _keys(1, "x")[0]
            copies.clear()
            assert pipe.run([item(keys[0]), item(missing), item(keys[1])]) == 1
            assert list(copies) == [keys[0]]
            assert counters.total(m.LOAD_ERRORS, reason="absent") == 1
            # A drive taken out: its chunk fails at once, without a read.
            prompt = [k for k in keys if d.home(k) != d.ids[2]][:3] + \
                [k for k in keys if d.home(k) == d.ids[2]][:1]
            for _ in range(3):
                guards[d.ids[2]].failed("restore")
            assert guards[d.ids[2]].down
            copies.clear()
            read_on.clear()
            assert pipe.run([item(k) for k in prompt]) == 3
            assert set(copies) == set(prompt[:3]) and prompt[3] not in read_on
            assert counters.total(m.LOAD_ERRORS, reason="disk_down") == 1
            # An entry gone behind the connector's back: lost on its drive only.
            gone = next(k for k in keys if d.home(k) == d.ids[0])
            d.stores[d.ids[0]].release(entry_id_for_key(gone))
            d.stores[d.ids[0]].delete_released([entry_id_for_key(gone)])
            assert pipe.run([item(gone)]) == 0
            assert lost == [(gone, d.ids[0])]
        finally:
            pipe.close()
            for guard in guards.values():
                guard.close()
            for pool in pools.values():
                pool.shutdown()
            d.close()


def entry_id_for_key(key: str) -> str:
    from spoolctl.store import entry_id_for

    return entry_id_for("vllm", "ns", key)


@pytest.fixture
def three_drive_worker(tmp_path: Path):
    """A worker connector over three drive directories (``spoolctl_roots``), its KV caches
    registered: ``worker``, ``roots``, and the vLLM configs ``vcfg``/``kcfg`` (a scheduler
    of the same process is built from them); shut down after the test."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_configs import vllm_configs

    from spoolctl.connector import SpoolConnector

    roots = _dirs(tmp_path, 3)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    vcfg, kcfg = vllm_configs(roots[0], [spec], num_blocks=8, spoolctl_scrub_rate="0",
                              spoolctl_probe_interval=3600)
    extra = vcfg.kv_transfer_config.kv_connector_extra_config
    del extra["spoolctl_root"]
    extra["spoolctl_roots"] = roots
    for root in roots:
        Path(root).mkdir(parents=True)
    worker = SpoolConnector(vcfg, KVConnectorRole.WORKER, kcfg)
    try:
        worker.register_kv_caches({"layer.0": torch.zeros(8, 2, 32, 64)})
        yield SimpleNamespace(worker=worker, roots=roots, vcfg=vcfg, kcfg=kcfg)
    finally:
        worker.shutdown()


def test_a_worker_over_three_drives_writes_each_chunk_home_and_fails_over_a_drive_taken_out(
        three_drive_worker) -> None:
    """The worker side wired over three drives (``spoolctl_roots``): a rank store on each,
    captures committed on each chunk's home, the handshake states every drive's chunks;
    when one drive's guard takes it out, the next step report withdraws exactly the chunks
    held only there, its chunks' writes go to their runner-ups (counted per drive), a
    restore reads the chunks of the drives still up and misses the down drive's at once;
    ``spoolctl_drive_failover_stores_total{drive}`` names the home's root."""
    from spoolctl.connector.diskguard import guard_for
    from spoolctl.connector.drives import placement as drives
    from spoolctl.connector.kv.formats import ChunkRestore
    from spoolctl.connector.planning.inventory import key_bytes

    worker, roots = three_drive_worker.worker, three_drive_worker.roots
    ws = worker.worker
    ids = [drives.read_drive_id(r) for r in roots]
    assert len(set(ids)) == 3 and None not in ids
    assert [str(Path(r).parent.parent) for r in worker.store_roots] == roots
    stores = ws.holdings.stores
    first = _keys(18, "w")
    for i, key in enumerate(first):
        ws.stager.stage(key, i, _fill(key), request="A")
    assert ws.flush(NET_S)
    ns = ws.namespace
    for drive in ids:
        assert stores[drive].live_keys("vllm", ns) == \
            {k for k in first if drives.home(k, ids) == drive}
    hs = worker.get_handshake_metadata()
    assert set(hs.report.added) == {key_bytes(k) for k in first}

    gone = ids[1]
    guard = guard_for(stores[gone])
    for _ in range(3):
        guard.failed("restore")
    assert guard.down
    report = worker.build_connector_worker_meta().reports[0]
    only_there = {k for k in first if drives.home(k, ids) == gone}
    assert only_there and set(report.removed) == {key_bytes(k) for k in only_there}
    second = _keys(18, "v")
    for i, key in enumerate(second):
        ws.stager.stage(key, i, _fill(key), request="B")
    assert ws.flush(NET_S)
    moved = [k for k in second if drives.home(k, ids) == gone]
    assert moved and not stores[gone].live_keys("vllm", ns) & set(second)
    assert ws.counters.total(m.DRIVE_FAILOVER_STORES, drive=roots[1]) == len(moved)
    # The connector's inventory_state shows each drive: its root, whether it serves, and
    # what it holds (the down drive's chunks are still on it, out of the rank's union).
    state = worker.inventory_state
    assert [(one["base"], one["drive"], one["up"]) for one in state["drives"]] == \
        [(root, drive, drive != gone) for root, drive in zip(roots, ids, strict=True)]
    assert [one["held"] for one in state["drives"]] == \
        [len(stores[drive].live_keys("vllm", ns)) for drive in ids]

    copies: dict[str, bytes] = {}
    chunk = ws.copier.chunk_bytes

    def item(key: str) -> ChunkRestore:
        def fill(store: Store, manifest, buf) -> int:
            store.read(manifest, "kv", into=memoryview(buf.numpy()))
            return chunk

        return ChunkRestore(key=key, valid=lambda manifest: True, fill=fill,
                            copy=lambda buf: copies.__setitem__(key, bytes(buf.numpy())))

    ws.pipeline.copy_in_reader = False
    served = [k for k in first if k not in only_there] + moved
    assert ws.pipeline.run([item(k) for k in served]) is None
    assert copies == {k: _payload(k, chunk) for k in served}
    assert ws.pipeline.run([item(served[0]), item(sorted(only_there)[0])]) == 1


# -- the scheduler's lookup over a rank's drives (decision 2714 item 5, first part) ------------


@pytest.mark.timeout(60)  # a lookup that waited on the hung drive would wait forever
def test_a_lookup_reads_every_drive_of_a_rank_ors_them_and_does_not_wait_on_a_hung_one(
        tmp_path: Path) -> None:
    """``RankLookup`` with rank 0 on three drives and rank 1 on one store: a key counts for
    rank 0 when any of its drives holds it, the ranks still AND (the quorum); a drive whose
    catalog is stuck answers nothing within the deadline while the others' keys still hit
    (``last_unserved`` says a store did not answer)."""
    from stuck_catalog import stuck_catalog

    from spoolctl.connector.deployment.topology import all_ranks
    from spoolctl.connector.scheduler_side.lookup import RankLookup

    d = _Drives(tmp_path)
    keys = _keys(6, "k")
    other = Store.open(Path(os.path.realpath(tmp_path)) / "rank-0001", create=True)
    lookup = RankLookup(all_ranks(2, 1), deadline_s=0.1, probe_interval_s=3600)
    try:
        for i, key in enumerate(keys):  # rank 0: key i on drive i % 3; rank 1: all but the last
            d.stores[d.ids[i % 3]].put(kind="vllm", namespace="ns", key=key,
                                       objects={"kv": key.encode()})
            if i < 5:
                other.put(kind="vllm", namespace="ns", key=key, objects={"kv": key.encode()})
        first, *more = (d.stores[i] for i in d.ids)
        assert lookup.read_locally(0, first, "ns") is None
        assert lookup.read_on_drives(0, more) == []
        lookup.read_locally(1, other, "ns")
        assert lookup.present(keys) == [True] * 5 + [False]
        assert not lookup.last_unserved
        assert len(lookup.local_stores()) == 4
        with stuck_catalog(d.stores[d.ids[1]]):
            assert lookup.present(keys) == [i % 3 != 1 and i < 5 for i in range(6)]
            assert lookup.last_unserved
    finally:
        lookup.stop_reading_locally()
        other.close()
        d.close()


def test_a_scheduler_and_a_worker_over_three_drives_lose_only_a_down_drives_share_once(
        three_drive_worker) -> None:
    """2714's plan, in-process (both connector roles of one process, as vLLM builds them):
    the worker stores a prompt's chunks on their homes over three drives; the scheduler
    reads every drive's catalog (the handshake's ``drives``) and the prompt is a full hit,
    restored with identical bytes from all three. One drive taken out: the lookup stops at
    the prompt's first chunk homed there (only its keys miss); the chunks recomputed for
    it are written to their runner-ups, and the next lookup of that prompt is a full hit
    again, restored while the drive is still out."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from spoolctl.connector import SpoolConnector
    from spoolctl.connector.diskguard import guard_for
    from spoolctl.connector.drives import placement as drives
    from spoolctl.connector.kv.formats import ChunkRestore
    from spoolctl.connector.scheduler_side.lookup import request_keys

    worker, roots = three_drive_worker.worker, three_drive_worker.roots
    vcfg, kcfg = three_drive_worker.vcfg, three_drive_worker.kcfg
    tokens = list(range(3, 3 + 12 * 64 + 5))  # twelve chunks of 64 tokens
    request = SimpleNamespace(request_id="r", prompt_token_ids=tokens, cache_salt=None,
                              kv_transfer_params=None, prompt_embeds=None, lora_request=None,
                              mm_features=None)
    sched = None
    try:
        sched = SpoolConnector(vcfg, KVConnectorRole.SCHEDULER, kcfg)
        hs = worker.get_handshake_metadata()
        ids = [drives.read_drive_id(r) for r in roots]
        assert [(d.base, d.drive_id) for d in hs.drives] == list(zip(roots, ids, strict=True))
        sched.set_xfer_handshake_metadata({0: hs})
        assert sorted(sched.store_roots) == sorted(worker.store_roots)

        def drive_state() -> list[tuple]:  # the scheduler's view of rank 0's drives
            return [(d["base"], d["drive"], d["source"], d["up"], d["late"])
                    for d in sched.inventory_state[0]["drives"]]

        assert drive_state() == [(r, i, "catalog", True, False)
                                 for r, i in zip(roots, ids, strict=True)]
        side, ws = sched.scheduler, worker.worker
        # drive ids are random: take a prompt whose twelve chunks are homed on all three
        for start in range(3, 3 + 50):
            tokens = list(range(start, start + 12 * 64 + 5))
            request.prompt_token_ids = tokens
            keys = request_keys(request, namespace=side.deployment.chain_namespace,
                                chunk_tokens=64)
            if {drives.home(k, ids) for k in keys} == set(ids):
                break
        assert len(keys) == 12 and {drives.home(k, ids) for k in keys} == set(ids)

        def store(wanted: list[str]) -> None:
            for i, key in enumerate(wanted):
                ws.stager.stage(key, i, _fill(key), request=f"store-{key}")
            assert ws.flush(NET_S)

        def hit() -> int:
            return sched.get_num_new_matched_tokens(request, 0)[0] or 0

        chunk = ws.copier.chunk_bytes

        def restore(wanted: list[str]) -> dict[str, bytes]:
            copies: dict[str, bytes] = {}

            def item(key: str) -> ChunkRestore:
                def fill(st: Store, manifest, buf) -> int:
                    st.read(manifest, "kv", into=memoryview(buf.numpy()))
                    return chunk

                return ChunkRestore(key=key, valid=lambda manifest: True, fill=fill,
                                    copy=lambda buf: copies.__setitem__(key,
                                                                        bytes(buf.numpy())))

            ws.pipeline.copy_in_reader = False
            assert ws.pipeline.run([item(k) for k in wanted]) is None
            return copies

        assert hit() == 0
        store(keys)
        assert hit() == 12 * 64
        assert restore(keys) == {k: _payload(k, chunk) for k in keys}

        gone = drives.home(keys[3], ids)
        first_gone = next(i for i, k in enumerate(keys) if drives.home(k, ids) == gone)
        guard = guard_for(ws.holdings.stores[gone])  # the worker's and the scheduler's
        for _ in range(3):
            guard.failed("restore")
        assert guard.down
        assert drive_state() == [(r, i, "catalog", i != gone, False)
                                 for r, i in zip(roots, ids, strict=True)]
        assert sched.inventory_state[0]["disk_down"] is True
        assert hit() == first_gone * 64  # only the down drive's chunks miss
        missed = [k for k in keys if drives.home(k, ids) == gone]
        store(missed)  # recomputed: written to their runner-ups
        assert ws.counters.total(m.DRIVE_FAILOVER_STORES, drive=roots[ids.index(gone)]) \
            == len(missed)
        assert hit() == 12 * 64  # the next request with that prefix: a full hit
        assert restore(keys) == {k: _payload(k, chunk) for k in keys}
    finally:
        if sched is not None:
            sched.shutdown()


def test_a_full_drive_evicts_on_itself_only_a_copy_held_elsewhere_at_once(
        tmp_path: Path) -> None:
    """Capacity per drive (2714 item 7): the drive over its max size evicts its own
    entries only; a victim another up drive also holds is deleted at once (the rank still
    holds it), one held nowhere else is withdrawn and deleted on that drive after the
    scheduler's acknowledgement; the other drive is untouched. Also a set of one drive
    (every other drive pending at start): its withdrawals are deleted on it."""
    from spoolctl.connector.planning.inventory import InventoryView, key_bytes
    from spoolctl.connector.worker_side.holdings import RankHoldings

    d = _Drives(tmp_path, 2)
    full, spare = d.ids
    keys = _keys(8, "f")
    try:
        for key in keys:
            d.stores[full].put(kind="vllm", namespace="ns", key=key,
                               objects={"kv": _payload(key, 4096)})
        twin = keys[0]  # the least recently used: first to go, and held on both drives
        d.stores[spare].put(kind="vllm", namespace="ns", key=twin,
                            objects={"kv": _payload(twin, 4096)})
        d.stores[full].set_max_bytes(d.stores[full].totals().bytes // 2)
        holdings = RankHoldings.for_drives(d.stores, d.up.__contains__, kind="vllm",
                                           namespace="ns", rank=0, epoch=1)
        holdings.rescan()
        view = InventoryView()
        view.apply(holdings.handshake_report())
        holdings.enforce_capacity()
        assert twin not in d.on(full) and twin in d.on(spare)  # deleted at once
        assert holdings.locate(twin) == spare and twin in holdings.held_keys()
        report = holdings.step_report()
        withdrawn = {k.hex() for k in report.removed}
        assert withdrawn and twin not in withdrawn and withdrawn <= set(keys)
        kept = {k for k in withdrawn if d.stores[full].row(entry_id_for_key(k)) is not None}
        assert kept == withdrawn  # released, kept until acknowledged
        view.apply(report)
        holdings.on_scheduler(view.acks(), {})
        holdings.delete_acknowledged()
        assert not [k for k in withdrawn if d.stores[full].row(entry_id_for_key(k))]
        assert d.on(spare) == {twin} and len(d.on(full)) == len(keys) - 1 - len(withdrawn)
        # A set of one drive (the others pending at start): a drop is withdrawn on it.
        alone = RankHoldings.for_drives({spare: d.stores[spare]}, d.up.__contains__,
                                        kind="vllm", namespace="ns", rank=1, epoch=1)
        alone.rescan()
        assert alone.locate(twin) == spare
        alone.on_scheduler({}, {}, drops=[key_bytes(twin)])
        alone.drop_requested()
        assert twin not in d.on(spare)
    finally:
        d.close()


# -- one keeper per drive, duplicates released, per-drive state (decision 2760) ---------------


@pytest.mark.timeout(120)  # one thread for every drive never evicts: the wait below fails
def test_a_drive_whose_store_io_hangs_stops_only_its_own_keeper(tmp_path: Path) -> None:
    """A drive whose catalog is stuck (what a writer blocked in the kernel holds), before
    any guard sees it: the other drives' capacity is still enforced, their withdrawals
    acknowledged and deleted; the engine loop's calls answer from memory; ``state()`` shows
    the stuck keeper; ``stop()`` returns within its bound, leaving only that keeper."""
    import threading

    from waiting import wait_until

    from spoolctl.connector.planning.inventory import InventoryView
    from spoolctl.connector.worker_side.holdings import RankHoldings

    d = _Drives(tmp_path)
    hung, full, _ = d.ids
    keys = _keys(8, "h")
    for key in keys:
        d.stores[full].put(kind="vllm", namespace="ns", key=key,
                           objects={"kv": _payload(key, 4096)})
    bound = d.stores[full].totals().bytes // 2
    for store in d.stores.values():  # every keeper's capacity step reads its drive
        store.set_max_bytes(d.stores[full].totals().bytes * 4)
    holdings = RankHoldings.for_drives(d.stores, d.up.__contains__, kind="vllm",
                                       namespace="ns", rank=0, epoch=1, rescan_s=0.05)
    holdings.stop_bound_s = 0.2  # what stop() may wait for the keepers together
    holdings.start()
    view = InventoryView()
    view.apply(holdings.handshake_report())
    held, release = threading.Event(), threading.Event()

    def stuck_writer() -> None:
        with d.stores[hung].catalog.held():
            held.set()
            release.wait()

    writer = threading.Thread(target=stuck_writer, daemon=True)
    writer.start()
    held.wait()
    keepers: dict[str, threading.Thread] = {}
    try:
        d.stores[full].set_max_bytes(bound)  # the full drive goes over its max size
        holdings.committed(keys[-1], full)  # a commit wakes that drive's keeper

        def settled() -> bool:
            report = holdings.step_report()
            if report is not None:
                view.apply(report)
                holdings.on_scheduler(view.acks(), {})
            # ... and its acknowledged deletes counted (they happened on the full drive)
            return d.stores[full].totals().bytes <= bound and holdings.withdrawn_then_deleted
        wait_until(settled, 30, what="the full drive evicted while another drive hangs")
        assert len(d.on(full)) < len(keys)
        assert holdings.locate(keys[-1]) in (full, None)  # memory only: it answers

        def hung_busy() -> bool:
            state = holdings.state()
            return {one["drive"]: one["busy_s"] for one in state["drives"]}[hung] is not None
        wait_until(hung_busy, 30, what="state() showing the hung drive's keeper in a step")
        keepers.update(holdings.keeper_threads().items())
        holdings.stop()  # within its bound, although one keeper is stuck
        assert not keepers[full].is_alive() and keepers[hung].is_alive()
    finally:
        release.set()
        writer.join(NET_S)
        holdings.stop()
        for thread in keepers.values():  # the stuck one ends once its disk answers
            thread.join(NET_S)
        d.close()


@pytest.mark.timeout(60)  # a start that scanned every drive itself waited on the hung one
def test_a_drive_hung_at_start_does_not_hold_the_start_its_chunks_count_once_it_answers(
        tmp_path: Path, caplog) -> None:
    """``start()`` over several drives waits for the drives' first scans within its bound:
    a drive whose catalog is stuck does not hold ``register_kv_caches`` (one warning naming
    it); the other drives' chunks are in the handshake, and the stuck drive's are reported
    once its keeper's scan ends."""
    import threading

    from waiting import wait_until

    from spoolctl.connector.planning.inventory import key_bytes
    from spoolctl.connector.worker_side.holdings import RankHoldings

    d = _Drives(tmp_path)
    keys = _keys(6, "start")
    for i, key in enumerate(keys):
        d.stores[d.ids[i % 3]].put(kind="vllm", namespace="ns", key=key,
                                   objects={"kv": _payload(key, 4096)})
    holdings = RankHoldings.for_drives(d.stores, d.up.__contains__, kind="vllm",
                                       namespace="ns", rank=0, epoch=1)
    holdings.start_scan_s = 0.2  # what start() may wait for the first scans together
    held, release = threading.Event(), threading.Event()

    def stuck_writer() -> None:
        with d.stores[d.ids[0]].catalog.held():
            held.set()
            release.wait()

    writer = threading.Thread(target=stuck_writer, daemon=True)
    writer.start()
    held.wait()
    try:
        holdings.start()
        hs = holdings.handshake_report()
        assert set(hs.added) == {key_bytes(k) for i, k in enumerate(keys) if i % 3}
        assert [r.message for r in caplog.records if "inventory scan" in r.message] == [
            f"spoolctl: drive {d.ids[0]} did not answer its inventory scan within 0.2 s; its "
            "chunks count once it does"]
        release.set()
        wait_until(lambda: holdings.held_keys() == set(keys), NET_S,
                   what="the stuck drive's chunks counted once it answers")
        assert set(holdings.step_report().added) == {key_bytes(k) for k in keys[::3]}
    finally:
        release.set()
        writer.join(NET_S)
        holdings.stop()
        d.close()


def test_a_copy_written_while_its_home_was_down_is_released_once_the_home_is_back(
        tmp_path: Path) -> None:
    """Chunks stored on their homes, the home taken out, the same chunks stored again
    (on their runner-ups), the home back: at rescans the runner-up copies are deleted once
    redundant for the grace period (never at once: a restore may have located them), the
    home's copy is what ``locate`` reads, a copy that is the only one stays, and restores
    give identical bytes. Counted in ``state()``, per drive."""
    pytest.importorskip("torch")
    from concurrent.futures import ThreadPoolExecutor

    from spoolctl.connector.drives import placement as drives
    from spoolctl.connector.kv.formats import ChunkRestore
    from spoolctl.connector.stats import ConnectorCounters
    from spoolctl.connector.worker_side.holdings import RankHoldings
    from spoolctl.connector.worker_side.restore import Located, RestorePipeline

    d = _Drives(tmp_path)
    now = [0.0]
    holdings = RankHoldings.for_drives(d.stores, d.up.__contains__, kind="vllm",
                                       namespace="ns", rank=0, epoch=1,
                                       clock=lambda: now[0])
    stager = _stager(d, holdings, ConnectorCounters())
    keys, alone = _keys(24, "d"), _keys(24, "e")
    gone = d.home(keys[0])
    twice = [k for k in keys if d.home(k) == gone]
    only = [k for k in alone if d.home(k) == gone]

    def store(wanted: list[str]) -> None:
        for i, key in enumerate(wanted):
            stager.stage(key, i, _fill(key), request=f"r-{key}")
        assert stager.flush(NET_S)

    def copies(key: str) -> list[str]:
        return [drive for drive in d.ids if key in d.on(drive)]

    try:
        store(keys)
        d.up.discard(gone)
        holdings.drives_changed()
        store(twice + only)  # recomputed while the home is out: on the runner-ups
        runner = {k: drives.route(k, d.ids, d.up) for k in twice + only}
        d.up.add(gone)
        holdings.drives_changed()
        holdings.rescan()
        assert all(copies(k) == sorted([gone, runner[k]], key=d.ids.index) for k in twice)
        assert all(holdings.locate(k) == gone for k in twice)  # the home's copy is read
        bytes_before = sum(d.stores[r].totals().bytes for r in set(runner.values()))
        now[0] += 3600  # past the grace: no restore that located the runner-up's copy is left
        holdings.rescan()
        assert all(copies(k) == [gone] for k in twice)  # exactly one copy: the home's
        assert all(copies(k) == [runner[k]] for k in only)  # never the last copy
        assert holdings.duplicates_released == len(twice) > 0
        assert sum(d.stores[r].totals().bytes for r in set(runner.values())) < bytes_before
        state = holdings.state()
        assert state["duplicates_released"] == len(twice)
        per = {one["drive"]: one for one in state["drives"]}
        assert sum(one["duplicates_released"] for one in per.values()) == len(twice)
        assert per[gone]["duplicates_released"] == 0
        assert holdings.held_keys() == set(keys) | set(only)
        # Restores read each chunk where it is, with identical bytes.
        got: dict[str, bytes] = {}
        pools = {drive: ThreadPoolExecutor(1) for drive in d.ids}

        def locate(key: str) -> Located | None:
            drive = holdings.locate(key)
            return None if drive is None else Located(drive, d.stores[drive], None, pools[drive])

        def item(key: str) -> ChunkRestore:
            def fill(st: Store, manifest, buf) -> int:
                st.read(manifest, "kv", into=memoryview(buf.numpy()))
                return 4096

            return ChunkRestore(key=key, valid=lambda manifest: True, fill=fill,
                                copy=lambda buf: got.__setitem__(key, bytes(buf.numpy())))

        pipe = RestorePipeline(d.stores[gone], "ns", chunk_bytes=4096, pool=pools[gone],
                               counters=ConnectorCounters(), on_lost=lambda *a: None,
                               locate=locate)
        try:
            assert pipe.run([item(k) for k in keys + only]) is None
            assert got == {k: _payload(k, 4096) for k in keys + only}
        finally:
            pipe.close()
            for pool in pools.values():
                pool.shutdown()
    finally:
        assert stager.close(NET_S)
        d.close()


def test_state_shows_each_drive_and_one_store_keeps_its_dict(tmp_path: Path) -> None:
    """``state()`` over several drives lists each drive (id, base, root, up, held, bytes,
    max size, evictions, released duplicates); the rank's max is the drives' sum. One store
    keeps exactly the dict it had."""
    from spoolctl.connector.worker_side.holdings import RankHoldings

    d = _Drives(tmp_path)
    try:
        for i, key in enumerate(_keys(6, "s")):
            d.stores[d.ids[i % 3]].put(kind="vllm", namespace="ns", key=key,
                                       objects={"kv": _payload(key, 4096)})
        for store in d.stores.values():
            store.set_max_bytes(1 << 30)
        d.up.discard(d.ids[2])
        holdings = RankHoldings.for_drives(d.stores, d.up.__contains__, kind="vllm",
                                           namespace="ns", rank=0, epoch=1, bases=d.labels)
        holdings.start()
        try:
            state = holdings.state()
        finally:
            holdings.stop()
        assert state["held"] == 4 and state["max_bytes"] == 3 << 30
        assert [(one["drive"], one["base"], one["root"], one["up"]) for one in state["drives"]] \
            == [(drive, d.labels[drive], str(d.stores[drive].root), drive != d.ids[2])
                for drive in d.ids]
        up = state["drives"][:2]
        assert [one["held"] for one in up] == [2, 2]
        assert [one["bytes"] for one in up] == [d.stores[x].totals().bytes for x in d.ids[:2]]
        assert state["drives"][2]["bytes"] is None  # a down drive is not read
        assert all(one["max_bytes"] == 1 << 30 and one["evicted_entries"] == 0
                   for one in state["drives"])
        one_store = RankHoldings(d.stores[d.ids[0]], kind="vllm", namespace="ns", rank=0,
                                 epoch=1)
        one_store.start()
        try:
            assert one_store.state() == {
                "epoch": 1, "held": 2, "awaiting_ack": 0, "withdrawn_then_deleted": 0,
                "evicted_entries": 0, "dropped": 0, "max_bytes": 1 << 30}
        finally:
            one_store.stop()
    finally:
        d.close()


def test_a_drive_added_after_start_is_scanned_by_its_own_keeper_and_then_counts(
        tmp_path: Path) -> None:
    """``add_drive``: a drive that opened after start joins the set; its keeper scans it,
    then its keys are held by the rank (the next step report adds them) and ``locate``
    reads them there."""
    from waiting import wait_until

    from spoolctl.connector.planning.inventory import key_bytes
    from spoolctl.connector.worker_side.holdings import RankHoldings

    d = _Drives(tmp_path)
    early, late = d.ids[:2], d.ids[2]
    keys = _keys(4, "late")
    try:
        for key in keys:
            d.stores[late].put(kind="vllm", namespace="ns", key=key,
                               objects={"kv": _payload(key, 4096)})
        holdings = RankHoldings.for_drives({x: d.stores[x] for x in early}, d.up.__contains__,
                                           kind="vllm", namespace="ns", rank=0, epoch=1)
        holdings.start()
        try:
            holdings.handshake_report()
            assert holdings.locate(keys[0]) is None
            holdings.add_drive(late, d.stores[late])
            wait_until(lambda: holdings.locate(keys[0]) == late, NET_S,
                       what="the added drive scanned by its keeper")
            assert holdings.held_keys() == set(keys)
            assert set(holdings.step_report().added) == {key_bytes(k) for k in keys}
            assert [one["drive"] for one in holdings.state()["drives"]] == d.ids
        finally:
            holdings.stop()
    finally:
        d.close()


# -- a drive that opens after the engine started joins the running set (decision 2750) ---------


def test_a_drive_missing_at_start_joins_the_running_set_and_the_scheduler_reads_it(
        tmp_path: Path) -> None:
    """Three drive roots, the third not mounted when the engine starts (its base absent):
    the worker and the scheduler serve on the other two (a prompt's chunks homed on the
    third by the rule over all three land on their runner-ups). The drive then appears,
    holding a rank store with another prompt from an earlier run. Without a restart, after
    the retry interval: the worker takes it into its set (what it held is in the rank's
    inventory and restores with identical bytes), a new prompt's chunks homed on it are
    written to it (no failover counted), the worker's next step output names the rank's
    drives, and the scheduler then reads the new drive too: a prompt held only there is a
    full hit."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_configs import vllm_configs
    from waiting import wait_until

    from spoolctl.connector import SpoolConnector
    from spoolctl.connector.diskguard import guard_for
    from spoolctl.connector.drives import placement as drives
    from spoolctl.connector.kv.formats import ChunkRestore
    from spoolctl.connector.planning.inventory import key_bytes
    from spoolctl.connector.scheduler_side.lookup import request_keys

    roots = _dirs(tmp_path, 3)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    vcfg, kcfg = vllm_configs(roots[0], [spec], num_blocks=8, spoolctl_scrub_rate="0",
                              spoolctl_probe_interval=0.05, spoolctl_lookup_deadline=0.5)
    extra = vcfg.kv_transfer_config.kv_connector_extra_config
    del extra["spoolctl_root"]
    extra["spoolctl_roots"] = roots
    for root in roots[:2]:
        Path(root).mkdir(parents=True)

    def request(name: str, first: int) -> SimpleNamespace:
        return SimpleNamespace(request_id=name, prompt_token_ids=list(range(
            first, first + 12 * 64 + 5)), cache_salt=None, kv_transfer_params=None,
            prompt_embeds=None, lora_request=None, mm_features=None)  # twelve chunks

    old, new, held = request("a", 3), request("b", 5000), request("c", 9000)
    worker = SpoolConnector(vcfg, KVConnectorRole.WORKER, kcfg)
    sched, guards = None, []
    try:
        worker.register_kv_caches({"layer.0": torch.zeros(8, 2, 32, 64)})
        ws = worker.worker
        # No periodic rescan during the test: the joined drive must be scanned as it joins.
        ws.holdings.rescan_s = 3600
        sched = SpoolConnector(vcfg, KVConnectorRole.SCHEDULER, kcfg)
        hs = worker.get_handshake_metadata()
        assert len(hs.drives) == 2
        sched.set_xfer_handshake_metadata({0: hs})
        assert len(sched.store_roots) == 2
        side, ns = sched.scheduler, ws.namespace
        chunk = ws.copier.chunk_bytes

        def keys_of(req: SimpleNamespace) -> list[str]:
            return request_keys(req, namespace=side.deployment.chain_namespace, chunk_tokens=64)

        def store(wanted: list[str]) -> None:
            for i, key in enumerate(wanted):
                ws.stager.stage(key, i, _fill(key), request=f"store-{key}")
            assert ws.flush(NET_S)

        def hit(req: SimpleNamespace) -> int:
            return sched.get_num_new_matched_tokens(req, 0)[0] or 0

        def restore(wanted: list[str]) -> dict[str, bytes]:
            copies: dict[str, bytes] = {}

            def item(key: str) -> ChunkRestore:
                def fill(st: Store, manifest, buf) -> int:
                    st.read(manifest, "kv", into=memoryview(buf.numpy()))
                    return chunk

                return ChunkRestore(key=key, valid=lambda manifest: True, fill=fill,
                                    copy=lambda buf: copies.__setitem__(key,
                                                                        bytes(buf.numpy())))

            ws.pipeline.copy_in_reader = False
            assert ws.pipeline.run([item(k) for k in wanted]) is None
            return copies

        # The third drive as an earlier run left it, mounted elsewhere for now: its id, and
        # a rank store holding prompt ``held``.
        staged = Path(os.path.realpath(tmp_path)) / "staged" / "spool"
        staged.mkdir(parents=True)
        late = drives.drive_id(staged)
        rank_root = Path(ws.drives.slots[2].root)
        with Store.open(staged / rank_root.relative_to(roots[2]), create=True) as earlier:
            for key in keys_of(held):
                earlier.put(kind="vllm", namespace=ns, key=key,
                            objects={"kv": _payload(key, chunk)})
        keys = keys_of(old)
        store(keys)
        assert hit(old) == 12 * 64
        ids = [*(drives.read_drive_id(r) for r in roots[:2]), late]
        homed = [k for k in keys if drives.home(k, ids) == late]
        assert homed  # on their runner-ups, where the rule over all three puts them
        for key in homed:
            runner_up = drives.ranked(key, ids)[1]
            assert key in ws.holdings.stores[runner_up].live_keys("vllm", ns)
        assert hit(held) == 0

        os.rename(staged.parent, Path(roots[2]).parent)  # mounted
        metas: list[object] = []
        wait_until(lambda: metas.append(worker.build_connector_worker_meta()) or (
            metas[-1] is not None and metas[-1].drives), NET_S, what="the drive joined")
        (infos,) = metas[-1].drives.values()
        assert [(d.base, d.drive_id) for d in infos] == list(zip(roots, ids, strict=True))
        assert ws.holdings.drive_ids() == ids
        # What it held: in the rank's inventory once scanned, and restorable.
        wait_until(lambda: all(ws.holdings.locate(k) == late for k in keys_of(held)),
                   NET_S, what="the joined drive scanned")
        assert {key_bytes(k) for k in keys_of(held)} <= {
            key_bytes(k) for k in ws.holdings.held_keys()}
        assert restore(keys_of(held)) == {k: _payload(k, chunk) for k in keys_of(held)}
        assert [(d["base"], d["drive"]) for d in worker.inventory_state["drives"]] == \
            list(zip(roots, ids, strict=True))  # the joined drive named by its root
        # New chunks homed on it are written to it, none counted as a failover.
        fresh = keys_of(new)

        def files() -> set[Path]:
            return {p for p in (rank_root / "objects").rglob("*") if p.is_file()}

        before = files()
        store(fresh)
        on_late = {k for k in fresh if drives.home(k, ids) == late}
        assert on_late and on_late <= ws.holdings.stores[late].live_keys("vllm", ns)
        assert len(files() - before) >= len(on_late)  # their objects, on that drive
        assert ws.counters.total(m.DRIVE_FAILOVER_STORES) == 0
        # The scheduler reads it once told: a prompt held only there is a full hit.
        assert hit(held) == 0
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=metas[-1]))
        wait_until(lambda: hit(held) == 12 * 64, NET_S, what="the scheduler reading it")
        assert len(sched.store_roots) == 3
        # The scheduler's inventory_state names each drive, the joined one as opened late.
        assert [(d["base"], d["drive"], d["source"], d["up"], d["late"])
                for d in sched.inventory_state[0]["drives"]] == \
            [(r, i, "catalog", True, i == late) for r, i in zip(roots, ids, strict=True)]
        assert hit(new) == 12 * 64 and hit(old) == 12 * 64
        assert restore(fresh) == {k: _payload(k, chunk) for k in fresh}
        guards = [guard_for(st) for st in ws.holdings.stores.values()]
    finally:
        if sched is not None:
            sched.shutdown()
        worker.shutdown()
    # Shutdown stops every drive's parts, the joined one's too (its guard stops probing).
    assert len(guards) == 3 and all(g.closed for g in guards)


def test_a_late_drive_the_scheduler_cannot_open_yet_is_retried(tmp_path: Path) -> None:
    """``LateDrives``: a drive a worker names whose store is not there yet is tried again
    every probe interval on its own thread (``want`` returns at once); once the store
    exists it is handed to the caller, once; ``close`` releases what was never taken."""
    from waiting import wait_until

    from spoolctl.connector.drives.rankstores import OpenStores
    from spoolctl.connector.planning.messages import DriveInfo
    from spoolctl.connector.scheduler_side.latedrives import LateDrives

    base = Path(_dirs(tmp_path, 1)[0])
    root = base / "vllm-v1-x" / "rank-0000"
    stores = OpenStores()
    late = LateDrives(stores, tag_key=None, deadline_s=0.2, probe_interval_s=0.05)
    info = DriveInfo(str(base), str(root), "d", "s")
    try:
        late.want(0, info)
        late.want(0, info)  # once per drive
        assert late.take() == []
        Store.open(root, create=True).close()  # its worker created it
        got = wait_until(late.take, NET_S, what="the drive opened")
        (rank, named, store), = got
        assert (rank, named) == (0, info) and stores.roots() == [str(root)]
        stores.release(store)
        late.want(1, DriveInfo(str(base), str(root), "d", "s"))  # opened, never taken
        wait_until(lambda: stores.roots(), NET_S, what="the second opening")
    finally:
        late.close()
    # An opening that returns after ``close`` releases its own store on its thread.
    wait_until(lambda: stores.roots() == [], NET_S, what="every store released")


@pytest.mark.extended  # a FUSE mount and both connector roles (~5 s)
def test_a_drive_hung_at_start_joins_the_running_set_when_it_answers(
        tmp_path: Path) -> None:
    """As a user meets it: the third drive hangs when the engine starts (its drive marker
    and rank store from an earlier run; the store's objects on a FUSE mount that hangs).
    The worker starts within its bound and serves on the other two; when the mount
    answers, the drive joins without a restart: what it held is located there, chunks
    homed on it are routed to it, and a same-host scheduler counts a prompt held only
    there as a hit."""
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
    from spoolctl.connector.drives import placement as drives
    from spoolctl.connector.scheduler_side.lookup import request_keys

    roots = _dirs(tmp_path, 3)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    vcfg, kcfg = vllm_configs(roots[0], [spec], num_blocks=8, spoolctl_scrub_rate="0",
                              spoolctl_probe_interval=0.05, spoolctl_lookup_deadline=0.1)
    extra = vcfg.kv_transfer_config.kv_connector_extra_config
    del extra["spoolctl_root"]
    extra["spoolctl_roots"] = roots
    for root in roots:
        Path(root).mkdir(parents=True)
    earlier = SpoolConnector(vcfg, KVConnectorRole.WORKER, kcfg)  # a run before: ids, stores
    earlier.register_kv_caches({"layer.0": torch.zeros(8, 2, 32, 64)})
    third = Path(earlier.worker.drives.slots[2].root)
    ns, chain = earlier.worker.namespace, earlier.worker.deployment.chain_namespace
    earlier.shutdown()
    ids = [drives.read_drive_id(r) for r in roots]
    tokens = list(range(7, 7 + 12 * 64 + 5))
    request = SimpleNamespace(request_id="r", prompt_token_ids=tokens, cache_salt=None,
                              kv_transfer_params=None, prompt_embeds=None, lora_request=None,
                              mm_features=None)
    keys = request_keys(request, namespace=chain, chunk_tokens=64)
    with Store.open(third) as store:  # the earlier run stored this prompt on it
        for key in keys:
            store.put(kind="vllm", namespace=ns, key=key, objects={"kv": b"x" * 100})
    # Its rank store's objects on a mount that hangs (``Store.open`` scans them; the whole
    # store on the test's FUSE layer would take SQLite's shared memory there too).
    with ControlledMount(third / "objects", tmp_path / "fuse") as mount:
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
            assert got, "the worker's start waited on the hung drive"
            worker = got[0]
            ws = worker.worker
            hs = worker.get_handshake_metadata()
            assert [d.drive_id for d in hs.drives] == ids[:2]
            sched = SpoolConnector(vcfg, KVConnectorRole.SCHEDULER, kcfg)
            sched.set_xfer_handshake_metadata({0: hs})
            assert sched.get_num_new_matched_tokens(request, 0)[0] == 0
            mount.release()
            metas: list[object] = []
            wait_until(lambda: metas.append(worker.build_connector_worker_meta()) or (
                metas[-1] is not None and metas[-1].drives), NET_S, what="the drive joined")
            assert ws.holdings.drive_ids() == ids
            wait_until(lambda: all(ws.holdings.locate(k) == ids[2] for k in keys), NET_S,
                       what="the joined drive scanned")
            # Its share of new writes: routed to it (the writes themselves are not tried
            # here: its objects are on another filesystem than the rest of its store).
            assert all(ws.drives.route(k)[0] == ids[2]
                       for k in keys if drives.home(k, ids) == ids[2])
            sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=metas[-1]))
            wait_until(lambda: sched.get_num_new_matched_tokens(request, 0)[0] == 12 * 64,
                       NET_S, what="the scheduler reading the drive")
        finally:
            mount.release()
            if sched is not None:
                sched.shutdown()
            if got:
                got[0].shutdown()


# -- each drive's health is its own: a hung commit, a late read (decision 2770) ---------------


@pytest.mark.parametrize("n", [1, 3])
def test_a_commit_hung_past_its_bound_takes_its_drive_out_until_it_ends(
        tmp_path: Path, n: int) -> None:
    """A commit that hangs on a drive (its writer's one thread stuck, so no second commit
    can fail) takes that drive out once it is past its bound (``writer.commit_bound``):
    the next step's ``save`` tells the drive's guard. With three drives the keys held only
    there are withdrawn, its new chunks are written to their runner-ups (counted per home
    drive), a restore no longer reads it; with one root its restores fail at once
    (``disk_down``). When the commit ends the probe brings the drive back and the hung
    chunk is committed there."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from stuck_catalog import stuck_catalog
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_configs import vllm_configs
    from waiting import wait_until

    from spoolctl.connector import SpoolConnector
    from spoolctl.connector.diskguard import guard_for
    from spoolctl.connector.drives import placement as drives
    from spoolctl.connector.kv.formats import ChunkRestore
    from spoolctl.connector.planning.inventory import key_bytes
    from spoolctl.connector.planning.messages import SpoolConnectorMetadata

    roots = _dirs(tmp_path, n)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    vcfg, kcfg = vllm_configs(roots[0], [spec], num_blocks=8, spoolctl_scrub_rate="0",
                              spoolctl_probe_interval=0.05, spoolctl_read_deadline=0.05)
    extra = vcfg.kv_transfer_config.kv_connector_extra_config
    if n > 1:
        del extra["spoolctl_root"]
        extra["spoolctl_roots"] = roots
    for root in roots:
        Path(root).mkdir(parents=True)
    worker = SpoolConnector(vcfg, KVConnectorRole.WORKER, kcfg)
    try:
        worker.register_kv_caches({"layer.0": torch.zeros(8, 2, 32, 64)})
        ws = worker.worker
        ns = ws.namespace
        if n > 1:
            ids = [drives.read_drive_id(r) for r in roots]
            stores = ws.holdings.stores
        else:
            ids, stores = [""], {"": ws.drives.primary}
        first = _keys(18, "w")
        for i, key in enumerate(first):
            ws.stager.stage(key, i, _fill(key), request="A")
        assert ws.flush(NET_S)
        worker.get_handshake_metadata()  # the scheduler knows every committed chunk
        gone = ids[-1]
        guard = guard_for(stores[gone])

        def home(key: str) -> str:
            return drives.home(key, ids) if n > 1 else ""

        hung = next(k for k in _keys(40, "h") if home(k) == gone)
        with stuck_catalog(stores[gone]) as disk:
            ws.stager.stage(hung, 0, _fill(hung), request="H")  # its commit hangs
            # Each engine step's save looks at the commits (memory only): once this one is
            # past its bound (0.2 s here) the drive is out.
            wait_until(lambda: (ws.save(SpoolConnectorMetadata()), guard.down)[1], 20,
                       what="the drive taken out for its hung commit")
            chunk = ws.copier.chunk_bytes

            def item(key: str) -> ChunkRestore:
                def fill(store: Store, manifest, buf) -> int:
                    store.read(manifest, "kv", into=memoryview(buf.numpy()))
                    return chunk

                return ChunkRestore(key=key, valid=lambda manifest: True, fill=fill,
                                    copy=lambda buf: None)

            ws.pipeline.copy_in_reader = False
            there = [k for k in first if home(k) == gone]
            if n == 1:
                assert ws.pipeline.run([item(first[0])]) == 0
                assert ws.counters.total(m.LOAD_ERRORS, reason="disk_down") == 1
            else:
                report = worker.build_connector_worker_meta().reports[0]
                assert there and set(report.removed) == {key_bytes(k) for k in there}
                second = _keys(18, "v")
                for i, key in enumerate(second):
                    ws.stager.stage(key, i, _fill(key), request="B")
                for drive, writer in ws.stager.writers.items():
                    assert drive == gone or writer.flush(NET_S)
                moved = [k for k in second if home(k) == gone]
                assert moved and ws.counters.total(
                    m.DRIVE_FAILOVER_STORES, drive=roots[-1]) == len(moved)
                for key in moved:
                    assert key in stores[drives.route(key, ids, set(ids[:-1]))].live_keys(
                        "vllm", ns)
                ok = next(k for k in first if home(k) != gone)
                assert ws.pipeline.run([item(ok), item(there[0])]) == 1
            disk.release()  # the commit ends; the probe brings the drive back
            wait_until(lambda: not guard.down, NET_S, what="the probe")
        assert ws.flush(NET_S)
        assert hung in stores[gone].live_keys("vllm", ns)
    finally:
        worker.shutdown()


def test_the_probe_keeps_a_drive_out_while_its_hung_commit_still_runs(tmp_path: Path) -> None:
    """``DiskGuard.stuck``: out at once (one hung commit is enough: it holds its writer's
    one thread), and kept out while the commit still runs although the drive's reads
    answer (the probe asks first); back at the first probe after it ended."""
    from waiting import wait_until

    from spoolctl.connector.diskguard import DiskGuard

    running, asked = [True], []

    def still() -> bool:
        asked.append(1)
        return running[0]

    with Store.open(Path(os.path.realpath(tmp_path)) / "rank-0000", create=True) as store:
        guard = DiskGuard(store, probe_interval_s=0.02)
        changes: list[bool] = []
        guard.listen(changes.append)
        try:
            guard.stuck("commit", still)
            assert guard.down and changes == [True]
            wait_until(lambda: len(asked) >= 3, NET_S, what="three probes")
            assert guard.down  # the reads answer, the commit does not
            running[0] = False
            # the guard comes back, then tells its listeners (on the probe's thread)
            wait_until(lambda: len(changes) == 2, NET_S, what="the probe's notice")
            assert not guard.down and changes == [True, False]
        finally:
            guard.close()


def test_a_drive_with_a_read_past_its_deadline_gets_no_new_reads(tmp_path: Path) -> None:
    """Three drives, one whose reads hang: the restore waiting on it fails at its deadline
    and the read stays stuck on that drive's pool. A later restore's chunk on that drive is
    not queued behind it: it fails at once (``disk_slow``, never read), the chunks before
    it restored; the other drives' chunks still restore; the third failure takes the drive
    out (``disk_down`` after)."""
    pytest.importorskip("torch")
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from spoolctl.connector.diskguard import DiskGuard
    from spoolctl.connector.kv.formats import ChunkRestore
    from spoolctl.connector.stats import ConnectorCounters
    from spoolctl.connector.worker_side.holdings import RankHoldings
    from spoolctl.connector.worker_side.restore import Located, RestorePipeline

    d = _Drives(tmp_path)
    keys = _keys(24, "s")
    for key in keys:
        d.stores[d.home(key)].put(kind="vllm", namespace="ns", key=key,
                                  objects={"kv": _payload(key, 4096)})
    slow = d.ids[0]
    on = {drive: [k for k in keys if d.home(k) == drive] for drive in d.ids}
    assert all(len(v) >= 3 for v in on.values())
    holdings = RankHoldings.for_drives(d.stores, d.up.__contains__, kind="vllm",
                                       namespace="ns", rank=0, epoch=1)
    holdings.rescan()
    pools = {drive: ThreadPoolExecutor(4) for drive in d.ids}
    guards = {drive: DiskGuard(store, probe_interval_s=3600)
              for drive, store in d.stores.items()}
    gate, read = threading.Event(), []

    def locate(key: str) -> Located | None:
        drive = holdings.locate(key)
        return None if drive is None else Located(drive, d.stores[drive], guards[drive],
                                                  pools[drive])

    def item(key: str) -> ChunkRestore:
        def fill(store: Store, manifest, buf) -> int:
            read.append(key)
            if d.home(key) == slow:
                gate.wait()  # a read stuck in the kernel on a hung disk
            store.read(manifest, "kv", into=memoryview(buf.numpy()))
            return 4096

        return ChunkRestore(key=key, valid=lambda manifest: True, fill=fill,
                            copy=lambda buf: None)

    counters = ConnectorCounters()
    with ThreadPoolExecutor(1) as unused:
        pipe = RestorePipeline(next(iter(d.stores.values())), "ns", chunk_bytes=4096,
                               pool=unused, counters=counters, on_lost=lambda *a: None,
                               deadline_s=0.2, locate=locate)
        try:
            assert pipe.run([item(on[slow][0])], req_id="a") == 0
            assert pipe.take_reason("a") == "deadline"
            well = [k for k in keys if d.home(k) != slow]
            prompt = [*well[:2], on[slow][1], *well[2:4]]
            assert pipe.run([item(k) for k in prompt], req_id="b") == 2
            assert pipe.take_reason("b") == "disk_slow"
            assert on[slow][1] not in read  # never queued behind the stuck read
            assert counters.total(m.LOAD_ERRORS, reason="disk_slow") == 1
            assert pipe.run([item(k) for k in well]) is None  # the other drives serve
            assert not guards[slow].down
            assert pipe.run([item(on[slow][2])]) == 0  # the third failure in a row
            assert guards[slow].down
            assert pipe.run([item(on[slow][2])]) == 0
            assert counters.total(m.LOAD_ERRORS, reason="disk_down") == 1  # out: no read
        finally:
            gate.set()
            pipe.close()
            for guard in guards.values():
                guard.close()
            for pool in pools.values():
                pool.shutdown()
            d.close()


@pytest.mark.timeout(120)
def test_every_local_store_of_every_rank_is_read_at_once(tmp_path: Path) -> None:
    """Two same-host ranks, one on two drives, one on one: the lookup starts the three
    catalog reads together, so it waits for the slowest store, never for the sum over
    ranks and drives. Shown by reads that can only answer together (each waits at a
    barrier of three within the deadline): read one after another, the first would miss
    its deadline and its rank would count as holding nothing."""
    import threading

    from spoolctl.connector.deployment.topology import all_ranks
    from spoolctl.connector.scheduler_side.lookup import RankLookup

    d = _Drives(tmp_path, 2)
    keys = _keys(4, "t")
    other = Store.open(Path(os.path.realpath(tmp_path)) / "rank-0001", create=True)
    lookup = RankLookup(all_ranks(2, 1), deadline_s=5, probe_interval_s=3600)
    together = threading.Barrier(3)
    stores = [*d.stores.values(), other]
    try:
        for i, key in enumerate(keys):
            d.stores[d.ids[i % 2]].put(kind="vllm", namespace="ns", key=key,
                                       objects={"kv": key.encode()})
            other.put(kind="vllm", namespace="ns", key=key, objects={"kv": key.encode()})
        lookup.read_locally(0, stores[0], "ns")
        lookup.read_on_drives(0, [stores[1]])
        lookup.read_locally(1, other, "ns")
        for store in stores:  # each catalog read answers only once all three began
            def live(ids, inner=store.live):
                together.wait(timeout=30)
                return inner(ids)

            store.live = live
        assert lookup.present(keys) == [True] * 4
        assert not lookup.last_unserved
    finally:
        together.abort()
        lookup.stop_reading_locally()
        for store in stores:
            store.__dict__.pop("live", None)
        other.close()
        d.close()


def test_a_worker_exports_each_drives_state_and_its_gauges_summed_over_the_drives(
        tmp_path: Path) -> None:
    """Per-drive gauges (decision 2770): ``spoolctl_drive_down{drive}`` is 0 for each
    configured drive while its store serves and 1 once its guard takes it out (labelled
    with its base root); the worker's store bytes and write-budget gauges are the sums over
    its three drives' stores and ledgers, not the first drive's."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_configs import vllm_configs
    from waiting import wait_until

    from spoolctl.connector import SpoolConnector
    from spoolctl.connector.deployment import write_budget as wb
    from spoolctl.connector.diskguard import guard_for
    from spoolctl.connector.drives import placement as drives

    roots = _dirs(tmp_path, 3)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    vcfg, kcfg = vllm_configs(roots[0], [spec], num_blocks=8, spoolctl_scrub_rate="0",
                              spoolctl_probe_interval=3600, spoolctl_write_budget="1GiB",
                              # opens bounded by 4 lookup deadlines, never retried
                              # here (probe 3600 s): room for a loaded host
                              spoolctl_lookup_deadline=5)
    extra = vcfg.kv_transfer_config.kv_connector_extra_config
    del extra["spoolctl_root"]
    extra["spoolctl_roots"] = roots
    for root in roots:
        Path(root).mkdir(parents=True)
    worker = SpoolConnector(vcfg, KVConnectorRole.WORKER, kcfg)
    try:
        worker.register_kv_caches({"layer.0": torch.zeros(8, 2, 32, 64)})
        ws = worker.worker
        ids = [drives.read_drive_id(r) for r in roots]
        stores = ws.holdings.stores
        keys = _keys(18, "g")
        for i, key in enumerate(keys):
            ws.stager.stage(key, i, _fill(key), request="A")
        assert ws.flush(NET_S)
        chunk = ws.copier.chunk_bytes
        assert all(stores[d].live_keys("vllm", ws.namespace) for d in ids)

        def gauge(spec, **labels):
            return ws.counters.totals().get(spec.name, {}).get(
                ",".join(f"{k}={v}" for k, v in labels.items()))

        def facts_summed() -> bool:
            ws.take_stats()
            return gauge(m.STORE_BYTES) == sum(stores[d].totals().bytes for d in ids)

        wait_until(facts_summed, NET_S, what="the store bytes summed over the drives")
        assert [gauge(m.DRIVE_DOWN, drive=r) for r in roots] == [0, 0, 0]
        assert gauge(m.WRITE_BUDGET) == 3 * (1 << 30)
        assert gauge(m.WRITE_BUDGET_USED) == len(keys) * chunk  # every drive's writes

        guard = guard_for(stores[ids[1]])
        for _ in range(3):
            guard.failed("restore")
        ws.take_stats()
        assert [gauge(m.DRIVE_DOWN, drive=r) for r in roots] == [0, 1, 0]
        ledgers = [wb.ledger_path(stores[d].root) for d in ids]
    finally:
        worker.shutdown()
    # Shutdown closed every drive's ledger: the exact counts (not the slabs charged ahead).
    assert sum(wb.read(path).used for path in ledgers) == len(keys) * chunk


def test_a_drive_whose_mount_hangs_under_a_commit_is_taken_out_and_comes_back(
        tmp_path: Path) -> None:
    """The hung commit on a real hung mount (``tests/fusefs.py`` over one drive's
    ``objects/``): the commit blocks in the kernel, the drive is taken out at the next step
    past the bound, the other drives take its new chunks and still restore; released, the
    commit ends and the probe brings the drive back."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from fusemount import Mounts
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_configs import vllm_configs
    from waiting import wait_until

    from spoolctl.connector import SpoolConnector
    from spoolctl.connector.diskguard import guard_for
    from spoolctl.connector.drives import placement as drives
    from spoolctl.connector.planning.messages import SpoolConnectorMetadata

    roots = _dirs(tmp_path, 3)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    vcfg, kcfg = vllm_configs(roots[0], [spec], num_blocks=8, spoolctl_scrub_rate="0",
                              spoolctl_probe_interval=0.05, spoolctl_read_deadline=0.05)
    extra = vcfg.kv_transfer_config.kv_connector_extra_config
    del extra["spoolctl_root"]
    extra["spoolctl_roots"] = roots
    for root in roots:
        Path(root).mkdir(parents=True)
    with Mounts(tmp_path / "fuse") as mounts:
        worker = SpoolConnector(vcfg, KVConnectorRole.WORKER, kcfg)
        try:
            worker.register_kv_caches({"layer.0": torch.zeros(8, 2, 32, 64)})
            ws = worker.worker
            ids = [drives.read_drive_id(r) for r in roots]
            stores = ws.holdings.stores
            first = _keys(18, "m")
            for i, key in enumerate(first):
                ws.stager.stage(key, i, _fill(key), request="A")
            assert ws.flush(NET_S)
            gone = ids[2]
            guard = guard_for(stores[gone])
            mount = mounts.over(Path(stores[gone].root) / "objects")
            mount.hang()
            hung = next(k for k in _keys(40, "n") if drives.home(k, ids) == gone)
            ws.stager.stage(hung, 0, _fill(hung), request="H")
            wait_until(lambda: (ws.save(SpoolConnectorMetadata()), guard.down)[1], 20,
                       what="the drive taken out for its hung commit")
            second = _keys(18, "o")
            for i, key in enumerate(second):
                ws.stager.stage(key, i, _fill(key), request="B")
            for drive, writer in ws.stager.writers.items():
                assert drive == gone or writer.flush(NET_S)
            moved = [k for k in second if drives.home(k, ids) == gone]
            assert moved and ws.counters.total(m.DRIVE_FAILOVER_STORES,
                                                drive=roots[2]) == len(moved)
            mount.release()
            wait_until(lambda: not guard.down, NET_S, what="the probe")
            assert ws.flush(NET_S)
        finally:
            worker.shutdown()


def test_a_drive_whose_mount_hangs_under_a_read_gets_no_new_reads(
        tmp_path: Path) -> None:
    """The late read on a real hung mount (``tests/fusefs.py`` over one drive's
    ``objects/``): a restore waiting on that drive fails at its deadline with its read
    stuck in the kernel; the next restore's chunk there fails at once (``disk_slow``, never
    submitted), the chunks before it restored from the other drives; released, the stuck
    read ends and that drive serves again."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from fusemount import Mounts
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_configs import vllm_configs
    from waiting import wait_until

    from spoolctl.connector import SpoolConnector
    from spoolctl.connector.drives import placement as drives
    from spoolctl.connector.kv.formats import ChunkRestore

    roots = _dirs(tmp_path, 3)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    vcfg, kcfg = vllm_configs(roots[0], [spec], num_blocks=8, spoolctl_scrub_rate="0",
                              spoolctl_probe_interval=3600, spoolctl_read_deadline=0.2,
                              # opens bounded by 4 lookup deadlines, never retried
                              # here (probe 3600 s): room for a loaded host
                              spoolctl_lookup_deadline=5)
    extra = vcfg.kv_transfer_config.kv_connector_extra_config
    del extra["spoolctl_root"]
    extra["spoolctl_roots"] = roots
    for root in roots:
        Path(root).mkdir(parents=True)
    with Mounts(tmp_path / "fuse") as mounts:
        worker = SpoolConnector(vcfg, KVConnectorRole.WORKER, kcfg)
        try:
            worker.register_kv_caches({"layer.0": torch.zeros(8, 2, 32, 64)})
            ws = worker.worker
            ids = [drives.read_drive_id(r) for r in roots]
            stores = ws.holdings.stores
            keys = _keys(24, "q")
            for i, key in enumerate(keys):
                ws.stager.stage(key, i, _fill(key), request="A")
            assert ws.flush(NET_S)
            slow = ids[0]
            on_slow = [k for k in keys if drives.home(k, ids) == slow]
            well = [k for k in keys if drives.home(k, ids) != slow]
            chunk, copies = ws.copier.chunk_bytes, {}

            def item(key: str) -> ChunkRestore:
                def fill(store: Store, manifest, buf) -> int:
                    store.read(manifest, "kv", into=memoryview(buf.numpy()))
                    return chunk

                return ChunkRestore(key=key, valid=lambda manifest: True, fill=fill,
                                    copy=lambda buf: copies.__setitem__(key,
                                                                        bytes(buf.numpy())))

            pipe = ws.pipeline
            pipe.copy_in_reader = False
            mount = mounts.over(Path(stores[slow].root) / "objects")
            mount.hang()
            assert pipe.run([item(on_slow[0])], req_id="a") == 0
            assert pipe.take_reason("a") == "deadline"
            assert pipe.run([item(k) for k in [*well[:3], on_slow[1], well[3]]],
                            req_id="b") == 3
            assert pipe.take_reason("b") == "disk_slow"
            assert set(copies) == set(well[:3])
            assert pipe.run([item(k) for k in well]) is None  # the other drives serve
            mount.release()
            wait_until(lambda: (pipe.pump(), not pipe.late_reads)[1], NET_S,
                       what="the stuck read")
            copies.clear()
            assert pipe.run([item(k) for k in on_slow[2:4]]) is None
            assert copies == {k: _payload(k, chunk) for k in on_slow[2:4]}
        finally:
            worker.shutdown()


def test_a_keeper_stuck_on_its_drive_takes_the_drive_out_until_its_step_ends(
        tmp_path: Path) -> None:
    """Decision 2790: a drive that only its keeper touches (a capacity step blocked on the
    drive's catalog, held by ``tests/stuck_catalog.py``) stays in service by every read and
    commit; once the keeper's step is past its bound (``writer.commit_bound`` of an empty
    commit, 0.2 s here) the next step's ``save`` takes that drive out, and the probe brings
    it back once the step ended."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from stuck_catalog import stuck_catalog
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_configs import vllm_configs
    from waiting import wait_until

    from spoolctl.connector import SpoolConnector
    from spoolctl.connector.diskguard import guard_for
    from spoolctl.connector.drives import placement as drives
    from spoolctl.connector.planning.messages import SpoolConnectorMetadata

    roots = _dirs(tmp_path, 2)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    vcfg, kcfg = vllm_configs(roots[0], [spec], num_blocks=8, spoolctl_scrub_rate="0",
                              spoolctl_probe_interval=0.05, spoolctl_read_deadline=0.05)
    extra = vcfg.kv_transfer_config.kv_connector_extra_config
    del extra["spoolctl_root"]
    extra["spoolctl_roots"] = roots
    for root in roots:
        Path(root).mkdir(parents=True)
    worker = SpoolConnector(vcfg, KVConnectorRole.WORKER, kcfg)
    try:
        worker.register_kv_caches({"layer.0": torch.zeros(8, 2, 32, 64)})
        ws = worker.worker
        ids = [drives.read_drive_id(r) for r in roots]
        gone = ids[-1]
        store = ws.holdings.stores[gone]
        guard = guard_for(store)
        with stuck_catalog(store) as disk:
            ws.holdings.rescan_s = 0.05  # its next round rescans the drive's catalog
            ws.holdings.wake(gone)
            wait_until(lambda: (ws.save(SpoolConnectorMetadata()), guard.down)[1], 10,
                       what="the drive taken out for its stuck keeper")
            busy = {one["drive"]: one["busy_s"] for one in ws.holdings.state()["drives"]}
            assert busy[gone] is not None  # its keeper still in that step
            disk.release()
            wait_until(lambda: not guard.down, 20, what="the probe bringing the drive back")
    finally:
        worker.shutdown()


def test_status_over_the_drives_marks_the_one_the_engine_has_out_until_its_probe_answers(
        three_drive_worker) -> None:
    """Issue 32 items 2 and 4: ``spoolctl status`` over a running worker's three drives marks
    the drive whose guard took its rank store out (its row's ``out_of_service``, the
    store's record: reason, pid, not stale; the drive's line in the text view), the others
    not; the probe bringing it back removes the mark. A record whose process is gone is
    shown ``stale`` and no longer marks its drive."""
    import json
    import subprocess
    import sys

    from operator_cli import run, run_json
    from waiting import wait_until

    from spoolctl.connector.deployment import out_of_service as oos
    from spoolctl.connector.diskguard import guard_for
    from spoolctl.connector.drives import placement as drives

    worker, roots = three_drive_worker.worker, three_drive_worker.roots
    ws = worker.worker
    ids = [drives.read_drive_id(r) for r in roots]
    store = ws.holdings.stores[ids[1]]
    rank_store = str(store.root)
    argv = [a for r in roots for a in ("--root", r)]

    guard = guard_for(store)
    guard.probe_interval_s = 0.05
    hung = [True]  # a commit past its bound keeps it out while it runs (decision 2770)
    guard.stuck("commit", lambda: hung[0])
    recorders = [one.recorder for one in ws.drives.in_use]
    assert all(r.wait(NET_S) for r in recorders)
    doc = run_json("status", *argv)
    assert [d.get("out_of_service") for d in doc["drives"]] == [None, [rank_store], None]
    (one,) = doc["drives"][1]["result"]["stores"]
    out = one["result"]["status"]["out_of_service"]
    assert out["reason"] == "a commit still running past its bound"
    assert out["pid"] == os.getpid() and out["stale"] is False
    code, text, _ = run("status", *argv)
    assert code == 0
    lines = text.splitlines()
    marked = [line for line in lines if line.startswith("drive ")]
    assert [("out of service for its engine" in line) for line in marked] == \
        [False, True, False]
    assert any(line.startswith("rank 0000: taken out of service by its engine") for line in lines)
    # the rank store given alone says it too (one root's `status`)
    assert run_json("status", "--root", rank_store)["out_of_service"]["stale"] is False

    hung[0] = False  # the commit ended: the next probe reads the drive and brings it back
    wait_until(lambda: not guard.down, NET_S, what="the probe bringing the drive back")
    assert all(r.wait(NET_S) for r in recorders)
    doc = run_json("status", *argv)
    assert [d.get("out_of_service") for d in doc["drives"]] == [None, None, None]
    assert not oos.record_path(rank_store).exists()

    # An engine killed while it had the drive out leaves its record: stale, not a mark.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    oos.record_path(rank_store).write_text(json.dumps({
        "schema": oos.SCHEMA, "since": 1.0, "reason": "3 restore reads late or failed in a row",
        "pid": int(gone.stdout), "host": __import__("socket").gethostname(), "started": 1}))
    doc = run_json("status", *argv)
    assert doc["drives"][1].get("out_of_service") is None
    assert doc["drives"][1]["result"]["stores"][0]["result"]["status"]["out_of_service"][
        "stale"] is True
