"""The fleet parts on their own, without an engine: KV event bookkeeping, write admission,
host budget shares and records, drops between ranks (real stores), and the scheduler's
coordinator (admission filter, block hashes sent with stores, idle steps).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from waiting import wait_until

from spoolctl import metrics as m
from spoolctl.connector.deployment import host_budget
from spoolctl.connector.planning.admission import Admission
from spoolctl.connector.planning.events import (
    INDEX_FIELD,
    ChunkHashes,
    EventLedger,
    HashBook,
    Removed,
    Stored,
    chunk_hashes,
    parents_first,
)
from spoolctl.connector.planning.inventory import (
    InventoryView,
    RankInventory,
)
from spoolctl.connector.stats import write_amplification
from spoolctl.connector.worker_side.holdings import RankHoldings
from spoolctl.store import Store, entry_id_for


def k(i: int) -> bytes:
    return hashlib.blake2b(b"key%d" % i, digest_size=32).digest()


def h(i: int) -> bytes:
    return hashlib.sha256(b"block%d" % i).digest()


def chain(n_chunks: int, per: int = 2, start: int = 0) -> list[ChunkHashes]:
    blocks = [h(start + i) for i in range(n_chunks * per)]
    found = chunk_hashes(blocks, n_chunks, per)
    assert all(c is not None for c in found)
    return found  # type: ignore[return-value]


def settle(view: InventoryView, *invs: RankInventory, limit: int = 64) -> None:
    for inv in invs:
        while (report := inv.report(limit)) is not None:
            view.apply(report)
            if not report.size and not report.reset:
                break


# -- events -------------------------------------------------------------------------------


def test_chunk_hashes_cut_a_prompts_block_hashes_per_chunk():
    blocks = [h(i) for i in range(5)]
    first, second, third = chunk_hashes(blocks, 3, 2)
    assert first == ChunkHashes(None, (h(0), h(1)))
    assert second == ChunkHashes(h(1), (h(2), h(3)))
    assert third is None  # only one of its two blocks is hashed


def test_manifest_index_records_hashes_only_and_refuses_another_identity():
    c = ChunkHashes(h(1), (h(2), h(3)))
    doc = c.to_index("id-a")
    assert set(doc) == {INDEX_FIELD}
    assert json.loads(json.dumps(doc))[INDEX_FIELD]["blocks"] == [h(2).hex(), h(3).hex()]
    assert ChunkHashes.from_index(doc, "id-a") == c
    assert ChunkHashes.from_index(doc, "id-b") is None  # another hash seed: not comparable
    assert ChunkHashes.from_index({}, "id-a") is None
    for bad in ({"id": "id-a", "parent": None, "blocks": []},
                {"id": "id-a", "parent": "zz", "blocks": [h(1).hex()]},
                {"id": "id-a", "parent": None, "blocks": ["<b>x</b>"]},
                {"id": "id-a", "parent": None, "blocks": "ab"}):
        assert ChunkHashes.from_index({INDEX_FIELD: bad}, "id-a") is None


def test_hash_book_is_bounded():
    book = HashBook(capacity=3)
    for i in range(5):
        book.note(k(i), ChunkHashes(None, (h(i),)))
    assert len(book) == 3 and book.get(k(0)) is None and book.get(k(4)) is not None


def test_a_chunk_is_announced_once_every_rank_holds_it_and_withdrawn_when_one_drops_it():
    view = InventoryView([0, 1])
    r0, r1 = RankInventory(0, 1), RankInventory(1, 1)
    book = HashBook()
    c0, c1 = chain(2)
    book.note(k(0), c0)
    book.note(k(1), c1)
    ledger = EventLedger(book)
    for inv in (r0, r1):
        inv.replace([])
    ledger.applied(view.apply(inv.report(16)) for inv in (r0, r1))
    assert ledger.take(view, lambda keys: {}) == []

    r0.add(k(0))
    r0.add(k(1))
    ledger.applied([view.apply(r0.report(16))])
    assert ledger.take(view, lambda keys: {}) == []  # rank 1 does not hold them yet
    r1.add(k(1))
    r1.add(k(0))
    ledger.applied([view.apply(r1.report(16))])
    # parent first
    assert ledger.take(view, lambda keys: {}) == [Stored(k(0), c0), Stored(k(1), c1)]

    r1.withdraw(k(1))
    ledger.applied([view.apply(r1.report(16))])
    # A removal names the chunk's blocks (a router needs no parent to forget them).
    assert ledger.take(view, lambda keys: {}) == [Removed(k(1), ChunkHashes(None, c1.blocks))]
    assert ledger.advertised == 1 and not ledger.pending


def test_startup_inventory_resolves_hashes_from_the_stores_and_skips_unknown_ones():
    view = InventoryView([0])
    inv = RankInventory(0, 5)
    inv.replace([k(0), k(1), k(2)])
    c0, c1 = chain(2)
    ledger = EventLedger(HashBook())
    asked: list[list[bytes]] = []

    def resolve(keys):
        asked.append(sorted(keys))
        return {k(0): c0, k(1): c1}  # k(2): stored before hashes were recorded

    ledger.applied([view.apply(inv.report(2))])  # a bounded handshake: more follows
    ledger.applied([view.apply(inv.report(2))])
    out = ledger.take(view, resolve)
    assert [type(r) for r in out] == [Stored, Stored] and out[0].key == k(0)
    assert asked == [sorted([k(0), k(1), k(2)])]
    assert ledger.unresolved == 1


def test_a_restated_rank_is_reconciled_once_settled():
    view = InventoryView([0])
    inv = RankInventory(0, 1)
    c0, c1 = chain(2)
    book = HashBook()
    book.note(k(0), c0)
    book.note(k(1), c1)
    ledger = EventLedger(book)
    inv.replace([k(0), k(1)])
    ledger.applied([view.apply(inv.report(16))])
    assert len(ledger.take(view, lambda keys: {})) == 2
    # A report goes missing: the view forgets the rank; nothing is withdrawn yet (a router
    # hint is not worth a storm of removals and re-stores for a transient gap).
    inv.replace([k(0)])
    inv.report(16)  # lost
    inv.add(k(2))
    ledger.applied([view.apply(inv.report(16))])
    assert ledger.take(view, lambda keys: {}) == []
    assert view.resync_requests() == {0: 1} and ledger.pending
    inv.resync()
    ledger.applied([view.apply(inv.report(16))])  # the restatement: k(1) is gone
    assert ledger.take(view, lambda keys: {}) == [Removed(k(1), ChunkHashes(None, c1.blocks))]


def test_parents_come_before_their_children():
    c = chain(4)
    recs = [Stored(k(i), c[i]) for i in (3, 1, 0, 2)]
    assert [r.key for r in parents_first(recs)] == [k(0), k(1), k(2), k(3)]
    lone = Stored(k(9), ChunkHashes(h(100), (h(101),)))  # parent not announced here
    assert parents_first([lone]) == [lone]


def test_announced_hashes_are_kept_packed_and_come_back_whole():
    from spoolctl.connector.planning.events import _pack, _unpack

    for blocks in ((h(1), h(2)), (b"\x01" * 8, b"\x02" * 8), (b"\x03" * 8, h(4))):
        assert _unpack(_pack(ChunkHashes(h(0), blocks))) == ChunkHashes(None, blocks)


def test_announcements_are_bounded():
    view = InventoryView([0])
    inv = RankInventory(0, 1)
    inv.replace([k(i) for i in range(4)])
    book = HashBook()
    for i in range(4):
        book.note(k(i), ChunkHashes(None, (h(i),)))
    ledger = EventLedger(book, max_advertised=3)
    ledger.applied([view.apply(inv.report(16))])
    assert len(ledger.take(view, lambda keys: {})) == 3 and ledger.over_limit == 1


# -- inventory: drops and "more to say" ----------------------------------------------------------


def test_a_chunk_one_rank_withdrew_is_dropped_by_every_rank_once():
    view = InventoryView([0, 1])
    r0, r1 = RankInventory(0, 1), RankInventory(1, 1)
    for inv in (r0, r1):
        inv.replace([k(0), k(1)])
    settle(view, r0, r1)
    r1.withdraw(k(0))
    view.apply(r1.report(16))
    assert view.busy() and view.take_drops(10) == [k(0)]
    r0.withdraw(k(0))  # rank 0 drops it: its removal asks nothing more
    view.apply(r0.report(16))
    assert view.take_drops(10) == [] and not view.busy()


def test_a_report_says_when_more_changes_follow():
    inv, view = RankInventory(0, 1), InventoryView([0])
    inv.replace(k(i) for i in range(5))
    first = inv.report(2)
    assert first.more and view.apply(first).kind == "reset"
    assert not view.settled(0) and view.busy()
    view.apply(inv.report(2))
    last = inv.report(2)
    assert not last.more
    view.apply(last)
    assert view.settled(0) and not view.busy()


# -- admission -------------------------------------------------------------------------------


def test_admission_counts_sightings_per_request_within_a_window():
    now = [0.0]
    adm = Admission(2, window_s=10.0, clock=lambda: now[0])
    adm.sighted("a", [k(0), k(1)])
    adm.sighted("a", [k(0)])  # the same request again (preempted): not a new sighting
    assert not adm.admitted(k(0))
    adm.finished("a")
    now[0] = 5.0
    adm.sighted("b", [k(0)])
    assert adm.admitted(k(0)) and not adm.admitted(k(1))
    now[0] = 20.0
    adm.sighted("c", [k(1)])  # the first sighting of k(1) is outside the window
    assert not adm.admitted(k(1))


def test_admission_memory_is_bounded_and_off_by_default():
    adm = Admission(2, capacity=4)
    for i in range(10):
        adm.sighted(f"r{i}", [k(i)])
    assert len(adm) == 4
    off = Admission()
    off.sighted("r", [k(0)])
    assert off.admitted(k(1)) and len(off) == 0
    with pytest.raises(ValueError):
        Admission(0)


def test_write_amplification():
    assert write_amplification(0, 0) is None  # no ratio before the first restore
    assert write_amplification(10, 0) is None  # (never +Inf on a dashboard)
    assert write_amplification(0, 10) == 0.0
    assert write_amplification(30, 10) == 3.0


# -- host budget --------------------------------------------------------------------------------


def test_shares_split_each_hosts_budget_by_chunk_size_and_never_overcommit():
    sites = {0: host_budget.RankSite("a", 100), 1: host_budget.RankSite("a", 100),
             2: host_budget.RankSite("b", 100), 3: host_budget.RankSite("b", 300)}
    assert host_budget.shares(800, sites, range(4)) == {0: 400, 1: 400, 2: 200, 3: 600}
    # A rank whose handshake never came counts on every host at the largest chunk size.
    partial = host_budget.shares(800, {0: sites[0], 1: sites[1]}, range(3))
    assert partial == {0: 800 * 100 // 300, 1: 800 * 100 // 300}  # 100 + 100 + unknown 100
    assert host_budget.initial_share(800, 4) == 200
    assert host_budget.effective_max(None, 5) == 5 and host_budget.effective_max(3, 5) == 3
    assert host_budget.effective_max(None, None) is None


def test_host_budget_record_is_atomic_and_checked(tmp_path: Path):
    d = Path(os.path.realpath(tmp_path))
    assert host_budget.read(d) is None
    host_budget.record(d, 1 << 30)
    assert host_budget.read(d) == 1 << 30
    assert not [p for p in d.iterdir() if p.name != host_budget.FILENAME]  # no temp left
    (d / host_budget.FILENAME).write_text('{"schema": "other", "max_bytes": 5}')
    with pytest.raises(host_budget.HostBudgetError, match="not a host budget record"):
        host_budget.read(d)
    assert host_budget.forget(d) and not host_budget.forget(d)
    os.mkfifo(d / host_budget.FILENAME)  # never blocks status
    with pytest.raises(host_budget.HostBudgetError, match="not a regular file"):
        host_budget.read(d)
    host_budget.record(d, 9)  # the workers replace it
    assert host_budget.read(d) == 9
    host_budget.forget(d)
    (d / host_budget.FILENAME).symlink_to(d / "elsewhere.json")
    (d / "elsewhere.json").write_text(json.dumps({"schema": host_budget.SCHEMA, "max_bytes": 3}))
    with pytest.raises(host_budget.HostBudgetError, match="symbolic link"):
        host_budget.read(d)
    host_budget.forget(d)
    link = d / "link"
    link.symlink_to(d)
    host_budget.record(link, 7)  # never written through a symlink
    assert host_budget.read(d) is None


# -- holdings: drops and shares on real stores ---------------------------------------------------


def _holdings(root: Path, rank: int, **kw) -> tuple[Store, RankHoldings]:
    store = Store.open(root, create=True)
    holdings = RankHoldings(store, kind="vllm", namespace=f"ns{rank}", rank=rank, epoch=1, **kw)
    return store, holdings


def test_a_chunk_evicted_on_one_rank_is_withdrawn_and_deleted_on_the_other(tmp_path: Path):
    base = Path(os.path.realpath(tmp_path))
    keys = [k(i).hex() for i in range(3)]
    s0, h0 = _holdings(base / "rank-0000", 0)
    s1, h1 = _holdings(base / "rank-0001", 1)
    try:
        for store, ns in ((s0, "ns0"), (s1, "ns1")):
            for key in keys:
                store.put(kind="vllm", namespace=ns, key=key, objects={"kv": b"x" * 100})
        view = InventoryView([0, 1])
        for hold in (h0, h1):
            hold.rescan()
            view.apply(hold.handshake_report())
        # Rank 1 evicts chunk 0 (its own capacity); the scheduler learns of it.
        h1.withdraw([entry_id_for("vllm", "ns1", keys[0])])
        view.apply(h1.step_report())
        drops = view.take_drops(16)
        assert drops == [k(0)]
        h0.on_scheduler(view.acks(), {}, drops)
        h0.drop_requested()
        assert h0.dropped == 1
        eid0 = entry_id_for("vllm", "ns0", keys[0])
        assert not s0.live([eid0])  # withdrawn at once: same-host lookups stop counting it
        assert s0.row(eid0) is not None  # but kept until the scheduler acknowledged
        view.apply(h0.step_report())
        for hold in (h0, h1):
            hold.on_scheduler(view.acks(), {})
            hold.delete_acknowledged()
        assert s0.row(eid0) is None and s1.row(entry_id_for("vllm", "ns1", keys[0])) is None
        assert view.has_all(k(1)) and not view.has_all(k(0))
    finally:
        s0.close()
        s1.close()


def test_a_host_budget_share_becomes_the_stores_max_size(tmp_path: Path):
    root = Path(os.path.realpath(tmp_path)) / "rank-0000"
    store, hold = _holdings(root, 0, per_rank_max=10_000, share=4_000)
    try:
        hold.start()
        assert store.max_bytes == 4_000  # the smaller bound wins
        hold.on_scheduler({}, {}, share=20_000)
        hold.apply_share()
        assert store.max_bytes == 10_000  # spoolctl_max_size still bounds the rank
        for i in range(8):
            store.put(kind="vllm", namespace="ns0", key=k(i).hex(), objects={"kv": bytes(1500)},
                      evict=False)
        hold.rescan()
        hold.enforce_capacity()
        assert store.totals().bytes <= 10_000
    finally:
        hold.stop()
        store.close()
    with Store.open(root) as again:
        assert again.max_bytes == 10_000  # recorded in the marker: status and clean see it


# -- the scheduler's coordinator ------------------------------------------------------------------


def _configs(root: str, **extra):
    """vLLM's config objects for one rank of a small model whose store root is ``root``."""
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_configs import vllm_configs

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return vllm_configs(root, [spec], spoolctl_scrub_rate="0", **extra)


