"""PyTorchCacheController with real torch + transformers on the locally built tiny Llama."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
from controller_backends import Counting, cold_tokens, prompt_ids
from waiting import wait_until

pytest.importorskip("transformers")

from spoolctl.controllers import CachePrepareParams, LocalCacheController, render_segments
from spoolctl.controllers.local.engine import FORMAT
from spoolctl.controllers.local.tokens import TokenPrefix
from spoolctl.controllers.pytorch import PyTorchBackend, PyTorchCacheController
from spoolctl.store import QuarantineReason, Store

SYSTEM = "You are a helpful assistant. Answer using the reference documents below."
DOC1 = "Manual, part one: the pump starts when the valve is open and the tank is full. " * 5
DOC2 = "Manual, part two: never run the pump dry; check the seal every month. " * 3
QUESTION = "Question: when does the pump start?"
P1 = {"model": "tiny", "instructions": [SYSTEM], "data": [DOC1]}
P2 = {"model": "tiny", "instructions": [SYSTEM], "data": [DOC1, DOC2]}


@pytest.fixture(scope="module")
def backend(tiny_model_dir) -> PyTorchBackend:
    return PyTorchBackend(tiny_model_dir, model_id="tiny")


def cold(backend: PyTorchBackend, p: CachePrepareParams, prompt: str = QUESTION, n: int = 8):
    return cold_tokens(backend, p, prompt, n)


def test_cold_greedy_matches_transformers_generate(backend):
    """The backend's own greedy loop agrees with transformers' generate (the reference)."""
    import torch

    p = CachePrepareParams(**P1)
    ids = prompt_ids(backend, p, QUESTION)
    with torch.no_grad():
        ref = backend.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     pad_token_id=backend.tokenizer.pad_token_id)
    assert cold(backend, p) == ref[0, len(ids):].tolist()


CHILD = r"""
import json, os, sys, time
from spoolctl.controllers import CachePrepareParams
from spoolctl.controllers.pytorch import PyTorchBackend, PyTorchCacheController
model, root, prompt = sys.argv[1:4]
backend = PyTorchBackend(model, model_id="tiny")
calls = []
real = backend.prefill
def prefill(cache, tokens):
    calls.append(len(tokens))
    time.sleep(float(os.environ.get("SLOW_PREFILL", "0")))
    return real(cache, tokens)
