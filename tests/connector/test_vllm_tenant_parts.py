"""The connector's tenants on its parts, without an engine (decision 2801): both roles built
in-process from hand-made vLLM configs, lookups answered from a real encrypted rank store.

* a chunk stored for one salt is found for that salt only (the scheduler names keys per
  tenant; the worker commits them sealed for the tenant the key names);
* a master key missing or another one at start-up: every encrypted entry is a miss, one
  warning line says why, and the worker stores nothing (never a tenant's KV in clear);
* per-tenant metric labels are opaque ids, capped, the rest ``other``.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("cryptography")

from vllm_configs import vllm_configs

from spoolctl import metrics as m
from spoolctl.store import ConfigError, MasterKey, Store, TenantId, TenantNames
from spoolctl.store.sealing import COMMAND_ENV, FILE_ENV, VALUE_ENV

torch = pytest.importorskip("torch")

TOKENS = list(range(3, 3 + 2 * 64 + 5))  # two chunks of 64


@pytest.fixture(autouse=True)
def no_operator_key(monkeypatch):
    for name in (FILE_ENV, VALUE_ENV, COMMAND_ENV):
        monkeypatch.delenv(name, raising=False)


def _request(salt: str | None, rid: str = "r") -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=TOKENS, cache_salt=salt,
                           kv_transfer_params=None, prompt_embeds=None, lora_request=None,
                           mm_features=None)


class Engine:
    """Both connector roles of one process on ``base``, as vLLM builds them."""

    def __init__(self, base: Path, **extra):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        from spoolctl.connector import SpoolConnector

        spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32,
                                 dtype=torch.float32)
        vcfg, kcfg = vllm_configs(str(base), [spec], num_blocks=16, spoolctl_scrub_rate="0",
                                  **extra)
        self.worker = SpoolConnector(vcfg, KVConnectorRole.WORKER, kcfg)
        self.worker.register_kv_caches({"layer.0": torch.zeros(16, 2, 32, 64)})
        self.sched = SpoolConnector(vcfg, KVConnectorRole.SCHEDULER, kcfg)
        self.sched.set_xfer_handshake_metadata({0: self.worker.get_handshake_metadata()})
        (self.root,) = self.worker.store_roots

    def hit(self, salt: str | None) -> int:
        return self.sched.get_num_new_matched_tokens(_request(salt), 0)[0] or 0

    def keys(self, salt: str | None) -> list[str]:
        from spoolctl.connector.scheduler_side.lookup import request_keys

        side = self.sched.scheduler
        return request_keys(_request(salt), namespace=side.deployment.chain_namespace,
                            chunk_tokens=64, tenants=side.tenants)

    def store_chunks(self, salt: str | None) -> None:
        """Commit the prompt's chunks as the worker's capture path does (``rank_commit``)."""
        from spoolctl.connector.worker_side.capture import rank_commit

        w = self.worker.worker
        put = rank_commit(w.drives.primary, w.namespace, w.holdings)
        for key in self.keys(salt):
            put(key, {"kv": memoryview(bytes(64 * 4096))}, {})

    def close(self) -> None:
        self.sched.shutdown()
        self.worker.shutdown()


def test_a_salt_finds_only_its_own_chunks(tmp_path: Path, monkeypatch):
    monkeypatch.setenv(VALUE_ENV, secrets.token_hex(32))
    eng = Engine(Path(os.path.realpath(tmp_path)) / "spool")
    try:
        eng.store_chunks("alice")
        assert eng.hit("alice") == 128
        assert eng.hit("bob") == 0 and eng.hit(None) == 0
        # The keys name the tenant (8 bytes of its opaque id), never the salt.
        tid = TenantNames(MasterKey.from_environment()).tenant_id("alice")
        keys = eng.keys("alice")
        assert all(k.startswith(tid) and len(k) == 64 for k in keys)
        assert not set(keys) & set(eng.keys("bob"))
        store: Store = eng.worker.worker.drives.primary
        mf = store.lookup("vllm", eng.worker.namespace, keys[0], tenant=TenantId.of(keys[0]))
        assert mf is not None and mf.index["sealed"]["tenant"] == tid
        assert bytes(store.read(mf, "kv")) == bytes(64 * 4096)  # sealed, reads back
    finally:
        eng.close()


@pytest.mark.parametrize("case", ["no key", "another key"])
def test_a_lost_master_key_at_start_is_misses_one_line_and_no_writes(
        tmp_path: Path, monkeypatch, caplog, case: str):
    base = Path(os.path.realpath(tmp_path)) / "spool"
    monkeypatch.setenv(VALUE_ENV, secrets.token_hex(32))
    eng = Engine(base)
    eng.store_chunks("alice")
    assert eng.hit("alice") == 128
    eng.close()
    if case == "no key":
        monkeypatch.delenv(VALUE_ENV)
    else:
        monkeypatch.setenv(VALUE_ENV, secrets.token_hex(32))
    caplog.set_level(logging.WARNING, logger="spoolctl")
    eng = Engine(base)
    try:
        ours = [r for r in caplog.records if r.name.startswith("spoolctl")]
        lines = [r.getMessage() for r in ours if r.levelno >= logging.WARNING]
        assert len(lines) == 1, lines
        assert ("no master key is configured" if case == "no key"
                else "is not the key this rank store's keyring") in lines[0]
        assert "nothing is stored" in lines[0]
        assert eng.hit("alice") == 0 and eng.hit(None) == 0
        assert eng.worker.worker.stager is None  # nothing written: not in clear, not at all
        assert len([r for r in caplog.records if r.name.startswith("spoolctl")]) == 1
    finally:
        eng.close()


def test_tenant_labels_are_opaque_ids_capped_the_rest_other():
    from spoolctl.connector.planning.tenancy import OTHER, TenantLabels

    labels = TenantLabels(2)
    ids = [f"{i:016x}" for i in range(4)]
    assert [labels.label(t) for t in ids] == [ids[0], ids[1], OTHER, OTHER]
    assert labels.label(ids[1]) == ids[1]  # a labelled tenant keeps its label
    for value in (*ids, OTHER):
        m.check_labels(m.TENANT_HIT_TOKENS, {"tenant": value})
    for bad in ("tenant-a-salt", "A" * 16, "0" * 64, ""):
        with pytest.raises(ValueError):
            m.check_labels(m.TENANT_HIT_TOKENS, {"tenant": bad})
    assert not TenantLabels(0).enabled


def test_a_salt_that_names_no_tenant_bypasses(tmp_path: Path, monkeypatch):
    monkeypatch.setenv(VALUE_ENV, secrets.token_hex(32))
    eng = Engine(Path(os.path.realpath(tmp_path)) / "spool")
    try:
        assert eng.hit("x" * 2000) == 0
        assert eng.sched.counters.total(m.LOOKUPS, result="bypass", reason="tenant") == 1
        with pytest.raises(ConfigError):
            TenantNames(MasterKey.from_environment()).tenant_id("x" * 2000)
    finally:
        eng.close()


def test_sealed_chunks_are_captured_and_restored_byte_for_byte(tmp_path: Path):
    """The worker's capture path seals each chunk for the tenant its key names, and the
    restore pipeline reads it back (one pass: the tag is the check) into the KV blocks."""
    from concurrent.futures import ThreadPoolExecutor

    from spoolctl.connector.kv.format_single import SingleFormat
    from spoolctl.connector.planning.messages import SpoolConnectorMetadata
    from spoolctl.connector.planning.plan import ChunkLoad, ChunkStore, SingleRequestLoad
    from spoolctl.connector.stats import ConnectorCounters
    from spoolctl.connector.worker_side.capture import ChunkStager, rank_commit
    from spoolctl.connector.worker_side.holdings import RankHoldings
    from spoolctl.connector.worker_side.restore import RestorePipeline

    master = MasterKey.from_hex(secrets.token_hex(32), "test")
    k0, k1 = (TenantNames(master).chunk_key("alice", c * 64) for c in "ab")
    fmt, counters = SingleFormat(chunk_tokens=64, block_size=32), ConnectorCounters()
    src = {f"layers.{i}": torch.randn(12, 2, 32, 64) for i in range(2)}
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    writer, reader = fmt.copier(counters), fmt.copier(counters)
    writer.bind(src, 12)
    reader.bind(dst, 12)
    ns = "vllm-v1-tenants"
    with Store.open(Path(os.path.realpath(tmp_path)) / "rank-0000", create=True,
                    master_key=master) as store, ThreadPoolExecutor(2) as pool:
        holdings = RankHoldings(store, kind="vllm", namespace=ns, rank=0, epoch=1)
        stager = ChunkStager(rank_commit(store, ns, holdings), chunk_bytes=writer.chunk_bytes,
                             staging_bytes=8 * writer.chunk_bytes,
                             meta={"layout": writer.layout_digest}, counters=counters)
        meta = SpoolConnectorMetadata(stores=[ChunkStore("r", 0, k0, (3, 4)),
                                              ChunkStore("r", 1, k1, (7, 8))])
        for key, index, fill in writer.captures(meta):
            stager.stage(key, index, fill)
        assert stager.close(30)
        mf = store.lookup("vllm", ns, k0, tenant=TenantId.of(k0))
        assert mf is not None and mf.index["sealed"]["tenant"] == k0[:16]
        assert mf.object("kv").size > writer.chunk_bytes  # ciphertext: header and tag more
        pipeline = RestorePipeline(store, ns, chunk_bytes=reader.chunk_bytes, pool=pool,
                                   counters=counters, on_lost=lambda key: None)
        load = SpoolConnectorMetadata(loads=[SingleRequestLoad("r", (
            ChunkLoad("r", 0, k0, (1, 2)), ChunkLoad("r", 1, k1, (5, 6))))])
        reader.restore(load, pipeline)
        while pipeline.busy:
            reader.poll(pipeline, set(), idle=True)
        assert reader.take_transfer_results() == ({"r"}, set())
        assert reader.take_load_errors() == set()
        for name in src:
            for to, frm in ((1, 3), (2, 4), (5, 7), (6, 8)):
                assert torch.equal(dst[name][to], src[name][frm])