def _coordinator(vcfg, kcfg, **seams) -> SimpleNamespace:
    """The scheduler's ``Coordinator`` over these configs, built as the scheduler builds it
    (``seams``: its clock, sleep, idle tail), with its deployment, ranks and counters."""
    from spoolctl.connector.deployment.topology import all_ranks
    from spoolctl.connector.scheduler_side.coordinator import Coordinator
    from spoolctl.connector.scheduler_side.lookup import RankLookup
    from spoolctl.connector.stats import ConnectorCounters
    from spoolctl.connector.vllm_api.introspect import probe

    dep = probe(vcfg, kcfg, scheduler=True)
    ranks = RankLookup(all_ranks(dep.identity.tp_size, dep.identity.pp_size))
    counters = ConnectorCounters()
    return SimpleNamespace(coord=Coordinator(dep, ranks, counters, **seams), dep=dep,
                           ranks=ranks, counters=counters)


def _scheduler_parts(tmp_path: Path, *, seams: dict | None = None,
                     **extra) -> SimpleNamespace:
    return _coordinator(*_configs(str(Path(os.path.realpath(tmp_path)) / "spool"), **extra),
                        **(seams or {}))


def _request(req_id: str, tokens: list[int], hashes: list[bytes]):
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, block_hashes=hashes,
                           kv_transfer_params=None, lora_request=None, prompt_embeds=None,
                           mm_features=None, cache_salt=None)


