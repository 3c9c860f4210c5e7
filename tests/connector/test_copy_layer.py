"""The torch-only copy layer (``spoolctl.connector.kv.kvio``) without vLLM: copy plans, bounds,
staging-buffer recycling after device copies, and the commit thread waiting for a copy.

KV caches are built with ``layouts.place`` + ``view_declared`` (what ``scripts/gpu_check.py``
does; ``test_kv_layouts`` proves it builds exactly vLLM's tensors).
"""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from spoolctl.connector.kv import layouts  # noqa: E402
from spoolctl.connector.kv.kvio import (  # noqa: E402
    DONE,
    BufferPool,
    CopyEngine,
    CopyHandle,
    PagedKV,
    view_declared,
)
from spoolctl.errors import ConfigError  # noqa: E402

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def caches(layout: str, *, num_blocks: int = 10, layers: int = 3, heads: int = 2,
           states: int = 4, content: int = 16, dtype: torch.dtype = torch.float16):
    names = [f"layers.{i}" for i in range(layers)]
    nbytes, decls = layouts.place(
        names, layout=layout, num_blocks=num_blocks, heads=heads, states=states,
        content_bytes=content * dtype.itemsize, itemsize=dtype.itemsize,
        dtype=str(dtype).removeprefix("torch."))
    raw = torch.randint(-128, 127, (nbytes,), dtype=torch.int8)
    return {n: view_declared(raw, d) for n, d in decls.items()}, decls, raw


@pytest.mark.parametrize("layout", LAYOUTS)
def test_capture_restore_is_byte_exact_and_touches_nothing_else(layout):
    src, decls, _ = caches(layout)
    dst, dst_decls, raw = caches(layout)
    a = PagedKV(src, num_blocks=10, blocks_per_chunk=3, declared=decls)
    b = PagedKV(dst, num_blocks=10, blocks_per_chunk=3, declared=dst_decls)
    before = raw.clone()
    buf = torch.empty(a.chunk_bytes, dtype=torch.uint8)
    a.capture([7, 2, 3], buf)
    b.restore(buf, [0, 9, 4], skip=1)  # position 0 computed locally
    expect = {n: view_declared(before, d).clone() for n, d in dst_decls.items()}
    for n in dst:
        expect[n][9] = src[n][2]
        expect[n][4] = src[n][3]
        assert torch.equal(dst[n].view(torch.uint8), expect[n].view(torch.uint8)), n


def test_dense_runs_are_one_copy_per_layer_and_gathers_are_not():
    src, decls, _ = caches("LBNHC")
    kv = PagedKV(src, num_blocks=10, blocks_per_chunk=4, declared=decls)
    assert len(kv._plan([3, 4, 5, 6])) == 3  # one contiguous range per layer
    assert len(kv._plan([3, 4, 8, 1])) == 3 * 3  # runs 3-4, 8, 1
    # Head-outer pages (LHBNC: heads outside the blocks) are one range per head and block.
    src, decls, _ = caches("LHBNC")
    kv = PagedKV(src, num_blocks=10, blocks_per_chunk=4, declared=decls)
    assert len(kv._plan([3, 4, 5, 6])) == 3 * 4 * 2
    # Block-outermost (BLHNC): a layer's page is contiguous, the next block is not.
    src, decls, _ = caches("BLHNC")
    kv = PagedKV(src, num_blocks=10, blocks_per_chunk=4, declared=decls)
    assert len(kv._plan([3, 4, 5, 6])) == 3 * 4


def test_block_ids_outside_the_cache_are_refused_before_any_byte_moves():
    src, decls, raw = caches("LBNHC")
    kv = PagedKV(src, num_blocks=10, blocks_per_chunk=2, declared=decls)
    buf = torch.zeros(kv.chunk_bytes, dtype=torch.uint8)
    before = raw.clone()
    for ids in ([3, 10], [-1, 2], [2, 12345]):
        with pytest.raises(ValueError, match="outside"):
            kv.capture(ids, buf)
        with pytest.raises(ValueError, match="outside"):
            kv.restore(buf, ids)
    assert torch.equal(raw, before) and not buf.any()
    with pytest.raises(ValueError, match="a chunk is 2 blocks"):
        kv.capture([1, 2, 3], buf)


