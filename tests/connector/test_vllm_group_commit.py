"""The connector's writer commits the chunks queued together as one group commit.

Against a real store (no engine): the chunks that queued while the previous commit ran go
through ``Store.put_many`` together (``rank_commit_many``), and each keeps its own outcome:
a chunk over capacity or with a bad key is skipped and counted by its reason while the
others are committed, reported to the holdings and readable with their own bytes. On a
real full filesystem (a size-limited tmpfs) the chunks that do not fit are shed (counted,
never raised, nothing partial visible) and the writer commits again once there is room.
Exit drain of batches: tests/connector/test_vllm_exit.py; engines:
tests/connector/test_vllm_connector.py.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from spoolctl import metrics as m
from spoolctl.connector.stats import ConnectorCounters
from spoolctl.store import Store
from spoolctl.store.disk.reserve import HEADROOM_BYTES

pytest.importorskip("torch")  # spoolctl.connector.worker_side.capture adapts torch

NS = "vllm-v1-batch"


def _key(i: int) -> str:
    return f"{i:064x}"


def _writer(store: Store, counters: ConnectorCounters, batches: list[int]):
    from spoolctl.connector.worker_side.capture import rank_commit, rank_commit_many
    from spoolctl.connector.worker_side.holdings import RankHoldings
    from spoolctl.connector.worker_side.writer import StoreWriter

    holdings = RankHoldings(store, kind="vllm", namespace=NS, rank=0, epoch=1)
    many = rank_commit_many(store, NS, holdings)

    def put_many(items):
        batches.append(len(items))
        return many(items)

    writer = StoreWriter(rank_commit(store, NS, holdings), staging_bytes=64 << 20,
                         counters=counters, put_many=put_many)
    return writer, holdings


def _chunk(i: int, size: int) -> bytes:
    return bytes([i % 251]) * size


def test_chunks_queued_together_commit_together_each_with_its_outcome(tmp_path: Path):
    from spoolctl.connector.worker_side.writer import PendingStore

    counters, batches, released = ConnectorCounters(), [], []
    root = Path(os.path.realpath(tmp_path)) / "s"
    with Store.open(root, create=True, max_bytes=4 << 20) as store:
        writer, holdings = _writer(store, counters, batches)
        entered, gate = threading.Event(), threading.Event()

        def hold() -> None:  # the first chunk's device copy is still running
            entered.set()
            gate.wait(30)

        sizes = {i: 64 << 10 for i in range(9)}
        sizes[4] = 8 << 20  # alone over the store's low watermark: CapacityError
        keys = {i: _key(i) for i in range(9)}
        keys[6] = "not a chunk key \x00"  # refused by the store's argument checks
        items = {i: PendingStore(keys[i], {"kv": _chunk(i, sizes[i])}, sizes[i], {"chunk_index": i},
                                 on_done=lambda i=i: released.append(i))
                 for i in range(9)}
        items[0].ready = hold
        for i in range(9):
            assert writer.reserve(keys[i], sizes[i])
        writer.submit(items[0])
        assert entered.wait(30)
        for i in range(1, 9):
            writer.submit(items[i])
        gate.set()
        assert writer.flush(60)
        assert writer.staged_bytes == 0
        assert sorted(released) == list(range(9))
        assert batches == [1, 8]  # the eight queued meanwhile: one group commit

        committed = [i for i in range(9) if i not in (4, 6)]
        assert holdings.held_keys() == {keys[i] for i in committed}
        assert sorted(r.key for r in store.entries(kind="vllm")) == \
            sorted(keys[i] for i in committed)
        for i in committed:
            manifest = store.lookup("vllm", NS, keys[i])
            assert bytes(store.read(manifest, "kv")) == _chunk(i, sizes[i])
            assert manifest.meta["chunk_index"] == i
        assert writer.close(5)
    assert counters.total(m.STORES_SKIPPED, reason="capacity") == 1
    assert counters.total(m.STORES_SKIPPED, reason="io_error") == 1
    assert counters.total(m.STORE_WRITE_BYTES) == sum(sizes[i] for i in committed)


def test_a_full_disk_sheds_chunks_of_a_batch_and_commits_again_later(mount_tmpfs):
    from spoolctl.connector.worker_side.writer import PendingStore

    fs = mount_tmpfs("8m")
    counters, batches = ConnectorCounters(), []
    with Store.open(fs / "s", create=True) as store:
        writer, holdings = _writer(store, counters, batches)
        free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
        filler = fs / "filler"
        # Room for about two chunks above the headroom a commit leaves to maintenance.
        filler.write_bytes(b"\0" * max(0, free - HEADROOM_BYTES - (700 << 10)))
        entered, gate = threading.Event(), threading.Event()

        def hold() -> None:
            entered.set()
            gate.wait(30)

        size = 256 << 10
        items = [PendingStore(_key(i), {"kv": _chunk(i, size)}, size, {}) for i in range(8)]
        items[0].ready = hold
        for item in items:
            assert writer.reserve(item.key, size)
        writer.submit(items[0])
        assert entered.wait(30)
        for item in items[1:]:
            writer.submit(item)
        gate.set()
        assert writer.flush(60)
        skipped = sum(counters.total(m.STORES_SKIPPED, reason=r)
                      for r in ("io_error", "capacity", "busy"))
        stored = {r.key for r in store.entries(kind="vllm")}
        assert skipped >= 1 and len(stored) + skipped == 8  # every chunk accounted for
        print(f"stored {len(stored)} of 8 chunks on the full disk")
        assert holdings.held_keys() == stored
        for key in stored:  # what is visible is whole
            i = int(key, 16)
            assert bytes(store.read(store.lookup("vllm", NS, key), "kv")) == _chunk(i, size)
        assert list(store.layout.tmp.iterdir()) == []  # nothing half-written left behind

        filler.unlink()  # room again: the same writer commits what comes next
        late = PendingStore(_key(100), {"kv": _chunk(100, size)}, size, {})
        assert writer.reserve(late.key, size)
        writer.submit(late)
        assert writer.flush(60)
        assert store.lookup("vllm", NS, late.key) is not None
        assert writer.close(5)
    assert writer.staged_bytes == 0