backend.prefill = prefill
go = os.environ.get("GO_FILE")
if go:
    open(go + f".ready-{os.getpid()}", "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
params = CachePrepareParams(**json.loads(os.environ["PARAMS"]))
with PyTorchCacheController(backend, root) as ctl:
    r = ctl.generate(params, prompt, 8)
print(json.dumps({"source": r.handle.source, "written": r.handle.written_tokens,
                  "cached": r.handle.cached_tokens, "tokens": r.tokens,
                  "usage": r.usage.to_json(), "prefills": calls}))
"""


def run_child(model: Path, root: Path, params: dict, *, env: dict | None = None,
              wait: bool = True):
    full_env = {**os.environ, "PARAMS": json.dumps(params), **(env or {})}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(model), str(root), QUESTION],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env)
    return finish(proc) if wait else proc


def finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_restart_reuse_in_new_process_gives_identical_tokens(backend, tiny_model_dir,
                                                             store_root):
    p = CachePrepareParams(**P1)
    want = cold(backend, p)
    with PyTorchCacheController(backend, store_root) as ctl:
        first = ctl.generate(p, QUESTION, 8)
    assert first.handle.source == "cold" and first.tokens == want
    child = run_child(tiny_model_dir, store_root, P1)
    assert child["source"] == "disk" and child["prefills"] == [] and child["written"] == 0
    assert child["tokens"] == want
    assert child["usage"]["cache_read_tokens"] == first.handle.cached_tokens > 0
    assert child["usage"]["cache_write_tokens"] == 0


def test_incremental_prefill_equals_cold_and_writes_only_the_suffix(backend, store_root):
    p1, p2 = CachePrepareParams(**P1), CachePrepareParams(**P2)
    with PyTorchCacheController(backend, store_root) as ctl:
        h1 = ctl.prepare(p1)
    counting = Counting(backend)
    with LocalCacheController(counting, store_root) as ctl:  # fresh memory: base from disk
        h2 = ctl.prepare(p2)
        assert h2.source == "incremental" and h2.supersedes == h1.ref
        assert h2.reused_tokens == h1.cached_tokens
        assert h2.written_tokens == h2.cached_tokens - h1.cached_tokens > 0
        assert counting.prefills == [h2.written_tokens]  # only the suffix ran
        assert ctl.store.row(h1.ref).hint == "release"  # the base was released
        r = ctl.generate(h2, QUESTION, 8)  # reports the incremental prepare
        assert r.tokens == cold(backend, p2)
        assert r.usage.cache_disk_tokens == r.usage.cache_read_tokens == h1.cached_tokens
        assert r.usage.cache_write_tokens == h2.written_tokens
    with Store.open(store_root) as s:  # close deleted the released base, kept the new entry
        assert s.row(h1.ref) is None and s.row(h2.ref).hint == "retain"
        assert s.manifest(h2.ref).supersedes == h1.ref


def test_shorter_prompt_reuses_a_longer_base_by_trimming(backend, store_root):
    p1, p2 = CachePrepareParams(**P1), CachePrepareParams(**P2)
    with PyTorchCacheController(backend, store_root) as ctl:
        ctl.prepare(p2)
    counting = Counting(backend)
    with LocalCacheController(counting, store_root) as ctl:
        h1 = ctl.prepare(p1)
        assert h1.source == "incremental" and h1.written_tokens == 0 and counting.prefills == []
        assert ctl.generate(h1, QUESTION, 8).tokens == cold(backend, p1)


def test_a_prompt_inside_or_past_a_stored_message_reuses_every_shared_token(backend,
                                                                            store_root):
    """Full attention, the common-prefix rule (``family_prompts.check_common_prefix_rule``):
    a prompt that stops inside a stored document, and one that extends it inside its
    message, reuse every leading id they share with it (the base cut there), not only the
    instructions."""
    from family_prompts import check_common_prefix_rule

    check_common_prefix_rule(PyTorchCacheController, backend, "tiny", store_root)


def test_one_long_message_extended_by_a_few_tokens_finds_its_base(backend, store_root):
    """No instructions, one message: no element is shared with the stored entry, yet the
    catalog's token marks find it and all but the changed tail is reused."""
    from family_prompts import MORE, shared_ids

    p1 = CachePrepareParams(model="tiny", data=[DOC1])
    p2 = CachePrepareParams(model="tiny", data=[DOC1 + MORE])
    with PyTorchCacheController(backend, store_root) as ctl:
        stored = ctl.prefix_tokens(p1)
        ctl.prepare(p1)
    with PyTorchCacheController(backend, store_root) as ctl:
        shared = shared_ids(stored, ctl.prefix_tokens(p2))
        h = ctl.prepare(p2)
        assert h.source == "incremental" and h.reused_tokens == shared > len(stored) - 4
        assert ctl.generate(h, QUESTION, 8).tokens == cold(backend, p2)


def test_corrupt_payload_is_a_cold_path_and_quarantined(backend, store_root):
    p = CachePrepareParams(**P1)
    want = cold(backend, p)
    with PyTorchCacheController(backend, store_root) as ctl:
        ref = ctl.prepare(p).ref
        manifest = ctl.store.manifest(ref)
        obj = ctl.store.layout.object_path(manifest.object("kv").digest)
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit inside the tensor data
    obj.write_bytes(bytes(data))
    with PyTorchCacheController(backend, store_root) as ctl:
        r = ctl.generate(CachePrepareParams(**P1, read_only=True), QUESTION, 8)
        assert r.tokens == want and r.usage.cache_read_tokens == 0 and not r.handle
        items = ctl.store.quarantine_items()
        assert [i.reason for i in items] == [QuarantineReason.PAYLOAD_DIGEST]
        assert ctl.store.row(ref) is None
        again = ctl.prepare(p)  # rebuilt cold, then served normally
        assert again.source == "cold" and ctl.generate(again, QUESTION, 8).tokens == want


def test_payload_not_matching_its_manifest_is_rejected_never_used(backend, store_root):
    """Verified bytes that do not fit the description (fewer tokens than the manifest
    claims) must be a miss + quarantine, not a cache that yields wrong tokens."""
    p = CachePrepareParams(**P1)
    want = cold(backend, p)
    with PyTorchCacheController(backend, store_root) as ctl:
        ids = [t for s in backend.tokenize_segments(render_segments(p)) for t in s]
        prefix = TokenPrefix.from_segments(backend.tokenize_segments(render_segments(p)))
        short = backend.prefill(backend.new_cache(), ids[:-5])
        objects, layout = backend.serialize(short, len(ids) - 5)
        ctl.store.put(kind="pytorch", namespace=ctl.namespace, key=p.key(), objects=objects,
                      meta={"format": FORMAT, "identity": ctl.identity, "layout": layout,
                            **prefix.to_meta()},
                      index={"group": p.group_hash(), "elements": p.element_hashes(),
                             "tokens": len(ids)})
    with PyTorchCacheController(backend, store_root) as ctl:
        h = ctl.prepare(p)
        assert h.source == "cold"
        assert [i.reason for i in ctl.store.quarantine_items()] == \
            [QuarantineReason.MANIFEST_VALIDATION]
        assert ctl.generate(h, QUESTION, 8).tokens == want


def test_wrong_model_dtype_or_revision_is_a_miss(backend, tiny_model_dir, store_root):
    p = CachePrepareParams(**P1)
    with PyTorchCacheController(backend, store_root) as ctl:
        h32 = ctl.prepare(p)
        objects = ctl.store.read_all(ctl.store.manifest(h32.ref))
        layout32 = dict(ctl.store.manifest(h32.ref).meta["layout"])
    bf16 = PyTorchBackend(tiny_model_dir, dtype="bfloat16", model_id="tiny")
    vouched = PyTorchBackend(tiny_model_dir, revision="v2", model_id="tiny")
    for other in (bf16, vouched):
        with PyTorchCacheController(other, store_root) as ctl:
            h = ctl.prepare(p)
            assert h.source == "cold" and h.ref != h32.ref
    # And the bf16 model refuses the float32 payload outright.
    with pytest.raises(ValueError):
        bf16.deserialize(objects, layout32, h32.cached_tokens)
    with Store.open(store_root) as s:
        assert len(s.entries(kind="pytorch")) == 3 and s.quarantine_items() == []


def test_concurrent_identical_prepares_are_coalesced(backend, store_root):
    counting = Counting(backend, delay=0.5)
    p = CachePrepareParams(**P1)
    barrier = threading.Barrier(6)
    handles = []

    def worker():
        barrier.wait()
        handles.append(ctl.prepare(CachePrepareParams(**P1)))

    with LocalCacheController(counting, store_root) as ctl:
        threads = [threading.Thread(target=worker) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(counting.prefills) == 1
        assert {h.ref for h in handles} == {ctl.entry_id(p)}
        assert sorted(h.source for h in handles).count("cold") == 1
        assert sum(h.written_tokens for h in handles) == handles[0].cached_tokens


class Gated(Counting):
    """A backend whose prefills wait for ``gate`` and announce themselves in ``started``."""

    def __init__(self, backend: PyTorchBackend):
        super().__init__(backend)
        self.started = threading.Event()
        self.gate = threading.Event()

    def prefill(self, cache, tokens):
        self.started.set()
        assert self.gate.wait(60), "the test never opened the gate"
        return super().prefill(cache, tokens)


def test_read_only_prepare_joins_a_writers_flight(backend, store_root):
    """Decision 1021: a read-only prepare that arrives while a writer prefills the same key
    waits for it and gets its entry ("coalesced", nothing written by the reader), instead
    of missing on disk; it is counted as coalesced when it joins."""
    gated = Gated(backend)
    handles: dict[str, object] = {}
    with LocalCacheController(gated, store_root) as ctl:
        writer = threading.Thread(target=lambda: handles.update(
            writer=ctl.prepare(CachePrepareParams(**P1))))
        writer.start()
        assert gated.started.wait(60)
        reader = threading.Thread(target=lambda: handles.update(
            reader=ctl.prepare(CachePrepareParams(**P1, read_only=True))))
        reader.start()
        # counted on joining, before the writer is done
        wait_until(lambda: ctl.stats()["coalesced"] >= 1, what="the read-only prepare joining")
        assert "reader" not in handles
        gated.gate.set()
        writer.join(60)
        reader.join(60)
        w, r = handles["writer"], handles["reader"]
        assert w.source == "cold" and r.source == "coalesced" and r.ref == w.ref
        assert r.written_tokens == r.reused_tokens == 0 and r.cached_tokens == w.cached_tokens
        assert len(gated.prefills) == 1
        assert ctl.generate(r, QUESTION, 8).tokens == cold(backend, CachePrepareParams(**P1))


def test_two_processes_preparing_the_same_params_prefill_once(backend, tiny_model_dir,
                                                              store_root, tmp_path):
    want = cold(backend, CachePrepareParams(**P1))
    Store.open(store_root, create=True).close()
    go = tmp_path / "go"
    env = {"GO_FILE": str(go), "SLOW_PREFILL": "1.5"}
    procs = [run_child(tiny_model_dir, store_root, P1, env=env, wait=False) for _ in range(2)]
    # both children loaded and waiting at the start line
    wait_until(lambda: len(list(tmp_path.glob("go.ready-*"))) == 2, 300,
               what="both children ready")
    go.touch()
    results = [finish(p) for p in procs]
    assert sorted(r["source"] for r in results) == ["cold", "disk"]
    assert sum(len(r["prefills"]) for r in results) == 1
    assert all(r["tokens"] == want for r in results)


def test_release_and_close_delete_only_this_controllers_released_entries(backend, store_root):
    other = PyTorchCacheController(backend, store_root)
    c = other.prepare(CachePrepareParams(model="tiny", data=["a third, unrelated text"]))
    other.release(c.ref)
    with PyTorchCacheController(backend, store_root) as ctl:
        a = ctl.prepare(CachePrepareParams(**P1))
        b = ctl.prepare(CachePrepareParams(model="tiny", instructions=["another system text"]))
        ctl.release(a.ref)
    with Store.open(store_root) as s:
        assert s.row(a.ref) is None
        assert s.row(b.ref).hint == "retain"
        assert s.row(c.ref).hint == "release"  # another controller's: not ours to delete
    other.close()
    with Store.open(store_root) as s:
        assert s.row(c.ref) is None and s.row(b.ref) is not None


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for path in sorted(root.rglob("*")):
        # SQLite's shared-memory index is rewritten by readers; the database is not.
        if path.is_file() and not path.name.endswith(("-shm",)):
            st = path.stat()
            out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def test_read_only_never_writes(backend, store_root):
    with PyTorchCacheController(backend, store_root) as ctl:
        hit = ctl.prepare(CachePrepareParams(**P1))
    with Store.open(store_root) as s:
        before_access = s.row(hit.ref).last_access
    before = snapshot(store_root)
    want_hit, want_miss = cold(backend, CachePrepareParams(**P1)), \
        cold(backend, CachePrepareParams(**P2))
    with PyTorchCacheController(backend, store_root) as ctl:
        before = snapshot(store_root)  # opening may resolve housekeeping; measure after it
        miss = ctl.generate(CachePrepareParams(**P2, read_only=True), QUESTION, 8)
        again = ctl.generate(CachePrepareParams(**P1, read_only=True), QUESTION, 8)
        assert not miss.handle and miss.usage.cache_read_tokens == 0
        assert miss.usage.cache_write_tokens == 0 and miss.tokens == want_miss
        assert again.handle.source == "disk" and again.tokens == want_hit
        assert again.usage.cache_read_tokens == hit.cached_tokens
        assert snapshot(store_root) == before
    with Store.open(store_root) as s:
        assert s.row(hit.ref).last_access == before_access
        assert len(s.entries()) == 1


def _kv_variants(good: bytes) -> list[bytes]:
    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8:8 + n])
    name = next(k for k in header if k != "__metadata__")

    def with_header(h: dict) -> bytes:
        raw = json.dumps(h).encode()
        return len(raw).to_bytes(8, "little") + raw + good[8 + n:]

    beyond = {**header, name: {**header[name], "data_offsets": [0, len(good)]}}
    wrong_dtype = {**header, name: {**header[name], "dtype": "F64"}}
    wrong_shape = {**header, name: {**header[name], "shape": [1, 1, 1, 1]}}
    return [b"", b"\x00" * 7, (1 << 40).to_bytes(8, "little") + good[8:], good[:-16],
            with_header(beyond), with_header(wrong_dtype), with_header(wrong_shape),
            b"\x04\x00\x00\x00\x00\x00\x00\x00nope" + good[8 + n:]]