def test_cpu_copies_are_synchronous_and_need_no_stream():
    engine = CopyEngine("cpu")
    assert engine.stream is None
    a, b = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    handle = engine.run([(b, a)])
    assert handle is DONE and handle.done() and torch.equal(a, b)
    handle.wait()
    handle.order_before_compute()  # no compute stream on CPU: a no-op
    engine.synchronize()


class _Copy:
    """Stands for a device event whose copy finishes when the test says so (the pool's
    bookkeeping is what is tested; real CUDA events run in scripts/gpu_check.py)."""

    def __init__(self):
        self.finished = threading.Event()
        self.waited = False

    def query(self) -> bool:
        return self.finished.is_set()

    def synchronize(self) -> None:
        self.waited = True
        self.finished.wait(5)


def test_pool_reuses_a_buffer_only_after_its_device_copy_finished():
    pool = BufferPool(4096, slots=2)
    a, b = pool.get(), pool.get()
    first, second = _Copy(), _Copy()
    pool.put(a, after=CopyHandle(first))
    pool.put(b, after=CopyHandle(second))
    with pytest.raises(ValueError, match="twice"):
        pool.put(a)  # still pending: returning it again is a bug
    second.finished.set()
    got = pool.get()  # the finished one, without waiting for the other
    assert got.data_ptr() == b.data_ptr() and not first.waited
    # Every slot busy or pending: get() waits for the oldest pending copy (bounded), rather
    # than handing out a buffer the device may still be reading.
    threading.Timer(0.05, first.finished.set).start()
    again = pool.get()
    assert again.data_ptr() == a.data_ptr() and first.waited
    assert pool.get() is None  # both handed out, nothing pending
    pool.put(got)
    pool.put(again, after=DONE)
    pool.close()


def test_pinning_needs_a_cuda_device():
    if torch.cuda.is_available():
        pool = BufferPool(1 << 20, slots=2, pin=True)
        assert pool.pinned
        pool.close()
        return
    with pytest.raises(ConfigError, match="CUDA"):
        BufferPool(4096, slots=1, pin=True)
    assert not BufferPool(4096, slots=1).pinned


def test_commit_thread_waits_for_the_copy_before_reading_the_payload():
    from spoolctl.connector.stats import ConnectorCounters
    from spoolctl.connector.worker_side.writer import PendingStore, StoreWriter

    seen: list[bytes] = []
    payload = bytearray(4)
    copy = _Copy()

    def finish_copy() -> None:  # the "device" fills the staging buffer, then completes
        payload[:] = b"data"
        copy.finished.set()

    writer = StoreWriter(lambda key, p, meta: seen.append(bytes(p)), staging_bytes=100,
                         counters=ConnectorCounters())
    assert writer.reserve("a" * 64, 4)
    writer.submit(PendingStore("a" * 64, memoryview(payload), 4, {},
                               ready=CopyHandle(copy).wait))
    threading.Timer(0.05, finish_copy).start()
    assert writer.flush(5)
    assert seen == [b"data"] and copy.waited
    writer.close()


def test_grouped_capture_checks_every_group_before_copying_anything():
    from spoolctl.connector.kv.format_grouped import GroupedFormat
    from spoolctl.connector.planning.groups import GroupInfo, group_layouts
    from spoolctl.connector.planning.plan import GroupChunkStore
    from spoolctl.connector.stats import ConnectorCounters

    groups = [GroupInfo(0, "full_attention", ("a",), 4), GroupInfo(1, "full_attention",
                                                                    ("b",), 4)]
    copier = GroupedFormat(8, groups, group_layouts(groups, 8)).copier(ConnectorCounters())
    kv = {"a": torch.randn(6, 2, 4, 8), "b": torch.randn(6, 2, 4, 8)}
    copier.bind(kv, 6)
    buf = torch.zeros(copier.chunk_bytes, dtype=torch.uint8)
    for bad in (((1, 2), (3, 6)), ((1, 2), (0, 3))):  # out of range; the null block
        (_, _, fill), = copier.captures(type("M", (), {"group_stores": [
            GroupChunkStore("r", 0, "k" * 64, bad)]})())
        with pytest.raises(ValueError):
            fill(buf)
        assert not buf.any()  # group 0's blocks were not copied either
    (_, _, fill), = copier.captures(type("M", (), {"group_stores": [
        GroupChunkStore("r", 0, "k" * 64, ((1, 2), (3, 4)))]})())
    objects, handle = fill(buf)
    handle.wait()
    assert sorted(objects) == ["g0", "g1"] and buf.any()
