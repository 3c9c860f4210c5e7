"""SpoolTier's pure parts: its options, its keys, its I/O threads and its LRU touches
(no vLLM needed; the touches against a real store)."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path

import pytest
from waiting import StepClock

from spoolctl.connector.tier.api_check import check_tier_api
from spoolctl.connector.tier.bounded import BoundedCall
from spoolctl.connector.tier.io import Done, TierIO
from spoolctl.connector.tier.keys import (
    KIND,
    OBJECT,
    check_stable_hashing,
    entry_key,
    namespace_of,
)
from spoolctl.connector.tier.settings import parse_settings
from spoolctl.connector.tier.touch import Toucher, touch_in
from spoolctl.errors import ConfigError
from spoolctl.store import Store

pytestmark = pytest.mark.base

CHUNK = 64


def one_line(exc: pytest.ExceptionInfo[ConfigError]) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_settings_parse_sizes_and_keep_defaults() -> None:
    s = parse_settings({"root": "/var/cache/spool", "max_size": "2GiB", "locality": "LOCAL"})
    assert s.max_size == 2 << 30 and s.queue_depth > 0 and s.read_deadline > 0


@pytest.mark.parametrize(("options", "named"), [
    ({}, "'root'"),
    ({"root": "relative/dir"}, "'root'"),
    ({"root": "/r", "max_size": "lots"}, "'max_size'"),
    ({"root": "/r", "max_size": 0}, "'max_size'"),
    ({"root": "/r", "queue_depth": 0}, "'queue_depth'"),
    ({"root": "/r", "read_deadline": "never"}, "'read_deadline'"),
    ({"root": "/r", "root_dir": "/r"}, "'root_dir'"),  # the fs tier's option, not ours
])
def test_a_bad_option_is_refused_in_one_line_naming_it(options: dict, named: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_settings(options)
    assert named in one_line(exc)


def test_block_hashes_must_survive_a_restart() -> None:
    check_stable_hashing("sha256", None)
    check_stable_hashing("sha256_cbor", None)
    check_stable_hashing("xxhash", "0")  # a shared PYTHONHASHSEED makes the seed fixed
    with pytest.raises(ConfigError) as exc:
        check_stable_hashing("xxhash_cbor", None)
    assert "PYTHONHASHSEED" in one_line(exc) and "sha256" in one_line(exc)
    with pytest.raises(ConfigError):
        check_stable_hashing("md5-someday", None)


def test_the_namespace_binds_the_weights_and_the_key_is_the_offload_key() -> None:
    identity = {"model": "m", "weights": "a", "chunk_bytes": 4096}
    assert namespace_of(identity) == namespace_of(dict(reversed(identity.items())))
    assert namespace_of(identity) != namespace_of({**identity, "weights": "b"})
    assert entry_key(b"\x01\x02" + (3).to_bytes(4, "big")) == "010200000003"


def make_io(read, write, *, depth: int = 2, deadline: float = 30.0) -> TierIO:
    return TierIO(read=read, write=write, chunk_bytes=CHUNK, read_threads=1, write_threads=1,
                  queue_depth=depth, read_deadline=deadline)


def wait_done(io: TierIO, want: int, seconds: float = 30.0) -> list[Done]:
    got: list[Done] = []
    until = time.monotonic() + seconds
    while len(got) < want and time.monotonic() < until:
        got += io.finished()
        time.sleep(0.01)
    return got


def test_a_slow_disk_drops_new_stores_instead_of_blocking_the_caller() -> None:
    disk, writing = threading.Event(), threading.Event()

    def write(chunks):
        writing.set()
        disk.wait()
        return {k for k, _ in chunks}

    io = make_io(lambda key, into: False, write, depth=2)
    slot = memoryview(bytearray(CHUNK))
    assert io.submit_store(0, [b"\0"], [slot])
    assert writing.wait(30)  # the writer holds job 0: the disk hangs
    accepted = [io.submit_store(i, [bytes([i])], [slot]) for i in range(1, 5)]
    assert accepted == [True, True, False, False]  # 2 queued, then refused at once
    disk.set()
    done = wait_done(io, 3)
    assert sorted(d.job_id for d in done) == [0, 1, 2] and all(d.ok_keys for d in done)
    assert io.shutdown(10)


def test_a_hung_read_fails_its_job_and_its_late_bytes_never_reach_the_slot() -> None:
    disk = threading.Event()

    def read(key: bytes, into: memoryview) -> bool:
        disk.wait()
        into[:] = b"\xee" * CHUNK
        return True

    io = make_io(read, lambda chunks: set(), deadline=0.2)
    slot = memoryview(bytearray(CHUNK))
    io.submit_load(7, [b"k"], [slot])
    [done] = wait_done(io, 1)
    assert done.job_id == 7 and done.ok_keys == []
    disk.set()  # the disk answers after all
    io.wait_idle()
    assert io.shutdown(10)
    assert bytes(slot) == b"\0" * CHUNK and io.finished() == []


def test_a_chunk_that_fails_to_read_is_left_out_and_the_others_are_copied() -> None:
    def read(key: bytes, into: memoryview) -> bool:
        into[:] = key * CHUNK
        return key != b"b"  # b is corrupt: the store quarantined it, a miss

    io = make_io(read, lambda chunks: set())
    slots = [memoryview(bytearray(CHUNK)) for _ in range(3)]
    io.submit_load(1, [b"a", b"b", b"c"], slots)
    [done] = wait_done(io, 1)
    assert done.ok_keys == [b"a", b"c"]
    assert [bytes(s) for s in slots] == [b"a" * CHUNK, b"\0" * CHUNK, b"c" * CHUNK]
    assert io.shutdown(10)


def test_a_chunk_vllm_touched_outlives_an_untouched_newer_one(store_root: Path) -> None:
    namespace = namespace_of({"model": "m"})
    with Store.open(store_root, create=True, clock=StepClock(step=60.0)) as store:
        for key in (b"old", b"newer"):
            store.put(kind=KIND, namespace=namespace, key=entry_key(key),
                      objects={OBJECT: key * 10_000})
        toucher = Toucher(touch_in(store, namespace))
        toucher.add([b"old", b"never-stored"])  # vLLM touches chunks of other tiers too
        assert toucher.wait_idle(30) and toucher.shutdown(30)
        store.set_max_bytes(store.totals().bytes - 1)  # room for one of the two
        store.enforce_capacity()
        assert store.live_keys(KIND, namespace) == {entry_key(b"old")}


class TierABC(ABC):
    """A stand-in for vLLM's SecondaryTierManager: one required hook, one optional."""

    @abstractmethod
    def lookup(self, key, req_context): ...

    def touch(self, keys, req_context):
        return