def test_malformed_kv_payload_is_rejected_not_loaded(backend):
    ids = prompt_ids(backend, CachePrepareParams(**P1), QUESTION)[:40]
    objects, layout = backend.serialize(backend.prefill(backend.new_cache(), ids), 40)
    good = bytes(objects["kv"])
    assert backend.length(backend.deserialize({"kv": memoryview(bytearray(good))}, layout,
                                              40)) == 40
    for bad in _kv_variants(good):
        with pytest.raises((ValueError, TypeError)):
            backend.deserialize({"kv": memoryview(bytearray(bad))}, layout, 40)
    with pytest.raises(ValueError):
        backend.deserialize({"kv": memoryview(bytearray(good))}, layout, 41)
    with pytest.raises(ValueError):
        backend.deserialize({"kv": memoryview(bytearray(good))}, {**layout, "layers": 3}, 40)


def test_store_too_small_still_serves_the_request_from_memory(backend, store_root):
    p = CachePrepareParams(**P1)
    with PyTorchCacheController(backend, store_root, max_bytes=64 << 10) as ctl:  # < one entry
        h = ctl.prepare(p)
        assert h.source == "cold" and ctl.stats()["commit_failures"] == 1
        assert h.written_tokens == 0 and h.computed_tokens == h.cached_tokens
        r = ctl.generate(h, QUESTION, 8)  # computed, not written (the commit failed)
        assert r.tokens == cold(backend, p) and r.usage.cache_write_tokens == 0
        again = ctl.generate(h, QUESTION, 8)
        assert again.usage.cache_memory_tokens == h.cached_tokens
        assert ctl.store.entries() == []


