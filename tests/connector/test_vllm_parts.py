"""The connector's parts on their own, without an engine: the two format strategies
capturing into and restoring from a real store through the capture path and the restore
pipeline, the all-ranks lookup, and stores shared by the roles of one process and closed
at shutdown."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from vllm_configs import vllm_configs
from waiting import wait_until

from spoolctl import metrics as m
from spoolctl.connector.deployment.topology import all_ranks
from spoolctl.connector.drives.rankstores import OpenStores
from spoolctl.connector.planning.inventory import InventoryReport, RankInventory, key_bytes
from spoolctl.connector.scheduler_side.lookup import RankLookup
from spoolctl.connector.stats import ConnectorCounters
from spoolctl.store import Store, entry_id_for

NS = "vllm-v1-parts"
KEYS = ["a" * 64, "b" * 64, "c" * 64]


def _root(tmp_path: Path, name: str = "rank-0000") -> Path:
    return Path(os.path.realpath(tmp_path)) / name


def _flip_object_byte(store: Store, key: str, name: str, ns: str = NS) -> None:
    manifest = store.manifest(entry_id_for("vllm", ns, key))
    ref = next(o for o in manifest.objects if o.name == name)
    path = store.layout.object_path(ref.digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _capture_all(copier, meta, store: Store, counters: ConnectorCounters) -> None:
    """Run the worker's capture path (stager -> writer thread -> store) for ``meta``."""
    from spoolctl.connector.worker_side.capture import ChunkStager, rank_commit
    from spoolctl.connector.worker_side.holdings import RankHoldings

    holdings = RankHoldings(store, kind="vllm", namespace=NS, rank=0, epoch=1)
    stager = ChunkStager(rank_commit(store, NS, holdings), chunk_bytes=copier.chunk_bytes,
                         staging_bytes=8 * copier.chunk_bytes,
                         meta={"layout": copier.layout_digest}, counters=counters)
    for key, index, fill in copier.captures(meta):
        stager.stage(key, index, fill)
    assert stager.close(30)
    assert holdings.held_keys() >= {k for k, _, _ in copier.captures(meta)}


def _restore_now(copier, meta, pipeline) -> tuple[set[str], set[str], set[int]]:
    """Begin ``meta``'s restores and pump them to the end, as the worker's safe points do;
    (requests reported done, failed, blocks to recompute)."""
    copier.restore(meta, pipeline)
    while pipeline is not None and pipeline.busy:
        copier.poll(pipeline, set(), idle=True)
    done, failed = copier.take_transfer_results()
    return done, failed, copier.take_load_errors()


