"""A daily write budget per rank store (issue 32 item 5, decision 2710).

The ledger: a spent budget refuses, a restart keeps the count, a crash never undercounts,
a new UTC day starts at zero, a damaged ledger writes nothing. The worker's writer over a
real store: chunks past the budget are skipped (reason ``write_budget``) and those stored
still read back. The scheduler: admission tightens as the budget runs low and plans no
store once it is spent. ``spoolctl status`` shows each rank's count against the budget.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from operator_cli import run_json, script

from spoolctl import metrics as m
from spoolctl.connector.deployment import write_budget as wb
from spoolctl.connector.stats import ConnectorCounters
from spoolctl.store import Store

NS = "vllm-v1-budget"
DAY = 86400.0
NOON = 20000 * DAY + 12 * 3600  # a fixed UTC noon


def _key(i: int) -> str:
    return f"{i:064x}"


def test_a_spent_budget_refuses_and_a_restart_keeps_the_count(tmp_path: Path):
    path = tmp_path / "write-budget-rank-0000.json"
    now = [NOON]
    ledger = wb.WriteLedger(path, 1000, clock=lambda: now[0])
    assert ledger.take(600) and not ledger.spent
    assert not ledger.take(500)  # does not fit: nothing counted
    assert ledger.take(400) and ledger.spent
    assert not ledger.take(1)
    ledger.close()
    again = wb.WriteLedger(path, 1000, clock=lambda: now[0])
    assert again.spent and again.state().used == 1000
    assert wb.read(path) == wb.LedgerState(wb.utc_day(NOON), 1000, 1000)
    # The next UTC day starts at zero, in memory and for a restart.
    now[0] += DAY
    assert not again.spent and again.take(700)
    again.close()
    assert wb.WriteLedger(path, 1000, clock=lambda: now[0]).state().used == 700


def test_a_crash_never_leaves_a_count_below_what_was_written(tmp_path: Path):
    path = tmp_path / "write-budget-rank-0000.json"
    budget = 100_000
    ledger = wb.WriteLedger(path, budget, clock=lambda: NOON)
    written = 0
    for _ in range(37):
        assert ledger.take(1234)
        written += 1234
        recorded = wb.read(path)  # what a crash right now would leave
        assert recorded is not None
        assert written <= recorded.used <= written + int(budget * wb.SLAB_SHARE) + 1234
    # No close (a crash): the restart counts at least what was written.
    assert wb.WriteLedger(path, budget, clock=lambda: NOON).state().used >= written


def test_a_failed_commit_gives_its_bytes_back_and_a_damaged_ledger_writes_nothing(
        tmp_path: Path):
    path = tmp_path / "write-budget-rank-0000.json"
    ledger = wb.WriteLedger(path, 1000, clock=lambda: NOON)
    assert ledger.take(900)
    ledger.refund(900)
    assert ledger.take(1000)
    path.write_text("[not json")
    damaged = wb.WriteLedger(path, 1000, clock=lambda: NOON)
    assert damaged.spent  # wear is not risked on a count nobody can read
    with pytest.raises(wb.LedgerError, match=r"write-budget-rank-0000\.json"):
        wb.read(path)


def test_admission_tightens_as_the_budget_runs_low():
    assert [wb.effective_after(1, share) for share in (1.0, 0.5, 0.3, 0.2, 0.05, 0.0)] == \
        [1, 1, 2, 3, 4, None]
    assert wb.effective_after(2, 0.4) == 3


def test_the_writer_skips_chunks_past_the_budget_and_stored_ones_still_read(tmp_path: Path):
    from spoolctl.connector.worker_side.capture import rank_commit, rank_commit_many
    from spoolctl.connector.worker_side.holdings import RankHoldings
    from spoolctl.connector.worker_side.writer import PendingStore, StoreWriter

    root = Path(os.path.realpath(tmp_path)) / "vllm-v1-x" / "rank-0000"
    counters = ConnectorCounters()
    chunk = 64 << 10
    with Store.open(root, create=True) as store:
        ledger = wb.WriteLedger(wb.ledger_path(store.root), 3 * chunk)
        holdings = RankHoldings(store, kind="vllm", namespace=NS, rank=0, epoch=1)
        writer = StoreWriter(rank_commit(store, NS, holdings), staging_bytes=16 * chunk,
                             counters=counters, put_many=rank_commit_many(store, NS, holdings),
                             ledger=ledger)
        for i in range(5):
            assert writer.reserve(_key(i), chunk)
            writer.submit(PendingStore(_key(i), {"kv": bytes([i]) * chunk}, chunk, {}))
        assert writer.flush(30)
        assert counters.total(m.STORES_SKIPPED, reason="write_budget") == 2
        assert counters.total(m.STORE_WRITE_BYTES) == 3 * chunk
        # Spent: the next chunk is refused before it is even copied.
        assert writer.try_reserve(_key(9), chunk) == "write_budget"
        writer.close(5)
        live = {r.key for r in store.entries(kind="vllm")}
        assert live == {_key(i) for i in range(3)}
        for i in range(3):  # reads are never limited by the budget
            manifest = store.manifest(store.entry_id("vllm", NS, _key(i)))
            assert bytes(store.read(manifest, "kv")) == bytes([i]) * chunk
        ledger.close()
    assert wb.read(wb.ledger_path(root)).used == 3 * chunk


def test_status_shows_each_ranks_writes_against_the_budget(tmp_path: Path):
    dep = Path(os.path.realpath(tmp_path)) / "spool" / "vllm-v1-deadbeef"
    for rank in range(2):
        with Store.open(dep / f"rank-{rank:04d}", create=True, max_bytes=1 << 20) as store:
            store.put(kind="vllm", namespace=NS, key=_key(rank), objects={"kv": bytes(4096)})
    doc = run_json("status", "--root", str(dep), "--json")
    assert [r["write_budget"] for r in doc["ranks"]] == [None, None]
    ledger = wb.WriteLedger(dep / "write-budget-rank-0001.json", 2 << 20)
    assert ledger.take(2 << 20)
    ledger.close()
    (dep / "write-budget-rank-0000.json").write_text("[not json")
    doc = run_json("status", "--root", str(dep), "--json")
    rows = {r["rank"]: r["write_budget"] for r in doc["ranks"]}
    assert rows[1]["used_bytes"] == rows[1]["budget_bytes"] == 2 << 20
    assert rows[1]["left_pct"] == 0.0
    assert "write-budget-rank-0000.json" in rows[0]["error"]
    # The human table as an operator's terminal shows it: a real process, 250 columns wide
    # (in-process, the width is whatever an earlier test's console left).
    proc = script("status", "--root", str(dep), env={"COLUMNS": "250"})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert "2.0 MiB of 2.0 MiB" in proc.stdout and "spent" in proc.stdout, proc.stdout


def test_the_scheduler_plans_no_store_once_a_local_budget_is_spent(tmp_path: Path):
    from test_vllm_fleet_units import _request, _scheduler_parts, h, k

    from spoolctl.connector.planning.messages import SpoolConnectorMetadata
    from spoolctl.connector.planning.plan import ChunkStore

    sched = _scheduler_parts(tmp_path, spoolctl_write_budget="1MiB")
    coord = sched.coord
    rank_root = Path(sched.dep.rank_root(sched.ranks.places[0]))
    tokens = list(range(3, 3 + 130))
    keys = [key.hex() for key in (k(0), k(1))]

    def plan(req: str) -> list[str]:
        coord.looked_up(req, _request(req, tokens, [h(i) for i in range(4)]), keys,
                        [False, False])
        meta = SpoolConnectorMetadata(stores=[ChunkStore(req, 0, keys[0], (1, 2))])
        coord.fill(meta)
        coord.finished(req)
        return [s.key for s in meta.stores]

    assert plan("a") == [keys[0]]  # budget untouched: the configured rule (first sighting)
    rank_root.parent.mkdir(parents=True, exist_ok=True)  # the worker's store is there on its host
    ledger = wb.WriteLedger(wb.ledger_path(rank_root), 1 << 20)
    assert ledger.take(800 << 10)  # 22% left: two more sightings than configured
    ledger.close()
    coord.budget_watch.refresh()
    assert plan("b") == []  # its 2nd sighting: not yet
    assert plan("c") == [keys[0]]  # its 3rd
    assert ledger.take(ledger.budget - ledger.state().used)
    ledger.close()
    coord.budget_watch.refresh()
    assert plan("d") == []
    assert sched.counters.total(m.STORES_SKIPPED, reason="write_budget") == 1
    assert json.loads(wb.ledger_path(rank_root).read_text())["used"] == 1 << 20


def test_on_several_drives_admission_reads_every_drives_ledger_pooled_per_rank(
        tmp_path: Path):
    """A rank on two drives has a ledger on each (its writes are spread over them): the
    scheduler tightens admission by the bytes left on both against both budgets, not by
    the first drive's ledger alone (decision 2770); both spent: no store planned."""
    from test_vllm_fleet_units import _configs, _coordinator, _request, h, k

    from spoolctl.connector.deployment.topology import rank_root
    from spoolctl.connector.planning.messages import SpoolConnectorMetadata
    from spoolctl.connector.planning.plan import ChunkStore

    base = Path(os.path.realpath(tmp_path))
    roots = [str(base / f"nvme{i}" / "spool") for i in range(2)]
    vcfg, kcfg = _configs(roots[0], spoolctl_write_budget="1MiB")
    extra = vcfg.kv_transfer_config.kv_connector_extra_config
    del extra["spoolctl_root"]
    extra["spoolctl_roots"] = roots
    sched = _coordinator(vcfg, kcfg)
    coord = sched.coord
    place = sched.ranks.places[0]
    tokens = list(range(3, 3 + 130))
    keys = [key.hex() for key in (k(0), k(1))]
    sighting = iter(range(100))

    def plan() -> list[str]:
        req = f"r{next(sighting)}"
        coord.looked_up(req, _request(req, tokens, [h(i) for i in range(4)]), keys,
                        [False, False])
        meta = SpoolConnectorMetadata(stores=[ChunkStore(req, 0, keys[0], (1, 2))])
        coord.fill(meta)
        coord.finished(req)
        return [s.key for s in meta.stores]

    def used(*nbytes: int) -> None:  # what each drive's worker wrote today
        for root, n in zip(roots, nbytes, strict=True):
            store_root = Path(rank_root(root, sched.dep.chain_namespace, place))
            store_root.parent.mkdir(parents=True, exist_ok=True)
            path = wb.ledger_path(store_root)
            path.unlink(missing_ok=True)
            ledger = wb.WriteLedger(path, 1 << 20)
            assert ledger.take(n)
            ledger.close()
        coord.budget_watch.refresh()

    used(900 << 10, 1)  # the first drive nearly spent, the second untouched: 56% left
    assert plan() == [keys[0]]  # the configured rule (the first drive alone: 12%)
    used(600 << 10, 1 << 20)  # 40% and 0% left: 20% in all, two more sightings
    assert plan() == []  # its 2nd sighting: not yet (the first drive alone: 40%, yes)
    assert plan() == [keys[0]]  # its 3rd
    used(1 << 20, 1 << 20)
    assert plan() == []
    assert sched.counters.total(m.STORES_SKIPPED, reason="write_budget") == 1