def test_admission_filters_planned_stores_and_counts_them(tmp_path: Path):
    from spoolctl.connector.planning.messages import SpoolConnectorMetadata
    from spoolctl.connector.planning.plan import ChunkStore

    sched = _scheduler_parts(tmp_path, spoolctl_admit_after=2)
    coord = sched.coord
    tokens = list(range(3, 3 + 130))
    hashes = [h(i) for i in range(4)]
    keys = [key.hex() for key in (k(0), k(1))]
    coord.looked_up("a", _request("a", tokens, hashes), keys, [False, False])
    meta = SpoolConnectorMetadata(stores=[ChunkStore("a", 0, keys[0], (1, 2))])
    coord.fill(meta)
    assert meta.stores == [] and meta.chunk_hashes == {}
    assert sched.counters.total(m.STORES_SKIPPED, reason="admission") == 1
    coord.finished("a")
    coord.looked_up("b", _request("b", tokens, hashes), keys, [False, False])
    meta = SpoolConnectorMetadata(stores=[ChunkStore("b", 0, keys[0], (1, 2))])
    coord.fill(meta)
    assert [s.key for s in meta.stores] == [keys[0]]


def test_stores_carry_their_block_hashes_and_idle_steps_end(tmp_path: Path):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from spoolctl.connector.planning.messages import SpoolConnectorMetadata
    from spoolctl.connector.planning.plan import ChunkStore
    from spoolctl.connector.scheduler_side.coordinator import IDLE_LIMIT_S, IDLE_TAIL_S

    init_none_hash(sha256)
    now, slept = [100.0], []
    clock = {"clock": lambda: now[0], "sleep": slept.append}
    tokens = list(range(3, 3 + 130))
    hashes = [h(i) for i in range(4)]
    keys = [key.hex() for key in (k(0), k(1))]

    def store_planned(coord) -> SpoolConnectorMetadata:
        coord.looked_up("a", _request("a", tokens, hashes), keys, [False, False])
        meta = SpoolConnectorMetadata(stores=[ChunkStore("a", 1, keys[1], (3, 4))])
        coord.fill(meta)
        return meta

    coord = _scheduler_parts(tmp_path / "a", seams=clock).coord
    meta = store_planned(coord)
    assert meta.chunk_hashes == {keys[1]: ChunkHashes(h(1), (h(2), h(3)))}
    assert meta.hash_identity  # vLLM's hash seed is known: hashes can be recorded
    # No events configured: nothing to publish, but stores just planned keep an idle engine
    # stepping (slowly) for the tail, then it rests.
    assert coord.take_events() == []
    assert coord.has_pending_work() and slept
    now[0] += IDLE_TAIL_S + 0.1
    assert not coord.has_pending_work()
    # A tail longer than the limit still ends at the limit after the last activity.
    coord = _scheduler_parts(tmp_path / "b", seams={**clock, "idle_tail_s": IDLE_LIMIT_S + 100}
                             ).coord
    store_planned(coord)
    now[0] += IDLE_LIMIT_S - 1
    assert coord.has_pending_work()
    now[0] += 1.1
    assert not coord.has_pending_work()  # never longer than the limit after activity