def test_single_format_round_trip_and_a_corrupt_chunk_fails_from_there(tmp_path: Path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from spoolctl.connector.kv.format_single import SingleFormat
    from spoolctl.connector.planning.messages import SpoolConnectorMetadata
    from spoolctl.connector.planning.plan import ChunkLoad, ChunkStore, SingleRequestLoad
    from spoolctl.connector.worker_side.restore import RestorePipeline

    fmt, counters = SingleFormat(chunk_tokens=64, block_size=32), ConnectorCounters()
    src = {f"layers.{i}": torch.randn(12, 2, 32, 64) for i in range(2)}
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    writer, reader, unbound = fmt.copier(counters), fmt.copier(counters), fmt.copier(counters)
    writer.bind(src, 12)
    reader.bind(dst, 12)
    assert reader.layout_digest == writer.layout_digest and reader.chunk_bytes > 0
    load = SpoolConnectorMetadata(loads=[SingleRequestLoad("r", (
        ChunkLoad("r", 0, KEYS[0], (1, 2)), ChunkLoad("r", 1, KEYS[1], (5, 6))))])
    with Store.open(_root(tmp_path), create=True) as store, ThreadPoolExecutor(2) as pool:
        _capture_all(writer, SpoolConnectorMetadata(stores=[
            ChunkStore("r", 0, KEYS[0], (3, 4)), ChunkStore("r", 1, KEYS[1], (7, 8))]),
            store, counters)
        lost: list[str] = []
        pipeline = RestorePipeline(store, NS, chunk_bytes=reader.chunk_bytes, pool=pool,
                                   counters=counters, on_lost=lost.append)
        assert _restore_now(reader, load, pipeline) == ({"r"}, set(), set())
        for name in src:
            for to, frm in ((1, 3), (2, 4), (5, 7), (6, 8)):
                assert torch.equal(dst[name][to], src[name][frm])
        # A flipped byte in chunk 1: quarantined, withdrawn, its blocks recomputed by vLLM
        # (reported with the request, in the same step); chunk 0 (before it) is restored.
        _flip_object_byte(store, KEYS[1], "kv")
        for t in dst.values():
            t.zero_()
        assert _restore_now(reader, load, pipeline) == ({"r"}, set(), {5, 6})
        assert reader.take_failure_reasons() == {"r": "payload_digest"}  # for the scheduler
        assert lost == [KEYS[1]]
        assert counters.total(m.LOAD_ERRORS) == 1 and counters.total(m.QUARANTINE_EVENTS) == 1
        assert len(store.quarantine_items()) == 1
        assert store.live([entry_id_for("vllm", NS, KEYS[1])]) == set()
        assert all(torch.equal(dst[n][1], src[n][3]) and not dst[n][5].any() for n in src)
        # A worker that could not bind its KV (or is shut down) restores nothing: every
        # planned block is reported; a request vLLM allocated too little for fails whole.
        assert _restore_now(unbound, load, pipeline) == ({"r"}, set(), {1, 2, 5, 6})
        assert list(unbound.captures(load)) == []
        short = SpoolConnectorMetadata(loads=[SingleRequestLoad("s", (), ok=False)])
        assert _restore_now(reader, short, pipeline) == ({"s"}, {"s"}, set())


def test_grouped_format_round_trip_per_group_and_a_foreign_plan_fails_the_request(
        tmp_path: Path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from spoolctl.connector.kv.format_grouped import GroupedFormat
    from spoolctl.connector.planning.groups import GroupInfo, group_layouts
    from spoolctl.connector.planning.messages import SpoolConnectorMetadata
    from spoolctl.connector.planning.plan import GroupChunkLoad, GroupChunkStore, RequestLoad
    from spoolctl.connector.worker_side.restore import RestorePipeline

    # Group 0 sliding (window 32, block 32: the last block of each 2-block chunk), group 1 full.
    groups = [GroupInfo(0, "sliding_window", ("s.0",), 32, sliding_window=32),
              GroupInfo(1, "full_attention", ("f.0",), 32)]
    fmt, counters = GroupedFormat(64, groups, group_layouts(groups, 64)), ConnectorCounters()
    src = {"s.0": torch.randn(10, 2, 32, 64), "f.0": torch.randn(10, 2, 32, 64),
           "alias": torch.randn(10, 2, 32, 64)}  # a KV-sharing alias layer, in no group
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    writer, reader = fmt.copier(counters), fmt.copier(counters)
    writer.bind(src, 10)
    reader.bind(dst, 10)
    assert writer.chunk_bytes == 3 * 2 * 32 * 64 * 4  # one sliding block + two full blocks
    with Store.open(_root(tmp_path), create=True) as store, ThreadPoolExecutor(2) as pool:
        _capture_all(writer, SpoolConnectorMetadata(group_stores=[
            GroupChunkStore("r", 0, KEYS[0], ((4,), (5, 6)))]), store, counters)
        manifest = store.manifest(entry_id_for("vllm", NS, KEYS[0]))
        assert sorted(o.name for o in manifest.objects) == ["g0", "g1"]
        pipeline = RestorePipeline(store, NS, chunk_bytes=reader.chunk_bytes, pool=pool,
                                   counters=counters, on_lost=lambda key: None)
        reader.restore(SpoolConnectorMetadata(request_loads=[RequestLoad("r", (
            GroupChunkLoad(0, KEYS[0], ((7,), (8, 9))),))]), pipeline)
        assert reader.take_transfer_results() == ({"r"}, set())
        assert torch.equal(dst["s.0"][7], src["s.0"][4])
        assert torch.equal(dst["f.0"][8], src["f.0"][5])
        assert torch.equal(dst["f.0"][9], src["f.0"][6])
        assert not dst["alias"].any()
        # A plan made for another group layout, or one the scheduler could not make: the
        # request is reported finished and failed (vLLM recomputes it in full).
        reader.restore(SpoolConnectorMetadata(request_loads=[
            RequestLoad("x", (GroupChunkLoad(0, KEYS[0], ((7,),)),)),
            RequestLoad("y", (), ok=False)]), pipeline)
        assert reader.take_transfer_results() == ({"x", "y"}, {"x", "y"})
        assert reader.take_failure_reasons() == {"x": "unknown", "y": "unknown"}
        assert reader.take_transfer_results() == (set(), set())
        assert counters.total(m.LOAD_ERRORS, reason="unknown") == 2


def test_rank_lookup_needs_every_rank_and_forgets_a_rank_after_a_gap(tmp_path: Path):
    lookup = RankLookup(all_ranks(2, 1))
    assert lookup.present(KEYS) == [False, False, False]  # no rank known yet
    with Store.open(_root(tmp_path), create=True) as store:
        for key in KEYS[:2]:
            store.put(kind="vllm", namespace=NS, key=key, objects={"kv": b"x"})
        assert lookup.read_locally(0, store, NS) is None
        inv = RankInventory(1, epoch=1)
        for key in (KEYS[0], KEYS[2]):
            inv.add(key_bytes(key))
        assert lookup.apply([inv.report(16)]) == []
        assert lookup.present(KEYS) == [True, False, False]  # only chunk 0 is on both
        assert lookup.state() == {0: {"source": "catalog", "known": 0},
                                  1: {"source": "reports", "known": 2}}
        # A report out of sequence: rank 1 is no longer trusted until it restates.
        assert lookup.apply([InventoryReport(1, 1, 5, added=(key_bytes(KEYS[1]),))]) == [1]
        assert lookup.present(KEYS) == [False, False, False]
        assert lookup.resync_requests() == {1: 1}
        assert lookup.stop_reading_locally() == [store]
        assert lookup.local_stores() == []


def test_open_stores_are_shared_and_closed_by_their_last_user(tmp_path: Path):
    stores = OpenStores()
    root = str(_root(tmp_path))
    first = stores.acquire(root, create=True, max_bytes=None)
    assert stores.acquire(root, create=False, max_bytes=None) is first
    stores.release(first)
    assert stores.roots() == [root]
    first.totals()  # still open for the other user
    stores.release(first)
    assert stores.roots() == []
    stores.release(first)  # a second release is harmless
    again = stores.acquire(root, create=False, max_bytes=None)
    assert again is not first
    stores.release(again)


def test_scheduler_and_worker_of_one_process_share_the_rank_store_and_close_it(
        tmp_path: Path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from spoolctl.connector import SpoolConnector
    from spoolctl.connector.drives.rankstores import OPEN_STORES

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    vcfg, kcfg = vllm_configs(str(_root(tmp_path, "spool")), [spec], num_blocks=8,
                              spoolctl_scrub_rate="0")
    worker = SpoolConnector(vcfg, KVConnectorRole.WORKER, kcfg)
    worker.register_kv_caches({"layer.0": torch.zeros(8, 2, 32, 64)})
    sched = SpoolConnector(vcfg, KVConnectorRole.SCHEDULER, kcfg)
    sched.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
    (root,) = worker.store_roots
    assert sched.store_roots == [root] and root in OPEN_STORES.roots()
    # The deployment directory says what it is for (issue 36.9): model, dtype, TP/PP.
    from spoolctl.connector.deployment import description

    described = description.read(Path(root).parent)
    assert described is not None and described["model"] == "/m"
    assert described["dtype"] == "float32" and (described["tp_size"], described["pp_size"]) \
        == (1, 1) and described["chunk_tokens"] == 64
    assert sched.inventory_state == {0: {"source": "catalog", "known": 0}}
    sched.shutdown()
    assert root in OPEN_STORES.roots()  # the worker still uses it
    worker.shutdown()
    assert root not in OPEN_STORES.roots()
    assert worker.flush(0) and worker.store_roots == [] and sched.store_roots == []



@pytest.mark.timeout(60)  # without deadlines the lookup would wait for the writer forever
def test_a_lookup_never_waits_on_a_stuck_catalog_beyond_its_deadline(tmp_path: Path):
    """A commit stuck on a hung disk holds the catalog; a lookup is then a miss within
    its deadline (vLLM's scheduler never waits on the disk), and hits resume after."""
    from stuck_catalog import stuck_catalog

    lookup = RankLookup(all_ranks(1, 1), deadline_s=0.1, probe_interval_s=0.05)
    with Store.open(_root(tmp_path), create=True) as store:
        store.put(kind="vllm", namespace=NS, key=KEYS[0], objects={"kv": b"x"})
        lookup.read_locally(0, store, NS)
        assert lookup.present(KEYS[:1]) == [True]
        with stuck_catalog(store):
            assert lookup.present(KEYS[:1]) == [False] and lookup.last_unserved
            # the first read is still stuck: the next lookup does not queue behind it
            assert lookup.present(KEYS[:1]) == [False]
        wait_until(lambda: lookup.present(KEYS[:1]) == [True], what="hits to resume")
        assert not lookup.last_unserved


class _Roles:
    """Both connector roles of one process on a real rank store (as vLLM builds them),
    driven through vLLM's hooks in the order its step loop calls them."""

    TOKENS = list(range(3, 3 + 2 * 64 + 5))  # two chunks of 64

    def __init__(self, base: Path, **extra):
        torch = pytest.importorskip("torch")
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        from spoolctl.connector import SpoolConnector

        spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32,
                                 dtype=torch.float32)
        vcfg, kcfg = vllm_configs(str(base), [spec], num_blocks=16, spoolctl_scrub_rate="0",
                                  **extra)
        self.worker = SpoolConnector(vcfg, KVConnectorRole.WORKER, kcfg)
        self.kv = torch.zeros(16, 2, 32, 64)
        self.worker.register_kv_caches({"layer.0": self.kv})
        self.sched = SpoolConnector(vcfg, KVConnectorRole.SCHEDULER, kcfg)
        self.sched.set_xfer_handshake_metadata({0: self.worker.get_handshake_metadata()})

    def request(self, rid: str = "r"):
        from types import SimpleNamespace

        return SimpleNamespace(request_id=rid, prompt_token_ids=self.TOKENS, cache_salt=None,
                               kv_transfer_params=None, prompt_embeds=None,
                               lora_request=None, mm_features=None)

    def store_prompt(self) -> list[str]:
        """Commit the prompt's two chunks as the worker's capture path does; their keys."""
        from spoolctl.connector.scheduler_side.lookup import request_keys
        from spoolctl.connector.worker_side.capture import rank_commit

        w = self.worker.worker
        chain = self.sched.scheduler.deployment.chain_namespace
        keys = request_keys(self.request(), namespace=chain, chunk_tokens=64)
        put = rank_commit(w.drives.primary, w.namespace, w.holdings)
        for i, key in enumerate(keys):
            put(key, {"kv": memoryview(bytes([i + 1]) * w.copier.chunk_bytes)},
                {"layout": w.copier.layout_digest})
        return keys

    def planned(self, request) -> None:
        """Look ``request`` up (a hit on both chunks) and give it blocks 1-5, as vLLM's
        scheduler does before the step that restores it."""
        from types import SimpleNamespace

        assert self.sched.get_num_new_matched_tokens(request, 0) == (128, True)
        blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5],))
        self.sched.update_state_after_alloc(request, blocks, 128)

    def restore(self, request, before_load=lambda: None) -> object:
        """Look ``request`` up (a hit), plan its restore, call ``before_load`` and run
        worker steps until the restore is reported; the workers' step outputs merged as
        vLLM's scheduler gets them."""
        from types import SimpleNamespace

        from vllm.v1.outputs import KVConnectorOutput

        self.planned(request)
        idle_step = SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[],
                                    scheduled_cached_reqs=SimpleNamespace(req_ids=[]))
        out = KVConnectorOutput(finished_recving=set(), invalid_block_ids=set())
        before_load()
        while request.request_id not in out.finished_recving:
            self.worker.bind_connector_metadata(self.sched.build_connector_meta(idle_step))
            self.worker.start_load_kv(None)
            results = self.worker.get_transfer_results(set())
            out.finished_recving |= results.finished_recving
            out.invalid_block_ids |= self.worker.get_block_ids_with_load_errors()
            meta = self.worker.build_connector_worker_meta()
            if meta is not None:
                out.kv_connector_worker_meta = meta if out.kv_connector_worker_meta is None \
                    else out.kv_connector_worker_meta.aggregate(meta)
            self.worker.clear_connector_metadata()
        return out

    def misses(self, reason: str) -> int:
        return int(self.sched.counters.total(m.LOOKUPS, result="miss", reason=reason))

    def close(self) -> None:
        self.sched.shutdown()
        self.worker.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("failure,reason", [("hung read", "disk_slow"),
                                            ("store out", "disk_down"),
                                            ("flipped byte", "corrupt")])
