"""Corruption beyond the single-case tests of test_store_verify.py: the scrub progress
database, swapped object files, and a seeded campaign of random damage (bit flips, zeroed
pages, truncation) over objects and manifests with a 100% detection count."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from spoolctl.store import CorruptionError, Store
from spoolctl.store.maintain.scrub import SCRUB_DB, Scrubber, ScrubState

TRIALS = 200


def _put(store: Store, key: str, size: int = 3000, seed: int = 0) -> str:
    data = random.Random(f"{key}/{seed}").randbytes(size)
    return store.put(kind="pytorch", namespace="ns", key=key, objects={"kv": data}).entry_id


def _cli(*argv: str) -> int:
    from spoolctl.cli.app import main

    try:
        main(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def _scrub_cli(root: Path) -> int:
    return _cli("scrub", "--root", str(root), "--rate", "0", "--until-complete", "--json")


def _damage_db(path: Path, mode: str, rng: random.Random) -> None:
    raw = bytearray(path.read_bytes())
    if mode == "garbage":
        raw = bytearray(rng.randbytes(len(raw)))
    elif mode == "truncate":
        raw = raw[:1000]  # inside the first page
    elif mode == "header_flip":
        raw[rng.randrange(0, 16)] ^= 0xFF
    elif mode == "zero_page":
        raw[4096:8192] = bytes(4096)
    elif mode == "page_flip":
        # the b-tree cell area of the first table page: a flip here corrupts the structure
        raw[4096 + 8] ^= 0x07
        raw[len(raw) // 2 + 100] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("mode", ["garbage", "truncate", "header_flip", "zero_page",
                                  "page_flip"])
def test_corrupt_scrub_database_is_quarantined_and_reset(store: Store, mode: str) -> None:
    ids = [_put(store, f"k{i}") for i in range(6)]
    assert Scrubber(store).run(max_items=2).checked == 2  # a cycle in progress
    _damage_db(store.layout.state / SCRUB_DB, mode, random.Random(mode))
    # a bad entry too: the reset scrub must still find it
    bad = ids[4]
    obj = store.layout.object_path(store.manifest(bad).objects[0].digest)
    raw = bytearray(obj.read_bytes())
    raw[100] ^= 0x10
    obj.write_bytes(bytes(raw))
    assert _scrub_cli(store.root) == 1  # exit 1 = findings (the bad entry), not a crash
    reasons = sorted(i.reason for i in store.quarantine_items())
    assert reasons == ["payload_digest", "scrub_state"]
    state = ScrubState.of(store)
    try:
        last = state.last_finished()
        assert last is not None and state.current() is None
        assert last.checked == 5 and last.quarantined == 1  # every entry covered anew
        assert [f["entry_id"] for f in state.findings(last.cycle_id)] == [bad]
    finally:
        state.close()
    assert store.live(ids) == set(ids) - {bad}


def test_malformed_scrub_cursor_is_reset_not_trusted(store: Store) -> None:
    """A row that SQLite reads fine but that holds a bogus cursor (e.g. after a flip in a
    value) must not make the scrub skip entries."""
    ids = [_put(store, f"k{i}") for i in range(4)]
    Scrubber(store).run(max_items=1)
    db = sqlite3.connect(str(store.layout.state / SCRUB_DB))
    db.execute("UPDATE cycles SET cursor='zzzz' || cursor WHERE finished IS NULL")
    db.commit()
    db.close()
    report = Scrubber(store).run(until_complete=True)
    assert report.cycle_completed and not report.resumed and report.checked == 4
    assert [i.reason for i in store.quarantine_items()] == ["scrub_state"]
    assert store.live(ids) == set(ids)


def test_status_survives_a_corrupt_scrub_database(store: Store, capsys) -> None:
    _put(store, "k")
    Scrubber(store).run(until_complete=True)
    (store.layout.state / SCRUB_DB).write_bytes(b"not a database at all" * 100)
    assert _cli("status", "--root", str(store.root), "--json") == 0
    assert '"entries": 1' in capsys.readouterr().out


def test_swapped_object_files_are_both_detected(store: Store) -> None:
    a, b = _put(store, "a", seed=1), _put(store, "b", seed=2)
    pa = store.layout.object_path(store.manifest(a).objects[0].digest)
    pb = store.layout.object_path(store.manifest(b).objects[0].digest)
    da, db = pa.read_bytes(), pb.read_bytes()
    pa.write_bytes(db)
    pb.write_bytes(da)
    for entry_id in (a, b):
        with pytest.raises(CorruptionError) as info:
            store.read_all(store.manifest(entry_id))
        assert info.value.reason.value == "payload_digest"
    assert store.live([a, b]) == set()
    assert sorted(i.entry_id for i in store.quarantine_items()) == sorted([a, b])


def test_swapped_manifest_files_are_both_detected(store: Store) -> None:
    a, b = _put(store, "a", seed=1), _put(store, "b", seed=2)
    pa, pb = store.layout.manifest_path(a), store.layout.manifest_path(b)
    ma, mb = pa.read_bytes(), pb.read_bytes()
    pa.write_bytes(mb)
    pb.write_bytes(ma)
    for entry_id in (a, b):
        with pytest.raises(CorruptionError):
            store.manifest(entry_id)
    assert store.live([a, b]) == set()


def _damage(path: Path, rng: random.Random) -> str:
    raw = bytearray(path.read_bytes())
    how = rng.choice(["flip", "flip", "flip", "zero_page", "truncate", "extend"])
    if how == "flip":
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    elif how == "zero_page":
        start = rng.randrange(len(raw))
        end = min(len(raw), start + 4096)
        if not any(raw[start:end]):
            raw[start] = 1  # a page already zero would be no damage
        else:
            raw[start:end] = bytes(end - start)
    elif how == "truncate":
        raw = raw[: rng.randrange(len(raw))]
    else:
        raw += b"\0"
    path.write_bytes(bytes(raw))
    return how


def test_random_damage_campaign_is_always_detected(store_root: Path) -> None:
    """TRIALS seeded random damages, each to an object or a manifest of a fresh entry:
    every one is detected on the next read, quarantined, and the entry becomes a miss;
    the undamaged bystander is never touched."""
    rng = random.Random(20261129)
    detected, kinds, wrong = 0, {}, []
    with Store.open(store_root, create=True) as store:
        bystander = _put(store, "bystander", size=5000)
        for trial in range(TRIALS):
            key = f"t{trial}"
            entry_id = store.put(kind="pytorch", namespace="ns", key=key, objects={
                "kv": rng.randbytes(rng.randrange(1, 9000)),
                "meta": rng.randbytes(rng.randrange(1, 300))}).entry_id
            manifest = store.manifest(entry_id)
            target = rng.choice(["manifest", "kv", "meta"])
            path = store.layout.manifest_path(entry_id) if target == "manifest" else \
                store.layout.object_path(manifest.object(target).digest)
            how = _damage(path, rng)
            kinds[f"{target}/{how}"] = kinds.get(f"{target}/{how}", 0) + 1
            got = None
            try:
                hit = store.lookup("pytorch", "ns", key)  # a bad manifest is a miss here
                if hit is not None:
                    got = store.read_all(hit)
            except CorruptionError:
                pass
            assert got is None, f"trial {trial}: damaged bytes handed out ({target}/{how})"
            assert store.lookup("pytorch", "ns", key) is None, f"trial {trial} {target}/{how}"
            items = {i.entry_id: i.reason for i in store.quarantine_items()}
            want = ("manifest_validation", "manifest_io") if target == "manifest" else \
                ("payload_size",) if how in ("truncate", "extend") else ("payload_digest",)
            if items.get(entry_id) in want:
                detected += 1
            else:
                wrong.append((trial, target, how, items.get(entry_id)))
        assert len(store.quarantine_items()) == TRIALS
        assert store.read_all(store.manifest(bystander))  # still verifies
        assert [r.entry_id for r in store.entries()] == [bystander]
    assert wrong == []
    assert detected == TRIALS, (detected, kinds)