def test_lock_held_elsewhere_times_out_to_a_cold_run(backend, store_root):
    from spoolctl.controllers.local.engine import LOCK_STRIPES
    from spoolctl.store.disk.locks import hold

    p = CachePrepareParams(**P1)
    with PyTorchCacheController(backend, store_root, lock_timeout=0.2) as ctl:
        stripe = int(ctl.entry_id(p)[:2], 16) % LOCK_STRIPES
        lock = ctl.store.layout.state / f"prepare-{stripe:02x}.lock"
        with hold(lock, exclusive=True, timeout=5, what="test"):  # "another process" prefills
            h = ctl.prepare(p)
            assert not h
            r = ctl.generate(p, QUESTION, 8)
        assert r.tokens == cold(backend, p) and r.usage.cache_read_tokens == 0
        assert ctl.prepare(p).source == "cold"  # once the holder is gone, it proceeds


def test_a_restore_warns_nothing_from_disk_or_from_read_only_bytes(backend, store_root):
    """Restoring hands torch writable buffers only: a read-only one would make torch warn
    ("The given buffer is not writable") and a write through the tensor undefined."""
    from spoolctl.controllers.pytorch import KV_OBJECT

    p = CachePrepareParams(**P1)
    with PyTorchCacheController(backend, store_root) as ctl:
        ctl.prepare(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with PyTorchCacheController(backend, store_root) as ctl:  # nothing in memory
            assert ctl.prepare(p).source == "disk"
            restored = ctl.restore(p)
        objects, layout = backend.serialize(restored.cache, len(restored.tokens))
        data = bytes(objects[KV_OBJECT])  # read-only, as bytes from any other source are
        cache = backend.deserialize({KV_OBJECT: memoryview(data)}, layout,
                                    len(restored.tokens))
    assert backend.length(cache) == len(restored.tokens)