def test_a_failed_restore_is_looked_up_again_with_the_workers_reason(
        tmp_path: Path, failure: str, reason: str):
    """Decision 2740: vLLM looks a request up again after its restore failed; that miss is
    counted with the reason the worker found (a hung disk is no corruption), carried in the
    same step's worker output, and forgotten when the request leaves."""
    import threading

    pytest.importorskip("vllm")
    roles = _Roles(Path(os.path.realpath(tmp_path)) / "spool", spoolctl_read_deadline="0.2",
                   spoolctl_probe_interval="3600")
    release = threading.Event()
    try:
        keys = roles.store_prompt()
        w = roles.worker.worker
        take_out = None
        if failure == "hung read":  # the device stops answering: every read blocks
            real_read = w.drives.primary.read

            def hung_read(*args, **kwargs):
                release.wait()
                return real_read(*args, **kwargs)

            w.drives.primary.read = hung_read
        elif failure == "store out":  # three reads late or failed since the lookup
            def take_out() -> None:
                for _ in range(3):
                    w.drives.guard_of("").failed("restore")
        else:
            _flip_object_byte(w.drives.primary, keys[0], "kv", w.namespace)
        req = roles.request()
        out = roles.restore(req, take_out or (lambda: None))
        assert out.invalid_block_ids == {1, 2, 3, 4}  # both chunks recomputed
        roles.sched.update_connector_output(out)
        release.set()
        # vLLM freed the blocks (nothing was restored) and looks the request up anew.
        assert roles.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert roles.misses(reason) == 1
        assert roles.misses("corrupt") == (1 if reason == "corrupt" else 0)
        # It left vLLM: its reason went with it (nothing per request stays behind).
        roles.sched.request_finished_all_groups(req, ([1, 2, 3, 4, 5],))
        assert roles.sched.scheduler.unrestorable == {}
    finally:
        release.set()
        roles.close()


