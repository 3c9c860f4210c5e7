"""Scrubber, request-auth queue and background maintainer, in process on real stores."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from waiting import wait_until

from spoolctl.store import BusyError, Store
from spoolctl.store.disk.locks import try_hold
from spoolctl.store.maintain.auth_requests import AuthQueue, authenticate, process_pending
from spoolctl.store.maintain.maintainer import BackgroundMaintainer
from spoolctl.store.maintain.scrub import RateLimiter, Scrubber, ScrubState

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)


def _put(store: Store, n: int, size: int = 2048, ns: str = "m") -> list[str]:
    return [store.put(kind="pytorch", namespace=ns, key=f"k{i}",
                      objects={"kv": os.urandom(size)}).entry_id for i in range(n)]


def _flip(store: Store, entry_id: str) -> None:
    path = store.layout.object_path(store.manifest(entry_id).objects[0].digest)
    data = bytearray(path.read_bytes())
    data[7] ^= 0xFF
    path.write_bytes(bytes(data))


def test_rate_limiter_paces_to_rate() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    limiter = RateLimiter(1 << 20, clock=lambda: now[0], sleep=sleep)
    for _ in range(40):
        limiter.consume(256 << 10)  # 10 MiB at 1 MiB/s
    assert 9.0 <= now[0] <= 10.0
    unlimited = RateLimiter(None, clock=lambda: 0.0, sleep=sleep)
    n = len(slept)
    unlimited.consume(1 << 30)
    assert len(slept) == n


def test_bounded_runs_resume_the_same_cycle(store: Store) -> None:
    _put(store, 10)
    first = Scrubber(store).run(max_items=3)
    assert first.checked == 3 and not first.cycle_completed and not first.resumed
    second = Scrubber(store).run(max_items=3)
    assert second.resumed and second.cycle_id == first.cycle_id and second.checked == 3
    rest = Scrubber(store).run(until_complete=True)
    assert rest.checked == 4 and rest.cycle_completed
    state = ScrubState.of(store)
    try:
        last = state.last_finished()
        assert last.checked == 10 and last.quarantined == 0 and state.current() is None
    finally:
        state.close()
    nxt = Scrubber(store).run(max_items=1)
    assert nxt.cycle_id == first.cycle_id + 1 and not nxt.resumed


def test_scrub_finds_each_kind_of_damage(store: Store) -> None:
    ids = _put(store, 4)
    _flip(store, ids[0])
    manifest = store.layout.manifest_path(ids[1])
    manifest.write_bytes(manifest.read_bytes().replace(b'"size":2048', b'"size":2049'))
    store.layout.object_path(store.manifest(ids[2]).objects[0].digest).unlink()
    report = Scrubber(store).run(until_complete=True)
    found = {q["entry_id"]: q["reason"] for q in report.quarantined}
    assert found == {ids[0]: "payload_digest", ids[1]: "manifest_validation",
                     ids[2]: "payload_missing"}
    assert report.checked == 1
    assert {i.entry_id: i.reason for i in store.quarantine_items()} == found
    assert store.live(ids) == {ids[3]}


def test_cycle_end_reclaims_only_orphans_older_than_the_cycle(store: Store) -> None:
    _put(store, 3)
    Scrubber(store).run(max_items=1)  # the cycle starts now
    old, young = store.layout.object_path("a" * 64), store.layout.object_path("b" * 64)
    old.write_bytes(b"old orphan")
    t = time.time() - 600
    os.utime(old, (t, t))
    young.write_bytes(b"young orphan")
    report = Scrubber(store).run(until_complete=True)
    assert report.cycle_completed and report.orphans["objects"] == 1
    assert not old.exists() and young.exists()


def test_one_scrubber_at_a_time(store: Store) -> None:
    _put(store, 2)
    with try_hold(store.layout.state / "scrub.lock", exclusive=True) as held:
        assert held
        assert Scrubber(store).run(max_items=5) is None  # skipped, like the worker does
        store.lock_timeout = 0.2
        with pytest.raises(BusyError):
            Scrubber(store).run(max_items=5, wait=True)
    assert Scrubber(store).run(max_items=5, wait=True).checked == 2


def test_auth_queue_round_trip(store: Store) -> None:
    ids = _put(store, 2)
    _flip(store, ids[1])
    with AuthQueue.of(store) as queue:
        a, b, c = queue.submit(ids[0]), queue.submit(ids[1]), queue.submit("e" * 64)
        assert queue.wait(a, timeout=0.2) is None  # nobody answers yet
    assert process_pending(store) == 3
    assert process_pending(store) == 0  # a receipt is written once
    with AuthQueue.of(store) as queue:
        assert queue.receipt(a).result == "verified"
        got = queue.receipt(b)
        assert got.result == "quarantined" and got.reason == "payload_digest"
        assert queue.receipt(c).result == "absent"
    again = authenticate(store, ids[1])
    assert again.result == "quarantined" and again.reason == "payload_digest"


def test_maintainer_owner_scrubs_and_answers(store_root: Path) -> None:
    with Store.open(store_root, create=True) as store:
        ids = _put(store, 5)
        _flip(store, ids[3])
        with AuthQueue.of(store) as queue:
            request = queue.submit(ids[0])
        m = BackgroundMaintainer(store, interval_s=0.05, scrub_rate_bytes=1 << 30)
        m.start()
        m.start()  # idempotent
        try:
            assert m.owns_store and store.owner().role == "vllm-worker"
            wait_until(lambda: m.counters.scrub_cycles_completed >= 1, what="a scrub cycle")
            assert m.counters.quarantine_events["payload_digest"] == 1
            assert m.counters.scrubbed_entries >= 4
            with AuthQueue.of(store) as queue:
                assert queue.receipt(request).result == "verified"
        finally:
            m.stop()
            m.stop()
        assert not m.running and store.owner() is None
        assert m.counters.errors == {}


def test_maintainer_without_lease_still_enforces_capacity(store_root: Path) -> None:
    with Store.open(store_root, create=True) as owner_store, \
            Store.open(store_root) as other_store:
        _put(owner_store, 10, size=10_000)
        owner = owner_store.acquire_owner_lease("someone-else")
        assert owner is not None
        try:
            other_store.set_max_bytes(60_000)
            m = BackgroundMaintainer(other_store, interval_s=0.05)
            m.start()
            try:
                assert not m.owns_store
                wait_until(lambda: m.counters.evicted_entries > 0, what="an eviction")
            finally:
                m.stop()
            assert other_store.totals().bytes <= 60_000
            assert m.counters.scrubbed_entries == 0  # no scrub without the lease
            assert not (store_root / "state" / "scrub.sqlite3").exists()
        finally:
            owner.release()


def test_maintainer_contains_failures(store: Store) -> None:
    m = BackgroundMaintainer(store, interval_s=60)

    def broken(**_kw):
        raise RuntimeError("disk on fire")

    store.enforce_capacity = broken  # a failing step must be counted, never raised
    m.step()
    m.step()
    assert m.counters.errors["capacity"] == 2
    with pytest.raises(ValueError):
        BackgroundMaintainer(store, scrub_rate_bytes=0)
