"""Cross-host inventory protocol (``connector.inventory``) and a worker's ``RankHoldings``.

The protocol is what lets a scheduler count chunks held by ranks on other hosts:
bounded reports, epochs, sequence numbers with resync, and withdraw-before-delete.
The randomized test drives many ranks through lost reports, delayed metadata,
restarts and evictions and checks the safety rule a user relies on (no request is
ever planned against a chunk a rank already deleted by eviction) and that the
scheduler's view converges to what the ranks really hold.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from pathlib import Path

import pytest

from spoolctl.connector.planning.inventory import (
    Ack,
    InventoryReport,
    InventoryView,
    RankInventory,
    key_bytes,
)
from spoolctl.connector.worker_side.holdings import RankHoldings
from spoolctl.store import Store, entry_id_for


def k(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=32).digest()


def drain(inv: RankInventory, view: InventoryView, limit: int = 4) -> int:
    """Deliver reports until the worker has nothing more to say; return how many."""
    sent = 0
    while (report := inv.report(limit)) is not None:
        assert report.size <= limit
        view.apply(report)
        sent += 1
        if not report.size and not report.reset:
            break  # an empty heartbeat: nothing more to say
    return sent


def test_handshake_is_bounded_and_the_rest_follows_in_later_reports():
    inv = RankInventory(rank=3, epoch=7)
    inv.replace(k(i) for i in range(10))
    view = InventoryView()
    first = inv.report(4)
    assert first.reset and first.seq == 0 and first.size == 4
    view.apply(first)
    assert sum(view.has(3, [k(i) for i in range(10)])) == 4
    assert drain(inv, view) == 2
    assert view.has(3, [k(i) for i in range(10)]) == [True] * 10
    assert view.acks() == {3: Ack(7, 2)}
    assert inv.report(4) is None  # nothing changed: no report


def test_withdrawn_key_is_deletable_only_after_the_removal_was_acknowledged():
    inv, view = RankInventory(0, 1), InventoryView()
    inv.replace([k(1), k(2)])
    drain(inv, view)
    assert inv.withdraw(k(1)) is True  # the scheduler knows it: wait for the ack
    assert inv.acked(view.acks()[0]) == []  # an ack from before the removal: not yet
    report = inv.report(4)
    assert report.removed == (k(1),)
    view.apply(report)
    assert view.has(0, [k(1), k(2)]) == [False, True]
    assert inv.acked(Ack(2, report.seq)) == []  # another epoch's ack is ignored
    assert inv.acked(view.acks()[0]) == [k(1)]
    # A chunk the scheduler never heard of can go at once.
    inv.add(k(9))
    assert inv.withdraw(k(9)) is False


def test_recommit_during_withdrawal_keeps_the_entry():
    inv, view = RankInventory(0, 1), InventoryView()
    inv.replace([k(1)])
    drain(inv, view)
    assert inv.withdraw(k(1))
    view.apply(inv.report(4))
    inv.add(k(1))  # re-stored before the ack arrived
    assert inv.acked(view.acks()[0]) == []  # so it must not be deleted
    drain(inv, view)
    assert view.has(0, [k(1)]) == [True]


def test_withdrawal_after_an_unapplied_reset_waits_for_that_reset():
    """Found by the randomized test: after a (bounded) reset the worker no longer lists a
    key as told, but the scheduler still counts it until it applies the reset."""
    inv, view = RankInventory(0, 1), InventoryView()
    inv.replace([k(i) for i in range(6)])
    drain(inv, view, limit=8)
    inv.acked(view.acks()[0])
    inv.resync()
    reset = inv.report(2)  # restates only 2 of the 6 keys: the others are untold now
    victim = next(key for key in (k(i) for i in range(6)) if key not in reset.added)
    assert view.has(0, [victim]) == [True]  # the reset is not applied yet
    assert inv.withdraw(victim) is True  # so the victim must not be deleted yet
    view.apply(reset)
    assert view.has(0, [victim]) == [False]
    assert inv.acked(view.acks()[0]) == [victim]


def test_readded_key_withdrawn_again_waits_for_the_first_removal_ack():
    inv, view = RankInventory(0, 1), InventoryView()
    inv.replace([k(1)])
    drain(inv, view)
    inv.acked(view.acks()[0])
    assert inv.withdraw(k(1))
    lost = inv.report(4)  # carries the removal, and vLLM drops it
    assert lost.removed == (k(1),)
    inv.add(k(1))  # re-stored...
    assert inv.withdraw(k(1)) is True  # ...and evicted again: the scheduler still counts it
    assert view.has(0, [k(1)]) == [True]


def test_restarted_rank_replaces_everything_and_stale_reports_are_dropped():
    old, view = RankInventory(1, epoch=5), InventoryView()
    old.replace([k(1), k(2)])
    drain(old, view)
    old.add(k(3))
    stale = old.report(4)  # still in flight when the rank restarts
    new = RankInventory(1, epoch=6)
    new.replace([k(2)])  # the restarted rank lost k(1) (e.g. its disk was replaced)
    view.apply(new.report(4))
    view.apply(stale)
    assert view.has(1, [k(1), k(2), k(3)]) == [False, True, False]
    assert view.dropped == 1


def test_missed_handshake_or_gap_forgets_the_rank_until_it_restates():
    inv, view = RankInventory(2, epoch=4), InventoryView()
    inv.replace([k(1)])
    inv.report(4)  # the handshake is lost
    inv.add(k(2))
    view.apply(inv.report(4))  # seq 1, not a reset: the scheduler cannot trust it
    assert view.has(2, [k(1), k(2)]) == [False, False]
    assert view.resync_requests() == {2: 4}
    assert 2 not in view.acks()
    inv.resync()
    drain(inv, view)
    assert view.has(2, [k(1), k(2)]) == [True, True]
    assert view.resync_requests() == {}
    # A gap inside an epoch does the same.
    inv.add(k(3))
    inv.report(4)  # lost
    inv.add(k(4))
    view.apply(inv.report(4))
    assert view.has(2, [k(1)]) == [False] and view.resync_requests() == {2: 4}


def test_a_lost_last_report_is_noticed_through_a_heartbeat():
    inv, view = RankInventory(0, epoch=2), InventoryView()
    inv.replace([k(1)])
    drain(inv, view)
    assert inv.acked(view.acks()[0]) == []
    inv.add(k(2))
    inv.report(4)  # lost: nothing else will change, so no later report would reveal it
    beats = [inv.report(4) for _ in range(4)]
    assert beats[:3] == [None] * 3 and beats[3] is not None and beats[3].size == 0
    view.apply(beats[3])
    assert view.resync_requests() == {0: 2}
    inv.resync()
    drain(inv, view)
    assert view.has(0, [k(1), k(2)]) == [True, True]


def test_reports_reject_malformed_keys():
    with pytest.raises(ValueError):
        InventoryReport(0, 1, 0, added=(b"short",))
    with pytest.raises(ValueError):
        key_bytes("ab" * 10)


@pytest.mark.parametrize(("seed", "restart_p", "loss_p"),
                         [(s, 0.01, 0.1) for s in range(24)] + [(s, 0.05, 0.35) for s in range(12)])
def test_random_schedules_never_plan_against_an_evicted_chunk(seed: int, restart_p: float,
                                                              loss_p: float):
    """Set iteration order (hence which keys a bounded report carries first) follows
    PYTHONHASHSEED, so each run also explores different interleavings."""
    rng = random.Random(seed)
    ranks = 3
    universe = [k(i) for i in range(40)]
    view = InventoryView()
    epochs = dict.fromkeys(range(ranks), 1)
    invs = {r: RankInventory(r, 1) for r in range(ranks)}
    stores: dict[int, set[bytes]] = {r: set() for r in range(ranks)}
    evicted: dict[int, set[bytes]] = {r: set() for r in range(ranks)}  # deleted by withdrawal
    to_workers: deque = deque()  # (deliver_at, meta) in order, like vLLM's metadata
    to_scheduler: deque = deque()
    for r in range(ranks):
        view.apply(invs[r].report(64))
    quiet_from = 300
    for step in range(420):
        noisy = step < quiet_from
        # Workers: commits, external losses, withdrawals (evictions), restarts.
        for r in range(ranks):
            inv, store = invs[r], stores[r]
            if noisy and rng.random() < 0.6:
                key = rng.choice(universe)
                store.add(key)
                evicted[r].discard(key)
                inv.add(key)
            if noisy and store and rng.random() < 0.25:
                key = rng.choice(sorted(store))
                if inv.withdraw(key):
                    pass  # deleted when acknowledged
                else:
                    store.discard(key)
                    evicted[r].add(key)
            if noisy and rng.random() < restart_p:  # restart: new epoch, same disk
                epochs[r] += 1
                invs[r] = RankInventory(r, epochs[r])
                invs[r].replace(store)
                to_scheduler.append((step + 1, [invs[r].report(64)]))
        reports = [rep for r in range(ranks) if (rep := invs[r].report(3)) is not None]
        for inv in invs.values():  # the incremental bookkeeping matches its definition
            assert inv.consistent()
        lost = noisy and rng.random() < loss_p  # vLLM dropped this step's aggregated output
        if not lost:
            to_scheduler.append((step + rng.choice((1, 1, 2)), reports))
        # Scheduler: apply what arrived (in order), plan loads, send metadata.
        while to_scheduler and to_scheduler[0][0] <= step:
            for rep in to_scheduler.popleft()[1]:
                view.apply(rep)
        planned = [key for key in rng.sample(universe, 8)
                   if all(view.has(r, [key])[0] for r in range(ranks))]
        last_at = to_workers[-1][0] if to_workers else step
        to_workers.append((max(last_at, step + rng.choice((1, 2, 3))),
                           (planned, view.acks(), view.resync_requests())))
        # Workers: serve this step's metadata (loads first), then apply acks.
        while to_workers and to_workers[0][0] <= step:
            loads, acks, resync = to_workers.popleft()[1]
            for r in range(ranks):
                for key in loads:
                    assert key not in evicted[r], "planned against a chunk already evicted"
                inv = invs[r]
                if resync.get(r) == inv.epoch:
                    inv.resync()
                if r in acks:
                    for key in inv.acked(acks[r]):
                        stores[r].discard(key)
                        evicted[r].add(key)
    # Quiet: no more changes or losses; the view converges to what every rank holds.
    for r in range(ranks):
        held = [key in stores[r] for key in universe]
        assert view.has(r, universe) == held, f"rank {r} did not converge"


# -- RankHoldings on a real store -------------------------------------------------------------


def chunk_key(i: int) -> str:
    return k(i).hex()


def put(store: Store, ns: str, i: int, size: int = 4096) -> str:
    store.put(kind="vllm", namespace=ns, key=chunk_key(i), objects={"kv": bytes([i]) * size},
              evict=False)
    return entry_id_for("vllm", ns, chunk_key(i))


@pytest.fixture
def small_store(store_root: Path):
    with Store.open(store_root, create=True, max_bytes=40_000) as s:
        yield s


def test_holdings_withdraws_before_evicting_and_deletes_after_the_ack(small_store: Store):
    ns = "n" * 16
    ids = [put(small_store, ns, i) for i in range(6)]
    holdings = RankHoldings(small_store, kind="vllm", namespace=ns, rank=0,
                            epoch=small_store.next_generation("t"))
    holdings.rescan()
    view = InventoryView()
    view.apply(holdings.handshake_report())
    assert holdings.held_keys() == {chunk_key(i) for i in range(6)}
    for i in range(6, 12):  # 12 x 4 KiB > 40 kB: over capacity (commits did not evict)
        ids.append(put(small_store, ns, i))
        holdings.committed(chunk_key(i))
    while (rep := holdings.step_report()) is not None:
        view.apply(rep)
    assert small_store.totals().bytes > 40_000
    holdings.enforce_capacity()
    victims = [e for e in ids if small_store.row(e).hint == "release"]
    assert victims, "nothing was chosen for eviction"
    # Withdrawn (released: same-host lookups stop at once) but not deleted before the ack.
    assert all(small_store.row(e) is not None for e in victims)
    assert small_store.live(victims) == set()
    holdings.on_scheduler(view.acks(), {})  # the old ack does not cover the withdrawal
    holdings.delete_acknowledged()
    assert all(small_store.row(e) is not None for e in victims)
    view.apply(holdings.step_report())  # the withdrawal reaches the scheduler
    victim_keys = [small_store.row(e).key for e in victims]
    assert view.has(0, [key_bytes(x) for x in victim_keys]) == [False] * len(victims)
    holdings.on_scheduler(view.acks(), {})
    holdings.delete_acknowledged()
    assert all(small_store.row(e) is None for e in victims)
    assert small_store.totals().bytes <= 40_000
    assert holdings.evicted_entries == len(victims)


def test_holdings_rescan_withdraws_entries_deleted_behind_its_back(small_store: Store):
    ns = "m" * 16
    ids = [put(small_store, ns, i) for i in range(3)]
    holdings = RankHoldings(small_store, kind="vllm", namespace=ns, rank=1, epoch=1)
    holdings.rescan()
    view = InventoryView()
    view.apply(holdings.handshake_report())
    small_store.release(ids[0])
    small_store.delete_released([ids[0]])  # an operator's clean
    holdings.rescan()
    view.apply(holdings.step_report())
    assert view.has(1, [k(0), k(1), k(2)]) == [False, True, True]
    holdings.lost(chunk_key(1))  # a read failed verification
    view.apply(holdings.step_report())
    assert view.has(1, [k(1)]) == [False]


def test_generation_grows_across_calls_and_a_catalog_rebuild(store: Store, store_root: Path):
    first = store.next_generation("x")
    assert store.next_generation("x") == first + 1
    store.close()
    for f in (store_root / "state").glob("catalog.sqlite3*"):
        f.unlink()
    with Store.open(store_root) as again:
        assert again.next_generation("x") > first


def test_holdings_deletes_anyway_when_the_ack_never_comes(small_store: Store):
    """An engine that takes no steps never acknowledges: the store must stay bounded."""
    ns = "p" * 16
    now = [1000.0]
    holdings = RankHoldings(small_store, kind="vllm", namespace=ns, rank=0, epoch=1,
                            ack_timeout_s=300, clock=lambda: now[0])
    for i in range(6):
        put(small_store, ns, i)
    holdings.rescan()
    holdings.handshake_report()  # told: every withdrawal now needs an acknowledgement
    for i in range(6, 12):
        put(small_store, ns, i)
        holdings.committed(chunk_key(i))
    holdings.enforce_capacity()
    released = small_store.totals().bytes
    assert released > 40_000 and holdings.awaiting > 0  # withdrawn, waiting
    now[0] += 299
    holdings.enforce_capacity()
    assert small_store.totals().bytes == released  # still waiting
    now[0] += 2
    holdings.enforce_capacity()
    assert small_store.totals().bytes <= 40_000 and holdings.awaiting == 0