@pytest.mark.timeout(120)
def test_a_restore_failure_reported_after_its_request_left_is_not_kept(tmp_path: Path):
    """A request aborted while its failed restore was being reported (the grouped format
    reports a failed request in ``failed_recving``): the scheduler keeps nothing for it, as
    it would never be looked up or finished again."""
    pytest.importorskip("vllm")
    from vllm.v1.outputs import KVConnectorOutput

    from spoolctl.connector.planning.messages import SpoolWorkerMeta

    roles = _Roles(Path(os.path.realpath(tmp_path)) / "spool", spoolctl_probe_interval="3600")
    try:
        roles.store_prompt()
        req = roles.request()
        roles.planned(req)
        roles.sched.request_finished_all_groups(req, ([1, 2, 3, 4, 5],))
        roles.sched.update_connector_output(KVConnectorOutput(
            finished_recving={"r"}, failed_recving={"r"},
            kv_connector_worker_meta=SpoolWorkerMeta(load_failures={"r": "disk_slow"})))
        assert roles.sched.scheduler.unrestorable == {}
        # The same id again (a new request): a plain hit, no failed restore counted.
        assert roles.sched.get_num_new_matched_tokens(req, 0) == (128, True)
        assert roles.misses("disk_slow") == 0
    finally:
        roles.close()