class ATier(TierABC):
    def lookup(self, key, req_context):
        return True

    def touch(self, keys, req_context, **unused):
        return


class WithNewRequiredMethod(TierABC):
    @abstractmethod
    def reserve(self, keys): ...


class WithChangedHook(TierABC):
    def touch(self, keys, req_context, priority):
        return


def test_a_tier_api_that_changed_is_refused_naming_the_vllm_version() -> None:
    hooks = ("lookup", "touch")
    check_tier_api(TierABC, ATier, "0.32.0", hooks)
    for base, named in ((WithNewRequiredMethod, "reserve()"), (WithChangedHook, "touch()")):
        with pytest.raises(ConfigError) as exc:
            check_tier_api(base, ATier, "0.99.0", hooks)
        assert "vLLM 0.99.0" in one_line(exc) and named in one_line(exc)
    with pytest.raises(ConfigError, match="no touch_all"):
        check_tier_api(TierABC, ATier, "0.99.0", (*hooks, "touch_all"))


def test_a_lookup_on_a_hung_disk_is_a_miss_and_later_ones_do_not_queue_behind_it() -> None:
    disk = threading.Event()
    calls: list[str] = []

    def query(name: str):
        def run() -> set[str]:
            calls.append(name)
            disk.wait()
            return {name}
        return run

    bounded = BoundedCall(0.2, "test_lookup")
    assert bounded(query("a"), set()) == set()  # past its deadline: a miss
    assert bounded.stuck
    assert bounded(query("b"), set()) == set() and calls == ["a"]  # not queued behind it
    disk.set()  # the disk answers again
    assert wait_for(lambda: not bounded.stuck)
    assert bounded(query("c"), set()) == {"c"}
    bounded.close()


def wait_for(cond, seconds: float = 30.0) -> bool:
    until = time.monotonic() + seconds
    while not cond() and time.monotonic() < until:
        time.sleep(0.01)
    return cond()


def test_promoted_keys_are_touched_once_loads_are_done() -> None:
    touched: list[list[bytes]] = []

    def read(key: bytes, into: memoryview) -> bool:
        into[:] = key * CHUNK
        return key != b"b"

    io = TierIO(read=read, write=lambda chunks: set(), chunk_bytes=CHUNK, read_threads=2,
                write_threads=1, queue_depth=2, read_deadline=30.0, after_load=touched.append)
    slots = [memoryview(bytearray(CHUNK)) for _ in range(3)]
    io.submit_load(1, [b"a", b"b", b"c"], slots)
    [done] = wait_done(io, 1)
    assert done.ok_keys == [b"a", b"c"]
    assert io.shutdown(10)  # keys still waiting for quiet loads are touched before stopping
    assert sorted(k for keys in touched for k in keys) == [b"a", b"c"]


def test_a_promotion_is_found_once_per_read_thread_then_read_chunk_by_chunk() -> None:
    finds: list[list[bytes]] = []
    lock = threading.Lock()

    def find(keys):
        with lock:
            finds.append(list(keys))

        def reader(key: bytes):
            def read(into: memoryview) -> bool:
                into[:] = key * CHUNK
                return True
            return read
        return [None if k in (b"b", b"e") else reader(k) for k in keys]

    io = TierIO(find=find, write=lambda chunks: set(), chunk_bytes=CHUNK, read_threads=2,
                write_threads=1, queue_depth=2, read_deadline=30.0)
    keys = [b"a", b"b", b"c", b"d", b"e", b"f"]
    slots = [memoryview(bytearray(CHUNK)) for _ in keys]
    io.submit_load(1, keys, slots)
    [done] = wait_done(io, 1)
    assert done.ok_keys == [b"a", b"c", b"d", b"f"]
    assert sorted(map(sorted, finds)) == [[b"a", b"c", b"e"], [b"b", b"d", b"f"]]
    assert [bytes(s[:1]) for s in slots] == [b"a", b"\0", b"c", b"d", b"\0", b"f"]
    assert io.shutdown(10)


def test_a_failing_find_is_a_miss_of_its_slice_not_a_crash() -> None:
    def find(keys):
        raise OSError("the catalog is gone")

    io = TierIO(find=find, write=lambda chunks: set(), chunk_bytes=CHUNK, read_threads=2,
                write_threads=1, queue_depth=2, read_deadline=30.0)
    io.submit_load(1, [b"a", b"b", b"c"], [memoryview(bytearray(CHUNK)) for _ in range(3)])
    [done] = wait_done(io, 1)
    assert done.ok_keys == [] and done.keys == [b"a", b"b", b"c"]
    assert io.shutdown(10)
