"""A hung or failing drive among several, on a real FUSE filesystem the tests control
(issue 32 items 3-4, decision 2714's test plan): both connector roles of one process over
three drives, the third drive's rank store ``objects/`` a ``tests/fusefs.py`` mount (SQLite
cannot live on it, decision 2720). A hung drive costs only its chunks: lookups answer, the
prefix before its first chunk restores byte for byte, its new chunks are written to their
runner-ups, and once the disk answers (the probe) its chunks hit again; an EIO is a miss
(``io_error``), never a quarantine, never wrong bytes. One mount and one pair of roles for
the module (the mount costs a process start)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from waiting import wait_until

from spoolctl import metrics as m
from spoolctl.store import Store

# What a test thread waits for an operation that must not hang (a safety net: a broken
# bound fails the test instead of wedging the suite; no result depends on it).
NET_S = 60
CHUNK_TOKENS = 64


def _payload(key: str, n: int) -> bytes:
    return (key.encode() * (n // len(key) + 1))[:n]


def _fill(key: str):
    from spoolctl.connector.kv.kvio import DONE

    def fill(buf):
        view = buf.numpy()
        view[:] = memoryview(_payload(key, len(view))).cast("B")
        return {"kv": memoryview(view)}, DONE

    return fill


class _ThreeDrives:
    """Worker and scheduler (one process, as vLLM builds them) over three drive roots; the
    third drive's rank store ``objects/`` is ``mount``. ``ids[i]`` is root ``i``'s id.
    ``prompts[name]``: (request, keys) of a prompt stored on all three drives before the
    mount was made (a file published into ``objects/`` from ``tmp/`` crosses the mount:
    EXDEV, so nothing new is written to the FUSE drive itself)."""

    def __init__(self, tmp: Path, wants: dict[str, object]) -> None:
        torch = pytest.importorskip("torch")
        pytest.importorskip("vllm")
        from fusemount import ControlledMount, skip_without_fuse
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm_configs import vllm_configs

        from spoolctl.connector import SpoolConnector
        from spoolctl.connector.drives import placement as drives

        skip_without_fuse()
        base = Path(os.path.realpath(tmp))
        self.roots = [str(base / f"nvme{i}" / "spool") for i in range(3)]
        for root in self.roots:
            Path(root).mkdir(parents=True)
        spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32,
                                 dtype=torch.float32)
        # Deadlines far below the safety net and a fast probe, so the test is quick.
        vcfg, kcfg = vllm_configs(self.roots[0], [spec], num_blocks=8, spoolctl_scrub_rate="0",
                                  spoolctl_read_deadline="0.2", spoolctl_lookup_deadline="0.2",
                                  spoolctl_probe_interval="0.05")
        extra = vcfg.kv_transfer_config.kv_connector_extra_config
        del extra["spoolctl_root"]
        extra["spoolctl_roots"] = self.roots

        def start() -> None:
            self.worker = SpoolConnector(vcfg, KVConnectorRole.WORKER, kcfg)
            self.worker.register_kv_caches({"layer.0": torch.zeros(8, 2, 32, 64)})
            self.ws = self.worker.worker
            self.sched = SpoolConnector(vcfg, KVConnectorRole.SCHEDULER, kcfg)
            self.sched.set_xfer_handshake_metadata({0: self.worker.get_handshake_metadata()})

        self.worker = self.sched = self.mount = None
        try:
            start()  # a run before: identifies the drives, stores the prompts
            self.ids = [drives.read_drive_id(r) for r in self.roots]
            self.fused = self.ids[2]
            self.prompts = {name: self._prompt(seed, want)
                            for seed, (name, want) in enumerate(wants.items(), 1)}
            for _, keys in self.prompts.values():
                self.store(keys)
            fusing = next(r for r in self.worker.store_roots
                          if r.startswith(self.roots[2] + os.sep))
            self._shutdown()
            self.mount = ControlledMount(Path(fusing) / "objects", base / "fuse")
            start()
        except BaseException:
            self.close()
            raise

    # -- what a test does ---------------------------------------------------------------

    def _prompt(self, seed: int, want) -> tuple[SimpleNamespace, list[str]]:
        """A request of eight chunks whose keys' homes satisfy ``want(homes, fused)`` (the
        drive ids are random, so the prompt is chosen to fit them); (request, keys)."""
        from spoolctl.connector.drives import placement as drives
        from spoolctl.connector.scheduler_side.lookup import request_keys

        ns = self.sched.scheduler.deployment.chain_namespace
        for start in range(seed * 100_000, seed * 100_000 + 500):
            tokens = list(range(start, start + 8 * CHUNK_TOKENS + 5))
            request = SimpleNamespace(request_id=f"r{start}", prompt_token_ids=tokens,
                                      cache_salt=None, kv_transfer_params=None,
                                      prompt_embeds=None, lora_request=None, mm_features=None)
            keys = request_keys(request, namespace=ns, chunk_tokens=CHUNK_TOKENS)
            if want([drives.home(k, self.ids) for k in keys], self.fused):
                return request, keys
        raise AssertionError("no prompt fits the drives")  # 500 tries: never in practice

    def store(self, keys: list[str]) -> None:
        for i, key in enumerate(keys):
            self.ws.stager.stage(key, i, _fill(key), request=f"store-{key}")
        assert self.ws.flush(NET_S)

    def hit(self, request) -> int:
        """The scheduler's lookup, from a thread bounded far above its deadline: a lookup
        that waited on the hung disk fails the test (the mount is released first)."""
        return _bounded(lambda: self.sched.get_num_new_matched_tokens(request, 0)[0] or 0,
                        self.mount)

    def restore(self, keys: list[str]) -> tuple[int | None, dict[str, bytes]]:
        """The worker's restore pipeline over ``keys`` (bounded like ``hit``): the index
        of the first chunk that failed (None: all restored) and the bytes restored."""
        from spoolctl.connector.kv.formats import ChunkRestore

        chunk, copies = self.ws.copier.chunk_bytes, {}

        def item(key: str) -> ChunkRestore:
            def fill(st: Store, manifest, buf) -> int:
                st.read(manifest, "kv", into=memoryview(buf.numpy()))
                return chunk

            return ChunkRestore(key=key, valid=lambda manifest: True, fill=fill,
                                copy=lambda buf: copies.__setitem__(key, bytes(buf.numpy())))

        self.ws.pipeline.copy_in_reader = False
        failed = _bounded(lambda: self.ws.pipeline.run([item(k) for k in keys]), self.mount)
        return failed, copies

    def guard(self, drive: str):
        from spoolctl.connector.diskguard import guard_for

        return guard_for(self.ws.holdings.stores[drive])

    def _shutdown(self) -> None:
        for role in (self.sched, self.worker):
            if role is not None:
                role.shutdown()
        self.worker = self.sched = None

    def close(self) -> None:
        if self.mount is not None:
            self.mount.release()
        self._shutdown()
        if self.mount is not None:
            self.mount.close()


def _bounded(fn, mount):
    out: list[object] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(NET_S)
    if thread.is_alive():
        mount.release()
        thread.join(NET_S)
        raise AssertionError("the call waited on the hung drive until it was released")
    if errors:
        raise errors[0]
    return out[0]


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    def hang(homes: list[str], fused: str) -> bool:  # a chunk between, not the first/last
        return homes[0] != fused and homes[-1] != fused and fused in homes

    def eio(homes: list[str], fused: str) -> bool:  # a chunk on it after the first
        return homes[0] != fused and fused in homes

    drives = _ThreeDrives(tmp_path_factory.mktemp("fuse-drives"), {"hang": hang, "eio": eio})
    try:
        yield drives
    finally:
        drives.close()


@pytest.mark.timeout(120)
def test_a_hung_drive_among_three_costs_only_its_chunks_and_hits_again_once_it_answers(
        three: _ThreeDrives) -> None:
    """Decision 2714's plan: one of three drives hangs (every operation on its objects
    blocks). A restore that reaches its chunks fails at the deadline, the next ones at once
    while that read still hangs (``disk_slow``), the chunks before them restored byte for
    byte; its guard takes it out; lookups answer while it is still hung
    and miss only from its first chunk on; recomputed chunks homed there are written to
    their runner-ups (counted) and the prompt is a full hit again; the disk answers → the
    probe brings it back and its own copies are read again."""
    d = three
    chunk = d.ws.copier.chunk_bytes
    request, keys = d.prompts["hang"]
    first_hung = next(i for i, k in enumerate(keys) if _home(d, k) == d.fused)
    assert d.hit(request) == 8 * CHUNK_TOKENS
    assert d.restore(keys) == (None, {k: _payload(k, chunk) for k in keys})
    on_fused = [k for k in keys if _home(d, k) == d.fused]

    d.mount.hang()
    guard = d.guard(d.fused)
    try:
        deadlines = d.ws.counters.total(m.LOAD_ERRORS, reason="deadline")
        slow = d.ws.counters.total(m.LOAD_ERRORS, reason="disk_slow")
        restores = 0
        while not guard.down:  # each restore that reaches the hung drive fails there
            failed, copies = d.restore(keys)
            restores += 1
            assert failed == first_hung
            assert copies == {k: _payload(k, chunk) for k in keys[:first_hung]}
        # The first waits out its deadline; its reads still hang, so the drive gets no new
        # read: any later one fails ``disk_slow`` at once, until three failed reads took
        # it out (the first restore's parallel reads may count several; decision 2770).
        assert d.ws.counters.total(m.LOAD_ERRORS, reason="deadline") - deadlines == 1
        assert d.ws.counters.total(m.LOAD_ERRORS, reason="disk_slow") - slow == restores - 1
        # Out of service: the lookup answers while the disk is still hung, and only the
        # hung drive's chunks miss (the prefix ends at its first one).
        assert d.hit(request) == first_hung * CHUNK_TOKENS
        down = d.ws.counters.total(m.LOAD_ERRORS, reason="disk_down")
        failed, copies = d.restore(keys)  # its chunk fails at once, without a read
        assert failed == first_hung and set(copies) == set(keys[:first_hung])
        assert d.ws.counters.total(m.LOAD_ERRORS, reason="disk_down") - down == 1
        # vLLM recomputes; the chunks homed on the hung drive go to their runner-ups.
        before = d.ws.counters.total(m.DRIVE_FAILOVER_STORES, drive=d.roots[2])
        d.store(on_fused)
        assert d.ws.counters.total(m.DRIVE_FAILOVER_STORES, drive=d.roots[2]) - before \
            == len(on_fused)
        assert d.hit(request) == 8 * CHUNK_TOKENS
        assert d.restore(keys) == (None, {k: _payload(k, chunk) for k in keys})
    finally:
        d.mount.release()
    wait_until(lambda: not guard.down, NET_S, what="the probe bringing the drive back")
    # The reads that hung end once released (until then the drive is still slow: 2770).
    wait_until(lambda: all(f.done() for f in list(d.ws.pipeline.overdue)), NET_S,
               what="the hung reads ending")
    # Back: its own chunks are read from it again (the runner-ups' copies stay).
    wait_until(lambda: all(d.ws.holdings.locate(k) == d.fused for k in on_fused), NET_S,
               what="the drive's chunks held again")
    assert d.hit(request) == 8 * CHUNK_TOKENS
    assert d.restore(keys) == (None, {k: _payload(k, chunk) for k in keys})
    assert not list((Path(d.ws.holdings.stores[d.fused].root) / "quarantine").iterdir())


def _home(d: _ThreeDrives, key: str) -> str:
    from spoolctl.connector.drives import placement as drives

    return drives.home(key, d.ids)


@pytest.mark.timeout(120)
def test_an_eio_on_one_drives_objects_is_a_miss_never_a_quarantine_nor_wrong_bytes(
        three: _ThreeDrives) -> None:
    """A few sectors of one drive fail (EIO on the objects of one chunk): a restore of the
    prompt stops at that chunk (``io_error``: the chunks before it restored byte for byte,
    nothing quarantined, the entry still in the catalog, the drive kept in service), and
    once the sector reads again the chunk is restored whole."""
    from spoolctl.store import entry_id_for

    d = three
    chunk = d.ws.copier.chunk_bytes
    request, keys = d.prompts["eio"]
    bad = next(i for i, k in enumerate(keys) if _home(d, k) == d.fused)
    store = d.ws.holdings.stores[d.fused]
    entry = entry_id_for("vllm", d.ws.namespace, keys[bad])
    (ref,) = store.manifest(entry).objects
    errors = d.ws.counters.total(m.LOAD_ERRORS, reason="io_error")
    d.mount.eio(ref.digest)  # that object's opens and reads fail
    try:
        failed, copies = d.restore(keys)
        assert failed == bad and copies == {k: _payload(k, chunk) for k in keys[:bad]}
        assert d.ws.counters.total(m.LOAD_ERRORS, reason="io_error") - errors == 1
        assert d.ws.counters.total(m.QUARANTINE_EVENTS) == 0
        assert store.quarantine_items() == [] and store.live([entry]) == {entry}
        assert not d.guard(d.fused).down  # one error is a finding, not a dead drive
    finally:
        d.mount.release()
    assert d.restore(keys) == (None, {k: _payload(k, chunk) for k in keys})
    assert d.hit(request) == 8 * CHUNK_TOKENS