@pytest.mark.parametrize(("value", "needle"), [
    ("0", "invalid size"), ("lots", "invalid size")])
def test_a_bad_budget_fails_startup_with_one_line(value, needle):
    from spoolctl.connector.deployment.settings import parse_settings
    from spoolctl.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        parse_settings({"spoolctl_root": "/abs", "spoolctl_write_budget": value}, block_size=32)
    assert needle in info.value.message and "\n" not in str(info.value)
    ok = parse_settings({"spoolctl_root": "/abs", "spoolctl_write_budget": "500GiB"},
                        block_size=32)
    assert ok.write_budget == 500 << 30


def test_a_ledger_on_a_hung_drive_never_freezes_the_other_drives_budget_view(
        tmp_path: Path):
    """Decision 2790: ``BudgetWatch`` reads each ledger within a bound; a drive hung on a
    real FUSE mount keeps its last value while the other drive's ledger is read again, and
    its read is not started again while it still runs (one thread, not one per round)."""
    import threading

    from fusemount import Mounts
    from waiting import wait_until

    base = Path(os.path.realpath(tmp_path))
    drives = [base / "nvme0", base / "nvme1"]
    paths = [d / "write-budget-rank-0000.json" for d in drives]

    def used(path: Path, n: int) -> None:
        path.unlink(missing_ok=True)
        ledger = wb.WriteLedger(path, 1 << 20)
        assert ledger.take(n)
        ledger.close()

    for d in drives:
        d.mkdir()
    used(paths[0], 512 << 10)
    used(paths[1], 256 << 10)
    # the bound a healthy drive's read must meet on a loaded host (0.2 s was missed)
    # rounds only from refresh() (interval=0 would start one at every left_share(), and
    # its read of the first drive would be running beside the hung one)
    watch = wb.BudgetWatch(lambda: [paths], interval=3600, read_bound=1.0)

    def refreshed() -> bool:  # refresh() returned (on a thread: the old code never did)
        t = threading.Thread(target=watch.refresh, daemon=True)
        t.start()
        t.join(30)
        return not t.is_alive()

    with Mounts(base / "fuse") as mounts:
        mount = mounts.over(drives[1])
        assert refreshed()
        assert watch.left_share() == pytest.approx((512 + 768) / 2048)
        mount.hang()
        used(paths[0], 1 << 20)  # the first drive spent meanwhile
        assert refreshed()
        # the hung drive's last value, the other drive's new one
        assert watch.left_share() == pytest.approx(768 / 2048)
        assert watch.reads_running == 1
        assert refreshed()
        assert watch.reads_running == 1  # still that one read
        mount.release()
        wait_until(lambda: watch.reads_running == 0, what="the hung read to end")