def test_ranks_reasons_for_one_failed_restore_merge_to_the_most_telling():
    pytest.importorskip("vllm")
    from spoolctl.connector.planning.messages import SpoolWorkerMeta, restore_failure

    assert [restore_failure(r) for r in ("deadline", "io_error", "disk_down", "absent",
                                         "unknown", "payload_digest", "manifest_validation",
                                         "disk_slow")] \
        == ["disk_slow", "io_error", "disk_down", "absent", "unknown", "corrupt", "corrupt",
            "disk_slow"]
    a = SpoolWorkerMeta(load_failures={"r": "disk_down", "s": "disk_slow"})
    b = SpoolWorkerMeta(load_failures={"r": "corrupt", "t": "io_error"})
    merged = a.aggregate(b)
    assert merged.load_failures == {"r": "corrupt", "s": "disk_slow", "t": "io_error"}
    assert b.aggregate(a).load_failures == merged.load_failures


@pytest.mark.timeout(120)
def test_with_host_kv_a_restore_begins_when_the_step_is_bound_not_after_the_forward(
        tmp_path: Path):
    """Decision 2740: vLLM binds a step's metadata before the forward and calls
    ``start_load_kv`` for asynchronous loads only after it; with the KV cache in host
    memory the forward runs on the engine thread, so the restore begins at the bind (its
    reads and deadline run during the forward), and only once."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    roles = _Roles(Path(os.path.realpath(tmp_path)) / "spool", spoolctl_probe_interval="3600")
    try:
        roles.store_prompt()
        req = roles.request()
        roles.planned(req)
        step = SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[],
                               scheduled_cached_reqs=SimpleNamespace(req_ids=[]))
        roles.worker.bind_connector_metadata(roles.sched.build_connector_meta(step))
        # (the forward would run here) — no start_load_kv yet: the reads already ran
        done: set[str] = set()

        def restored() -> bool:
            done.update(roles.worker.get_transfer_results(set()).finished_recving)
            return "r" in done

        wait_until(restored, what="the restore begun at bind", timeout=30)
        roles.worker.start_load_kv(None)  # after the forward: nothing begins twice
        roles.worker.clear_connector_metadata()
        assert roles.worker.get_block_ids_with_load_errors() == set()
        chunk = roles.worker.worker.copier.chunk_bytes
        assert roles.worker.counters.total(m.RESTORE_BYTES) == 2 * chunk
        assert roles.worker.counters.total(m.LOAD_ERRORS) == 0
        raw = roles.kv.view(-1, 2, 32, 64).numpy().view("uint8").reshape(16, -1)
        assert set(raw[1:3].ravel()) == {1} and set(raw[3:5].ravel()) == {2}  # chunk 0, 1
        assert set(raw[5:].ravel()) == {0}
    finally:
        roles.close()
