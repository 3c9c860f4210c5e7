"""Connector logic without an engine: chain keys, planning, settings, contract check,
block copies on real torch tensors, the background writer against a real store,
stats aggregation and the Prometheus adapter."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from spoolctl import metrics as m
from spoolctl.connector.deployment.identity import DeploymentIdentity
from spoolctl.connector.deployment.settings import parse_settings
from spoolctl.connector.deployment.topology import RankPlace
from spoolctl.connector.planning.chain import MMSpan, chain_root, chunk_keys, longest_run
from spoolctl.connector.planning.plan import Planner
from spoolctl.connector.stats import ConnectorCounters, merge
from spoolctl.connector.vllm_api.contract import EXPECTED, check_contract, signature_drift
from spoolctl.errors import ConfigError
from spoolctl.store import Store

NS = "vllm-v1-test"


# -- chain keys ------------------------------------------------------------------------------

def test_chain_shares_exactly_the_common_complete_chunks():
    root = chain_root(NS, None)
    a = list(range(100, 100 + 64 * 4 + 3))
    b = a[:128] + [7] * 140
    ka, kb = chunk_keys(root, a, 64), chunk_keys(root, b, 64)
    assert len(ka) == 4 and len(kb) == 4  # partial tails get no key
    assert ka[:2] == kb[:2]
    assert ka[2] != kb[2] and ka[3] != kb[3]


def test_chain_binds_salt_namespace_and_position():
    tokens = list(range(256))
    base = chunk_keys(chain_root(NS, None), tokens, 64)
    assert chunk_keys(chain_root(NS, "s1"), tokens, 64)[0] != base[0]
    assert chunk_keys(chain_root(NS, ""), tokens, 64)[0] != base[0]  # "" is not "no salt"
    assert chunk_keys(chain_root(NS + "x", None), tokens, 64)[0] != base[0]
    # Same chunk tokens after a different prefix -> different key (it is a chain).
    swapped = tokens[64:128] + tokens[:64] + tokens[128:]
    assert chunk_keys(chain_root(NS, None), swapped, 64)[1] != base[0]


def test_chain_binds_multimodal_identity_and_position():
    tokens = [1] * 256
    root = chain_root(NS, None)
    plain = chunk_keys(root, tokens, 64)
    img_a = chunk_keys(root, tokens, 64, [MMSpan("img-a", 70, 10)])
    img_b = chunk_keys(root, tokens, 64, [MMSpan("img-b", 70, 10)])
    moved = chunk_keys(root, tokens, 64, [MMSpan("img-a", 80, 10)])
    assert img_a[0] == plain[0]  # the image starts in chunk 1
    assert img_a[1] != plain[1] and img_a[1] != img_b[1] and img_a[1] != moved[1]
    with pytest.raises(ValueError):
        MMSpan("", 0, 1)


def test_longest_run():
    assert longest_run([True, True, False, True]) == 2
    assert longest_run([]) == 0
    assert longest_run([False, True]) == 0


# -- planning --------------------------------------------------------------------------------

def test_hit_leaves_at_least_one_token_to_compute():
    p = Planner(chunk_tokens=64, block_size=32)
    keys = [f"{i:064x}" for i in range(4)]
    # Prompt of exactly 4 chunks, all present: all but its last token are loaded.
    assert p.lookup("r", keys, [True] * 4, 256, 0) == 255
    assert p.lookup("r", keys, [True, True, True, False], 256, 0) == 192
    assert p.lookup("r", keys, [True] * 4, 257, 0) == 256
    assert p.lookup("r", keys, [True, False, True, True], 257, 0) == 64
    assert p.lookup("r", keys, [True] * 4, 257, 64) == 192  # vLLM already has chunk 0
    assert p.lookup("r", keys, [True] * 4, 257, 256) == 0


def test_plan_loads_into_allocated_blocks_and_stores_new_chunks_once_computed():
    p = Planner(chunk_tokens=64, block_size=32)
    keys = [f"{i:064x}" for i in range(4)]
    ext = p.lookup("r", keys, [True, True, False, False], 260, 32)
    assert ext == 96
    blocks = list(range(10, 19))
    # Planned when vLLM allocates the hit's blocks (the request then waits for its KV).
    p.allocated("r", blocks[:4], ext)
    (load,) = p.take_loads()
    assert load.req_id == "r" and load.ok and p.take_loads() == []
    assert [(ld.index, ld.block_ids, ld.skip) for ld in load.loads] == [
        (0, (10, 11), 1), (1, (12, 13), 0)]
    assert load.loads[0].target_blocks == (11,)
    assert load.target_blocks == {11, 12, 13}
    stores = p.scheduled("r", blocks, replace=True, computed_after=32 + 96 + 100)
    assert [(s.index, s.block_ids) for s in stores] == [(2, (14, 15))]  # chunk 3 not done yet
    stores = p.scheduled("r", [19], replace=False, computed_after=260)
    assert [(s.index, s.block_ids) for s in stores] == [(3, (16, 17))]
    assert p.scheduled("r", None, replace=False, computed_after=261) == []
    p.finished("r")
    assert p.scheduled("r", blocks, replace=True, computed_after=300) == []


def test_plan_load_ending_inside_the_last_chunk_copies_that_whole_chunk():
    p = Planner(chunk_tokens=64, block_size=32)
    keys = [f"{i:064x}" for i in range(2)]
    ext = p.lookup("r", keys, [True, True], 128, 0)
    assert ext == 127
    p.allocated("r", [4, 5, 6, 7], ext)
    (load,) = p.take_loads()
    assert [(ld.index, ld.block_ids) for ld in load.loads] == [(0, (4, 5)), (1, (6, 7))]
    assert p.scheduled("r", [4, 5, 6, 7], replace=True, computed_after=128) == []  # present


def test_plan_load_without_the_blocks_it_needs_fails_the_request():
    p = Planner(chunk_tokens=64, block_size=32)
    keys = [f"{i:064x}" for i in range(2)]
    ext = p.lookup("r", keys, [True, True], 200, 0)
    p.allocated("r", [4, 5, 6], ext)  # chunk 1 needs blocks 2 and 3
    (load,) = p.take_loads()
    assert not load.ok and load.loads == ()
    p.lookup("q", keys, [False, False], 200, 0)
    p.allocated("q", [1, 2], 0)  # a miss: nothing to restore
    assert p.take_loads() == []


def test_plan_after_preemption_uses_the_new_blocks():
    p = Planner(chunk_tokens=64, block_size=32)
    keys = [f"{i:064x}" for i in range(2)]
    p.lookup("r", keys, [False, False], 130, 0)
    p.allocated("r", None, 0)
    stores = p.scheduled("r", [1, 2], replace=True, computed_after=64)
    assert [s.block_ids for s in stores] == [(1, 2)]
    stores = p.scheduled("r", [7, 8, 9, 10, 11], replace=True, computed_after=130)
    assert [s.block_ids for s in stores] == [(9, 10)]


# -- settings, identity, contract ------------------------------------------------------------

def test_settings_defaults_and_errors():
    s = parse_settings({"spoolctl_root": "/r", "spoolctl_max_size": "1GiB"},
                       block_size=96, env={})
    assert s.chunk_tokens == 288 and s.max_bytes == 1 << 30
    assert s.root_for(digest="vllm-v1-abc", place=RankPlace(1, 0, 2, 1)) == \
        "/r/vllm-v1-abc/rank-0001"
    with pytest.raises(ConfigError, match="placeholders"):
        parse_settings({"spoolctl_root": "/r/{tp_rank}"}, block_size=32, env={})
    with pytest.raises(ConfigError, match="no store root"):
        parse_settings({}, block_size=32, env={})
    assert parse_settings({}, block_size=32, env={"SPOOLCTL_ROOT": "/e"}).root == "/e"
    with pytest.raises(ConfigError, match="multiple of the block size"):
        parse_settings({"spoolctl_root": "/r", "spoolctl_chunk_tokens": 100}, block_size=32,
                       env={})
    with pytest.raises(ConfigError, match="unknown connector option"):
        parse_settings({"spoolctl_root": "/r", "spoolctl_chunk": 64}, block_size=32, env={})
    with pytest.raises(ConfigError, match="absolute"):
        parse_settings({"spoolctl_root": "rel"}, block_size=32, env={}).root_for(
            digest="d", place=RankPlace(0, 0, 1, 1))
    with pytest.raises(ConfigError, match="invalid size"):
        parse_settings({"spoolctl_root": "/r", "spoolctl_max_size": "lots"}, block_size=32,
                       env={})


def test_read_deadlines_are_settings_and_must_be_positive():
    s = parse_settings({"spoolctl_root": "/r"}, block_size=32, env={})
    assert (s.lookup_deadline, s.read_deadline, s.probe_interval) == (0.5, 5.0, 5.0)
    s = parse_settings({"spoolctl_root": "/r", "spoolctl_lookup_deadline": "0.05",
                        "spoolctl_read_deadline": 1, "spoolctl_probe_interval": "1m"},
                       block_size=32, env={})
    assert (s.lookup_deadline, s.read_deadline, s.probe_interval) == (0.05, 1.0, 60.0)
    with pytest.raises(ConfigError, match="spoolctl_read_deadline must be a positive"):
        parse_settings({"spoolctl_root": "/r", "spoolctl_read_deadline": 0}, block_size=32,
                       env={})


def _identity(**kw) -> DeploymentIdentity:
    base = dict(model="/m", revision=None, dtype="torch.float32", kv_cache_dtype="auto",
                block_size=32, kv_layout=({"layers": ["l0"], "spec": "FullAttentionSpec",
                                           "fields": {"head_size": 32}},),
                tp_size=2, pp_size=1, tp_rank=0, pp_rank=0, engine="vllm-0.32/cpu",
                chunk_tokens=64)
    base.update(kw)
    return DeploymentIdentity(**base)


def test_identity_namespace_changes_with_every_field():
    ns = _identity().namespace
    assert ns == _identity().namespace
    for change in ({"model": "/m2"}, {"revision": "abc"}, {"dtype": "torch.bfloat16"},
                   {"kv_cache_dtype": "fp8"}, {"block_size": 64}, {"tp_rank": 1},
                   {"engine": "vllm-0.33/cpu"}, {"chunk_tokens": 128},
                   {"kv_layout": ({"layers": ["l0"], "spec": "FullAttentionSpec",
                                   "fields": {"head_size": 64}},)}):
        assert _identity(**change).namespace != ns, change
    assert _identity().for_rank(tp_rank=1, pp_rank=0).namespace == _identity(tp_rank=1).namespace
    with pytest.raises(ValueError):
        _identity(tp_rank=2)


def test_contract_matches_installed_vllm_and_reports_drift():
    base_mod = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    assert signature_drift(base_mod.KVConnectorBase_V1) == []

    # A base class where one callback gained a parameter and one disappeared.
    ns = {}
    for name, params in EXPECTED.items():
        args = ", ".join(["self", *(p if p != "kwargs" else "**kwargs" for p in params)])
        exec(f"def {name}({args}): pass", ns)
    ns["get_num_new_matched_tokens"] = lambda self, request, num_computed_tokens, extra: None
    del ns["wait_for_save"]
    drifted = type("Drifted", (), {k: v for k, v in ns.items() if k in EXPECTED})
    problems = signature_drift(drifted)
    assert len(problems) == 2
    with pytest.raises(ConfigError) as err:
        check_contract(drifted, "9.9")
    assert "get_num_new_matched_tokens" in str(err.value) and "wait_for_save" in str(err.value)
    assert "\n" not in str(err.value)
    assert inspect.signature(drifted.build_connector_meta)


def test_import_spoolctl_connector_does_not_import_vllm_or_torch():
    code = ("import sys, spoolctl, spoolctl.connector, spoolctl.connector.planning.plan, "
            "spoolctl.connector.planning.chain, spoolctl.connector.deployment.identity, "
            "spoolctl.connector.deployment.settings, spoolctl.connector.deployment.topology, "
            "spoolctl.connector.scheduler_side.lookup, spoolctl.connector.kv.formats, "
            "spoolctl.connector.vllm_api.introspect, spoolctl.connector.planning.groups, "
            "spoolctl.connector.drives.rankstores;"
            "print('vllm' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "False"]


def test_every_planning_module_imports_without_vllm_or_torch():
    """The planning package is pure logic: its wire messages too (vLLM's base classes are
    attached by ``vllm_api.wire``)."""
    code = ("import pkgutil, importlib, sys, spoolctl.connector.planning as p\n"
            "names = [m.name for m in pkgutil.iter_modules(p.__path__)]\n"
            "for n in names: importlib.import_module(f'{p.__name__}.{n}')\n"
            "print(len(names) > 5, 'vllm' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["True", "False", "False"]


def test_the_wire_messages_are_vllms_metadata_types():
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )

    from spoolctl.connector import SpoolConnector  # noqa: F401  (registers them)
    from spoolctl.connector.planning.inventory import InventoryReport
    from spoolctl.connector.planning.messages import (
        SpoolConnectorMetadata,
        SpoolHandshake,
        SpoolWorkerMeta,
    )

    assert isinstance(SpoolConnectorMetadata(), KVConnectorMetadata)
    assert isinstance(SpoolWorkerMeta(), KVConnectorWorkerMetadata)
    hs = SpoolHandshake(rank=0, host="h", root="/r", store_id="s",
                        report=InventoryReport(rank=0, epoch=1, seq=0))
    assert isinstance(hs, KVConnectorHandshakeMetadata)


# -- block copies on real tensors ------------------------------------------------------------

def test_paged_kv_capture_restore_roundtrip_in_cpu_layout():
    torch = pytest.importorskip("torch")
    from spoolctl.connector.kv.kvio import PagedKV

    # vLLM CPU layout: per layer [num_blocks, num_kv_heads, block_size, 2 * head_size].
    src = {f"layers.{i}": torch.randn(12, 2, 32, 64) for i in range(3)}
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    a, b = PagedKV(src, num_blocks=12, blocks_per_chunk=2), PagedKV(dst, num_blocks=12,
                                                                   blocks_per_chunk=2)
    assert a.layout_digest == b.layout_digest
    assert a.chunk_bytes == 3 * 2 * (2 * 32 * 64 * 4)
    buf = torch.empty(a.chunk_bytes, dtype=torch.uint8)
    a.capture([5, 9], buf)
    b.restore(buf, [1, 2])
    for name in src:
        assert torch.equal(dst[name][1], src[name][5])
        assert torch.equal(dst[name][2], src[name][9])
        assert not dst[name][0].any() and not dst[name][3].any()
    b.restore(buf, [7, 8], skip=1)  # leading block computed locally: left untouched
    for name in src:
        assert not dst[name][7].any()
        assert torch.equal(dst[name][8], src[name][9])
    other = PagedKV({"layers.0": torch.zeros(12, 2, 32, 32)}, num_blocks=12, blocks_per_chunk=2)
    assert other.layout_digest != a.layout_digest


def test_paged_kv_never_guesses_the_block_dimension():
    """vLLM registers [blocks, heads, states, content] views; a tensor whose block
    dimension would have to be guessed from sizes (K/V first, 2 blocks) is refused."""
    torch = pytest.importorskip("torch")
    from spoolctl.connector.kv.kvio import PagedKV
    from spoolctl.errors import ConfigError

    with pytest.raises(ConfigError) as err:  # [K/V, num_blocks, block, heads, dim]
        PagedKV({"l": torch.randn(2, 10, 32, 4, 16)}, num_blocks=10, blocks_per_chunk=1)
    assert "l" in err.value.message


# -- background writer against a real store --------------------------------------------------

def _writer(store: Store, budget: int, counters: ConnectorCounters):
    from spoolctl.connector.worker_side.writer import StoreWriter

    def put(key, payload, meta):
        store.put(kind="vllm", namespace=NS, key=key, objects={"kv": payload}, meta=meta)

    return StoreWriter(put, staging_bytes=budget, counters=counters)


def test_writer_commits_and_skips_over_staging_budget(tmp_path: Path):
    from spoolctl.connector.worker_side.writer import PendingStore

    counters = ConnectorCounters()
    with Store.open(Path(os.path.realpath(tmp_path)) / "s", create=True) as store:
        w = _writer(store, 1000, counters)
        assert w.reserve("a" * 64, 600)
        assert not w.reserve("b" * 64, 600)  # would exceed the budget: skipped, not waited
        assert not w.reserve("a" * 64, 10)  # same chunk already in flight
        w.submit(PendingStore("a" * 64, b"x" * 600, 600, {"chunk_index": 0}))
        assert w.flush(30)
        assert w.staged_bytes == 0
        assert w.reserve("b" * 64, 600)
        w.cancel("b" * 64, 600)
        assert w.close(5)
        assert not w.reserve("c" * 64, 1)
        assert len(store.entries(kind="vllm")) == 1
        manifest = store.lookup("vllm", NS, "a" * 64)
        assert bytes(store.read(manifest, "kv")) == b"x" * 600
    assert counters.total(m.STORES_SKIPPED, reason="budget") == 1
    assert counters.total(m.STORES_SKIPPED, reason="exists") == 1
    assert counters.total(m.STORES_SKIPPED, reason="shutdown") == 1
    assert counters.total(m.STORE_WRITE_BYTES) == 600


def test_writer_counts_capacity_and_io_failures_without_raising(tmp_path: Path):
    from spoolctl.connector.worker_side.writer import PendingStore

    counters = ConnectorCounters()
    root = Path(os.path.realpath(tmp_path)) / "s"
    with Store.open(root, create=True, max_bytes=1000) as store:
        w = _writer(store, 1 << 20, counters)
        assert w.reserve("a" * 64, 5000)
        w.submit(PendingStore("a" * 64, b"y" * 5000, 5000, {}))
        assert w.flush(30)
        # tmp/ replaced by a plain file: every write fails (ENOTDIR), like a broken disk.
        tmp = store.layout.tmp
        os.rename(tmp, tmp.with_name("tmp.away"))
        tmp.write_bytes(b"")
        try:
            assert w.reserve("b" * 64, 10)
            w.submit(PendingStore("b" * 64, b"z" * 10, 10, {}))
            assert w.flush(30)
        finally:
            tmp.unlink()
            os.rename(tmp.with_name("tmp.away"), tmp)
        w.close(5)
        assert store.entries(kind="vllm") == []
    assert counters.total(m.STORES_SKIPPED, reason="capacity") == 1
    assert counters.total(m.STORES_SKIPPED, reason="io_error") == 1


def test_commits_failing_on_the_disk_take_the_store_out_and_a_full_disk_does_not(
        tmp_path: Path):
    """Decision 2790: a commit failing with a disk error (the store's directory gone, as
    under an unmounted drive) counts against the store's guard, three in a row take it
    out, a stored chunk resets the count; a full disk (ENOSPC) never counts."""
    import errno

    from spoolctl.connector.diskguard import DiskGuard
    from spoolctl.connector.worker_side.writer import PendingStore, StoreWriter
    from spoolctl.errors import StoreIOError

    root = Path(os.path.realpath(tmp_path)) / "s"
    away = root.with_name("s-unmounted")
    with Store.open(root, create=True) as store:
        guard = DiskGuard(store, probe_interval_s=3600)
        counters = ConnectorCounters()

        def put(key, payload, meta):
            store.put(kind="vllm", namespace=NS, key=key, objects={"kv": payload}, meta=meta)

        w = StoreWriter(put, staging_bytes=1000, counters=counters, guard=guard)

        def commit(i: int) -> None:
            key = f"{i:064x}"
            assert w.reserve(key, 10)
            w.submit(PendingStore(key, b"x" * 10, 10, {}))
            assert w.flush(30)

        root.rename(away)  # the drive's path now leads nowhere
        commit(0)
        commit(1)
        away.rename(root)
        commit(2)  # stored: the two failures before it no longer count
        assert counters.total(m.STORES_SKIPPED, reason="io_error") == 2
        root.rename(away)
        commit(3)
        commit(4)
        assert not guard.down
        commit(5)
        assert guard.down  # three failed commits in a row
        away.rename(root)

        full = DiskGuard(store, probe_interval_s=3600)

        def no_space(key, payload, meta):
            raise StoreIOError("writing an object failed: No space left on device",
                               errno=errno.ENOSPC)

        w2 = StoreWriter(no_space, staging_bytes=1000, counters=counters, guard=full)
        for i in range(4):
            assert w2.reserve(f"{i:064x}", 10)
            w2.submit(PendingStore(f"{i:064x}", b"x" * 10, 10, {}))
            assert w2.flush(30)
        assert w2.full and not full.down  # full for FULL_RETRY_S, never taken out
        guard.close()
        full.close()


def test_writer_flush_times_out_instead_of_blocking(tmp_path: Path):
    from spoolctl.connector.worker_side.writer import PendingStore, StoreWriter

    disk = threading.Event()  # a put that waits until the test lets the disk answer

    def slow_put(key, payload, meta):
        assert disk.wait(60)

    counters = ConnectorCounters()
    w = StoreWriter(slow_put, staging_bytes=100, counters=counters)
    assert w.reserve("a" * 64, 10)
    w.submit(PendingStore("a" * 64, b"x", 10, {}))
    assert not w.flush(0.05)  # the put cannot have finished: flush gives up at its bound
    disk.set()
    assert w.flush(30)


# -- stats ----------------------------------------------------------------------------------

def test_counters_reject_labels_outside_the_vocabulary():
    c = ConnectorCounters()
    c.inc(m.LOOKUPS, result="hit", reason="none")
    with pytest.raises(ValueError):
        c.inc(m.LOOKUPS, result="hit", reason="token 1234")
    with pytest.raises(ValueError):
        c.inc(m.LOOKUPS, result="hit")


def test_stats_aggregate_and_prometheus_export():
    pytest.importorskip("vllm")
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from spoolctl.connector.vllm_api.promstats import SpoolPromMetrics, SpoolStats

    w1, w2 = ConnectorCounters(part="0"), ConnectorCounters(part="1")
    w1.inc(m.LOOKUPS, result="hit", reason="none")
    w1.inc(m.HIT_TOKENS, 256)
    w1.observe(m.RESTORE_SECONDS, 0.02)
    w2.inc(m.LOOKUPS, result="hit", reason="none")
    w2.inc(m.STORES_SKIPPED, reason="capacity")
    w1.set_gauge(m.STORE_BYTES, 50)
    w1.set_gauge(m.STORE_BYTES, 100)  # per worker, the later value wins
    w2.set_gauge(m.STORE_BYTES, 4096)  # across workers (ranks), the stores add up
    with pytest.raises(ValueError):
        w2.set_gauge(m.LOOKUPS, 1)
    # A labelled gauge (several drives, decision 2770): per label set, summed over workers.
    w1.set_gauge(m.DRIVE_DOWN, 1, drive="/nvme0/spool")
    w1.set_gauge(m.DRIVE_DOWN, 0, drive="/nvme1/spool")
    w2.set_gauge(m.DRIVE_DOWN, 1, drive="/nvme0/spool")
    with pytest.raises(ValueError):
        w2.set_gauge(m.DRIVE_DOWN, 1)  # its label is required
    s = SpoolStats(data=w1.take()).aggregate(SpoolStats(data=w2.take()))
    assert w1.take() == {}  # take() resets the interval
    reduced = s.reduce()
    assert reduced["spoolctl_lookups_total{reason=none,result=hit}"] == 2
    assert reduced["spoolctl_restore_seconds_count"] == 1
    assert reduced["spoolctl_store_bytes"] == 4196
    assert reduced["spoolctl_drive_down{drive=/nvme0/spool}"] == 2
    assert reduced["spoolctl_drive_down{drive=/nvme1/spool}"] == 0
    assert not s.is_empty() and SpoolStats().is_empty()
    assert merge({}, s.data) == s.data

    reg = CollectorRegistry()

    def bind(cls):
        return lambda **kw: cls(registry=reg, **kw)

    class Cfg:
        kv_transfer_config = None

    prom = SpoolPromMetrics(Cfg(), {Gauge: bind(Gauge), Counter: bind(Counter),
                                    Histogram: bind(Histogram)}, ["engine"], {0: ["0"]})
    prom.observe(s.data, 0)
    text = generate_latest(reg).decode()
    assert 'spoolctl_lookups_total{engine="0",reason="none",result="hit"} 2.0' in text
    assert 'spoolctl_hit_tokens_total{engine="0"} 256.0' in text
    assert 'spoolctl_stores_skipped_total{engine="0",reason="capacity"} 1.0' in text
    assert 'spoolctl_restore_seconds_count{engine="0"} 1.0' in text
    assert 'spoolctl_store_bytes{engine="0"} 4196.0' in text
    assert 'spoolctl_drive_down{drive="/nvme0/spool",engine="0"} 2.0' in text
    assert 'spoolctl_drive_down{drive="/nvme1/spool",engine="0"} 0.0' in text
    # Workers send a gauge in different steps (when it changes): the export is the sum of
    # every worker's last value, not of one step's payload.
    w2.set_gauge(m.DRIVE_DOWN, 0, drive="/nvme0/spool")
    w2.set_gauge(m.STORE_BYTES, 1000)
    prom.observe(w2.take(), 0)
    text = generate_latest(reg).decode()
    assert 'spoolctl_drive_down{drive="/nvme0/spool",engine="0"} 1.0' in text
    assert 'spoolctl_store_bytes{engine="0"} 1100.0' in text

    # Written, nothing restored yet: no ratio (not +Inf); from the first restore on, one.
    w1.inc(m.STORE_WRITE_BYTES, 3000)
    prom.observe(w1.take(), 0)
    text = generate_latest(reg).decode()
    assert "spoolctl_write_amplification_ratio{" not in text and "+Inf" not in text.replace(
        'le="+Inf"', "")
    w1.inc(m.RESTORE_BYTES, 1000)
    prom.observe(w1.take(), 0)
    assert 'spoolctl_write_amplification_ratio{engine="0"} 3.0' in generate_latest(reg).decode()


def test_buffer_pool_hands_out_distinct_slots_and_takes_them_back():
    torch = pytest.importorskip("torch")
    from spoolctl.connector.kv.kvio import BufferPool

    pool = BufferPool(4096, slots=2)
    a, b = pool.get(), pool.get()
    assert a.numel() == b.numel() == 4096 and a.data_ptr() != b.data_ptr()
    assert pool.get() is None  # exhausted: the caller skips, never blocks
    a.fill_(7)
    assert not b.any()  # slots do not overlap
    pool.put(a)
    with pytest.raises(ValueError):
        pool.put(a)
    with pytest.raises(ValueError):
        pool.put(torch.empty(4096, dtype=torch.uint8))
    assert pool.get().data_ptr() == a.data_ptr()


def test_block_runs_and_restore_with_skip_across_runs():
    torch = pytest.importorskip("torch")
    from spoolctl.connector.kv.kvio import PagedKV, _runs

    assert _runs([4, 5, 9, 10, 11, 2]) == [(0, 4, 2), (2, 9, 3), (5, 2, 1)]
    assert _runs([]) == []
    src = {"l": torch.randn(20, 2, 32, 8)}
    dst = {"l": torch.zeros_like(src["l"])}
    a = PagedKV(src, num_blocks=20, blocks_per_chunk=4)
    b = PagedKV(dst, num_blocks=20, blocks_per_chunk=4)
    buf = torch.empty(a.chunk_bytes, dtype=torch.uint8)
    a.capture([3, 4, 8, 1], buf)
    b.restore(buf, [10, 11, 15, 12], skip=1)
    assert not dst["l"][10].any()  # skipped: computed locally
    assert torch.equal(dst["l"][11], src["l"][4])
    assert torch.equal(dst["l"][15], src["l"][8])
    assert torch.equal(dst["l"][12], src["l"][1])


def test_restore_never_writes_the_null_block():
    torch = pytest.importorskip("torch")
    from spoolctl.connector.kv.kvio import PagedKV, _runs

    # Id 0 is vLLM's null block (shared, out-of-window positions): in no run.
    assert _runs([0, 1, 2], skip_null=True) == [(1, 1, 2)]
    assert _runs([3, 0, 4], skip_null=True) == [(0, 3, 1), (2, 4, 1)]
    src = {"l": torch.randn(8, 2, 4, 8)}
    dst = {"l": torch.zeros_like(src["l"])}
    a = PagedKV(src, num_blocks=8, blocks_per_chunk=3)
    b = PagedKV(dst, num_blocks=8, blocks_per_chunk=3)
    buf = torch.empty(a.chunk_bytes, dtype=torch.uint8)
    a.capture([5, 6, 7], buf)
    b.restore(buf, [0, 1, 2], skip_null=True)
    assert not dst["l"][0].any()
    assert torch.equal(dst["l"][1], src["l"][6]) and torch.equal(dst["l"][2], src["l"][7])


def test_kv_tensor_without_a_block_dimension_is_refused():
    """A view whose leading dimension is not a whole number of (kernel) blocks would be
    copied along the wrong dimension: refused with the layer name and the fix."""
    torch = pytest.importorskip("torch")
    from spoolctl.connector.kv.kvio import PagedKV
    from spoolctl.errors import ConfigError

    ok = PagedKV({"layer.0": torch.zeros(14, 2, 4, 8)}, num_blocks=7, blocks_per_chunk=1)
    assert ok.layers[0].block_shape == (2, 2, 4, 8)  # two kernel blocks per block
    with pytest.raises(ConfigError) as err:
        PagedKV({"layer.0": torch.zeros(2, 7, 4, 8)}, num_blocks=7, blocks_per_chunk=1)
    assert "layer.0" in err.value.message and "spoolctl_on_unsupported" in str(err.value.fix)


def test_store_gauges_follow_a_commit_while_the_server_goes_idle(tmp_path):
    """Issue 36.9: 0.0 exported with 12.4 MiB stored. A commit shortly after the last
    15-second refresh is exported within the idle tail of steps (1 s), not at the next
    request."""
    from concurrent.futures import ThreadPoolExecutor

    from spoolctl.connector.worker_side.telemetry import WorkerTelemetry

    now = [100.0]
    counters = ConnectorCounters(part="0")
    telemetry = WorkerTelemetry(counters, clock=lambda: now[0])
    with Store.open(tmp_path / "store", create=True, max_bytes=1 << 20) as store, \
            ThreadPoolExecutor(1) as pool:
        def step() -> float | None:
            telemetry.refresh_gauges(store, pool)
            pool.submit(lambda: None).result()  # the refresh, if one was due, has run
            gauges = counters.take().get("gauges", {})
            return gauges.get(m.STORE_BYTES.name, {}).get("0")

        assert step() == 0.0  # first step: empty store
        store.put(kind="vllm", namespace="ns", key="k", objects={"kv": b"x" * 4096})
        counters.inc(m.STORE_WRITE_BYTES, 4096)  # what the writer counts per commit
        now[0] += 0.5
        assert step() is None  # not yet: at most one refresh a second
        now[0] += 0.6
        assert step() == store.totals().bytes > 4096  # the tail's steps carry it out
        now[0] += 1.1
        assert step() is None  # nothing changed: the 15 s period again
        now[0] += 15
        assert step() == store.totals().bytes


def test_usage_counts_are_what_status_shows_as_the_hit_rate() -> None:
    """usage.json's counts (spoolctl status's hit rate): prompt tokens looked up and restored,
    and requests looked up (a bypass is no lookup) and hit (full or partial)."""
    from spoolctl.connector.scheduler_side.scheduler import usage_counts

    counters = ConnectorCounters()
    counters.inc(m.LOOKUP_TOKENS, 100)
    counters.inc(m.HIT_TOKENS, 64)
    counters.inc(m.LOOKUPS, result="hit", reason="partial")
    counters.inc(m.LOOKUPS, result="miss", reason="absent")
    counters.inc(m.LOOKUPS, result="bypass", reason="lora")
    assert usage_counts(counters) == (100, 64, 2, 1)