def test_the_fleet_parts_import_without_vllm_or_torch():
    code = ("import sys, spoolctl.connector.planning.events, "
            "spoolctl.connector.planning.admission, spoolctl.connector.deployment.host_budget, "
            "spoolctl.connector.scheduler_side.coordinator, "
            "spoolctl.connector.planning.inventory, spoolctl.connector.worker_side.holdings;"
            "print('vllm' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_busy_rank_still_notices_deletions_behind_its_back(tmp_path: Path):

    root = Path(os.path.realpath(tmp_path)) / "rank-0000"
    store = Store.open(root, create=True, max_bytes=1 << 30)
    hold = RankHoldings(store, kind="vllm", namespace="ns0", rank=0, epoch=1, rescan_s=0.2)
    try:
        keys = [k(i).hex() for i in range(3)]
        for key in keys:
            store.put(kind="vllm", namespace="ns0", key=key, objects={"kv": b"x"})
        hold.start()
        assert hold.held_keys() == set(keys)
        store.release(entry_id_for("vllm", "ns0", keys[0]))  # e.g. an operator's clean

        def dropped() -> bool:
            hold.committed(keys[1])  # commits keep waking the thread
            return keys[0] not in hold.held_keys()

        wait_until(dropped, 5, what="the released key leaving the holdings")  # 25 rescans
        assert hold.held_keys() == set(keys[1:])
    finally:
        hold.stop()
        store.close()


def test_status_shows_the_host_total_against_the_host_budget(tmp_path: Path):
    spoolctl = Path(sys.executable).with_name("spoolctl")
    if not spoolctl.exists():
        pytest.skip("the spoolctl console script is not installed next to this interpreter")
    dep = Path(os.path.realpath(tmp_path)) / "spool" / "vllm-v1-deadbeef"
    for rank in range(2):
        with Store.open(dep / f"rank-{rank:04d}", create=True, max_bytes=1 << 20) as store:
            store.put(kind="vllm", namespace=f"ns{rank}", key=k(0).hex(),
                      objects={"kv": bytes(4096)})
    env = {**os.environ, "COLUMNS": "200"}

    def status(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(spoolctl), "status", "--root", str(dep), *args],
                              capture_output=True, text=True, env=env, timeout=120)

    assert "host total" in status().stdout and "(no host budget)" in status().stdout
    host_budget.record(dep, 2 << 20)
    doc = json.loads(status("--json").stdout)
    assert doc["host"]["max_bytes"] == 2 << 20
    assert doc["host"]["bytes"] == sum(r["bytes"] for r in doc["ranks"])
    assert "of 2.0 MiB host budget" in status().stdout
    (dep / host_budget.FILENAME).write_text("[not json")
    proc = status()
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert "host budget record unreadable" in proc.stdout


@pytest.mark.parametrize(("extra", "needle"), [
    ({"spoolctl_host_max_size": "lots"}, "invalid size"),
    ({"spoolctl_admit_after": 0}, "spoolctl_admit_after must be at least 1"),
    ({"spoolctl_admit_after": "2x"}, "spoolctl_admit_after must be an integer"),
    ({"spoolctl_admit_window": "0"}, "spoolctl_admit_window must be positive"),
    ({"spoolctl_admit_window": "soon"}, "invalid duration"),
    ({"spoolctl_kv_events": "yes"}, "spoolctl_kv_events"),
])
def test_fleet_options_fail_startup_with_one_line(extra, needle):
    from spoolctl.connector.deployment.settings import parse_settings
    from spoolctl.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        parse_settings({"spoolctl_root": "/abs", **extra}, block_size=32)
    assert needle in info.value.message and "\n" not in str(info.value)
    ok = parse_settings({"spoolctl_root": "/abs", "spoolctl_host_max_size": "1GiB",
                         "spoolctl_admit_after": 2, "spoolctl_admit_window": "10m"},
                        block_size=32)
    assert (ok.host_max_bytes, ok.admit_after, ok.admit_window, ok.kv_events) == \
        (1 << 30, 2, 600.0, "on")
