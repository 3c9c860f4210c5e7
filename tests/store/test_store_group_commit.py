"""Group commit (``Store.put_many``): many entries durable with one round of flushes per
step, per-entry all-or-nothing, the same visibility rules as ``put``.

Crashes at every checkpoint of a batch: tests/store/test_store_crash.py (``group_commit``)."""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from pathlib import Path

import pytest

from spoolctl.store import (
    CapacityError,
    ConfigError,
    InvalidIdError,
    PutRequest,
    Store,
    StoreIOError,
    hash_bytes,
)


def _requests(n: int, size: int = 3000, ns: str = "batch") -> list[PutRequest]:
    return [PutRequest("vllm", ns, f"k{i}", {"kv": os.urandom(size), "ids": b"%d" % i})
            for i in range(n)]


def _record(store: Store) -> list[str]:
    seen: list[str] = []
    real = store.checkpoint
    store.checkpoint = lambda name: (seen.append(name), real(name))
    return seen


def test_a_batch_commits_every_entry_with_one_round_per_step(store: Store) -> None:
    requests = _requests(16)
    seen = _record(store)
    outcomes = store.put_many(requests)
    assert [o.status for o in outcomes] == ["committed"] * 16
    for r, o in zip(requests, outcomes, strict=True):
        hit = store.lookup("vllm", "batch", r.key)
        assert hit is not None and hit.entry_id == o.entry_id == o.manifest.entry_id
        assert bytes(store.read(hit, "kv")) == r.objects["kv"]
    counts = Counter(seen)
    # one catalog transaction for the intents and one for the commits, whatever the size
    assert counts["catalog.intent"] == 1 and counts["catalog.committed"] == 1
    # each directory is fsynced once per batch, not once per entry
    object_dirs = {store.layout.object_path(ref.digest).parent
                   for o in outcomes for ref in o.manifest.objects}
    manifest_dirs = {store.layout.manifest_path(o.entry_id).parent for o in outcomes}
    assert counts["object.dir_fsynced"] == len(object_dirs)
    assert counts["manifest.dir_fsynced"] == len(manifest_dirs)
    assert counts["object.published"] == 32 and counts["manifest.published"] == 16
    # manifest-last for the whole batch: no manifest renamed before every object dir synced
    first_manifest = seen.index("manifest.published")
    assert "object.dir_fsynced" not in seen[first_manifest:]
    assert seen.index("catalog.intent") < first_manifest
    assert list(store.layout.tmp.iterdir()) == []


def test_a_batch_syncs_its_directories_in_at_most_one_hand_off_per_flush_worker(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch touches a fan-out directory per entry or so (here ~40 per step); each is
    still fsynced, but through at most FLUSH_WORKERS hand-offs to the flush pool per step,
    each lane fsyncing its share in turn (decision 2950), not one hand-off per directory."""
    from spoolctl.store.commit import committer
    from spoolctl.store.disk.fsio import FLUSH_WORKERS

    synced: list[Path] = []
    real_fsync_dir = committer.fsync_dir
    monkeypatch.setattr(committer, "fsync_dir",
                        lambda d: (real_fsync_dir(d), synced.append(Path(d)))[0])
    handed: list[int] = []  # directories per hand-off
    real_submit = committer.flush_submit

    def counting(fn, *args):
        handed.append(len(args[0]) if args and isinstance(args[0], list) else 1)
        return real_submit(fn, *args)
    monkeypatch.setattr(committer, "flush_submit", counting)
    seen = _record(store)
    outcomes = store.put_many([PutRequest("vllm", "lanes", f"k{i}", {"kv": b"%d" % i})
                               for i in range(48)])
    assert [o.status for o in outcomes] == ["committed"] * 48
    object_dirs = {store.layout.object_path(o.manifest.objects[0].digest).parent
                   for o in outcomes}
    manifest_dirs = {store.layout.manifest_path(o.entry_id).parent for o in outcomes}
    assert len(object_dirs) > FLUSH_WORKERS and len(manifest_dirs) > FLUSH_WORKERS
    # every directory fsynced exactly once, through at most FLUSH_WORKERS hand-offs a step
    assert sorted(synced) == sorted([*object_dirs, *manifest_dirs])
    assert len(handed) <= 2 * FLUSH_WORKERS and sum(handed) == len(synced)
    counts = Counter(seen)
    assert counts["object.dir_fsynced"] == len(object_dirs)
    assert counts["manifest.dir_fsynced"] == len(manifest_dirs)


def test_a_failed_directory_fsync_in_a_lane_fails_the_batch_invisibly(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lane fsyncs every directory of its share even after one fails; the batch then
    raises StoreIOError naming that directory, and no entry of it is visible."""
    from spoolctl.store.commit import committer

    tried: list[Path] = []
    real_fsync_dir = committer.fsync_dir
    bad: list[Path] = []

    def failing(d) -> None:
        tried.append(Path(d))
        if Path(d).parent.name == "objects" and not bad:
            bad.append(Path(d))
            raise OSError(5, "Input/output error")
        real_fsync_dir(d)
    monkeypatch.setattr(committer, "fsync_dir", failing)
    requests = [PutRequest("vllm", "lanes", f"k{i}", {"kv": b"%d" % i}) for i in range(40)]
    with pytest.raises(StoreIOError) as info:
        store.put_many(requests)
    assert str(bad[0]) in str(info.value)
    object_dirs = {store.layout.object_path(hash_bytes(r.objects["kv"])).parent
                   for r in requests}
    assert sorted(tried) == sorted(object_dirs)  # every one tried; no manifest step began
    for r in requests:
        assert store.lookup("vllm", "lanes", r.key) is None


def test_a_bad_entry_is_refused_alone_and_never_visible(store_root: Path) -> None:
    def broken_stream():
        yield b"x" * 5000
        yield "not bytes"

    with Store.open(store_root, create=True, max_bytes=1 << 20) as store:
        good = _requests(4)
        requests = [good[0],
                    PutRequest("vllm", "batch", "bad-stream", {"kv": broken_stream()}),
                    good[1],
                    PutRequest("vllm", "bad namespace!", "k", {"kv": b"x"}),
                    PutRequest("vllm", "batch", "too-big", {"kv": os.urandom(950_000)}),
                    PutRequest("vllm", "batch", "bad-meta", {"kv": b"x"}, meta={"x": {1, 2}}),
                    good[2], good[3]]
        outcomes = store.put_many(requests)
        statuses = [o.status for o in outcomes]
        assert statuses == ["committed", "failed", "committed", "failed", "failed", "failed",
                            "committed", "committed"]
        assert isinstance(outcomes[1].error, ConfigError)
        assert isinstance(outcomes[3].error, InvalidIdError)
        assert isinstance(outcomes[4].error, CapacityError)
        assert isinstance(outcomes[5].error, ConfigError)
        for key in ("bad-stream", "too-big", "bad-meta"):
            assert store.lookup("vllm", "batch", key) is None
        assert {r.key for r in store.entries()} == {r.key for r in good}
        assert list(store.layout.tmp.iterdir()) == []  # nothing of the failures left
        # the failed stream's bytes are not even an orphan: they never left tmp/
        referenced = {ref.digest for r in store.entries()
                      for ref in store.manifest(r.entry_id).objects}
        on_disk = {p.name[:-4] for p in store.layout.objects.rglob("*.obj")}
        assert on_disk == referenced


def test_an_entry_failing_after_its_intent_leaves_no_pending_row(store: Store) -> None:
    """The intents are recorded while the flushes run (decision 1404): an entry whose flush
    then fails is refused alone, and its pending row goes at once (not only at the next
    open), so it pins no object and hides nothing from status."""
    real = store.checkpoint
    passes = Counter()

    def failing(name: str) -> None:
        passes[name] += 1
        if name == "object.fsynced" and passes[name] == 3:  # the second entry's first object
            raise OSError(5, "Input/output error")
        real(name)
    store.checkpoint = failing
    requests = _requests(4)
    outcomes = store.put_many(requests)
    assert passes["catalog.intent"] == 1
    assert [o.status for o in outcomes] == ["committed", "failed", "committed", "committed"]
    assert isinstance(outcomes[1].error, StoreIOError)
    rows = store.entries(include_pending=True)
    assert sorted(r.key for r in rows) == ["k0", "k2", "k3"]
    assert all(r.state == "committed" for r in rows)
    assert store.lookup("vllm", "batch", "k1") is None
    assert list(store.layout.tmp.iterdir()) == []
    store.checkpoint = real
    (again,) = store.put_many([requests[1]])  # and it commits on a retry
    assert again.status == "committed"
    assert bytes(store.read(again.manifest, "kv")) == requests[1].objects["kv"]


def test_a_batch_creates_its_files_ahead_and_bounded(store_root: Path) -> None:
    """A batch creates its temp files together before their flushes start (decision 1408),
    at most MAX_FLUSHING ahead (a 100-entry import must not run out of descriptors), and
    leaves none behind, also those of an entry refused after they were created."""
    from spoolctl.store.commit.committer import MAX_FLUSHING

    store = Store.open(store_root, create=True, max_bytes=4 << 20)
    fd_dir = Path("/proc/self/fd")

    def store_fds() -> int:
        # this store's descriptors only: threads of earlier tests in this worker open their own
        count = 0
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                count += os.readlink(fd).startswith(str(store_root))
        return count

    baseline = store_fds()
    in_tmp: list[int] = []
    fds: list[int] = []
    real = store.checkpoint

    def watching(name: str) -> None:
        if name == "object.tmp_written":
            in_tmp.append(len(list(store.layout.tmp.iterdir())))
            fds.append(store_fds())
        real(name)
    store.checkpoint = watching
    requests = _requests(100, size=2000)  # 300 files: objects "kv" and "ids", a manifest
    requests[50] = PutRequest("vllm", "batch", "too-big",
                              {"kv": os.urandom(4 << 20)})
    outcomes = store.put_many(requests)
    assert [o.status for o in outcomes].count("committed") == 99
    assert isinstance(outcomes[50].error, CapacityError)
    # the first file written found the first MAX_FLUSHING of the batch created already
    assert in_tmp[0] == MAX_FLUSHING
    # descriptors: created ahead plus flushing, each at most MAX_FLUSHING (and a few more
    # for the catalog and the flush threads' own work)
    assert max(fds) - baseline <= 2 * MAX_FLUSHING + 8
    assert list(store.layout.tmp.iterdir()) == []
    for r in requests[:3]:
        hit = store.lookup("vllm", "batch", r.key)
        assert hit is not None and bytes(store.read(hit, "kv")) == r.objects["kv"]
    store.close()


def test_repeated_keys_and_present_entries(store: Store) -> None:
    first = store.put(kind="vllm", namespace="batch", key="old", objects={"kv": b"old"})
    store.release(first.entry_id)
    outcomes = store.put_many([
        PutRequest("vllm", "batch", "new", {"kv": b"one"}),
        PutRequest("vllm", "batch", "new", {"kv": b"other bytes"}),  # a key names one content
        PutRequest("vllm", "batch", "old", {"kv": b"old"}),
    ])
    assert [o.status for o in outcomes] == ["committed", "present", "present"]
    assert outcomes[1].manifest == outcomes[0].manifest
    assert bytes(store.read(store.lookup("vllm", "batch", "new"), "kv")) == b"one"
    assert store.row(first.entry_id).hint == "retain"  # revived, as put does


def test_supersedes_inside_a_batch_and_shared_objects(store: Store) -> None:
    blob = os.urandom(40_000)
    base = store.put(kind="pytorch", namespace="ns", key="base", objects={"kv": blob})
    outcomes = store.put_many([
        PutRequest("pytorch", "ns", "grown", {"kv": blob, "more": b"tail"},
                   supersedes=base.entry_id),
        PutRequest("pytorch", "ns", "copy", {"kv": blob}),
    ])
    assert all(o.status == "committed" for o in outcomes)
    assert store.row(base.entry_id).hint == "release"
    assert store.totals().objects == 2  # blob stored once for three entries
    assert len(list(store.layout.objects.rglob("*.obj"))) == 2


def test_the_directory_of_a_reused_object_is_synced_before_the_manifest(store: Store) -> None:
    """A manifest may only name objects whose names are durable: an object this batch finds
    in place (another commit may have renamed it in without syncing yet) has its directory
    synced like the batch's own."""
    blob = os.urandom(10_000)
    a = store.put(kind="vllm", namespace="ns", key="a", objects={"kv": blob})
    seen = _record(store)
    (b,) = store.put_many([PutRequest("vllm", "ns", "b", {"kv": blob})])
    assert b.status == "committed" and b.manifest.objects[0].digest == a.objects[0].digest
    assert "object.published" not in seen  # reused, not written again
    assert seen.count("object.dir_fsynced") == 1
    assert seen.index("object.dir_fsynced") < seen.index("manifest.published")


@pytest.mark.parametrize("point", ["object.dir_fsynced", "catalog.intent",
                                   "manifest.published", "manifest.dir_fsynced"])
def test_a_shared_step_that_fails_raises_and_leaves_entries_whole_or_absent(
        store_root: Path, point: str) -> None:
    store = Store.open(store_root, create=True)
    real = store.checkpoint

    def failing(name: str) -> None:
        if name == point:
            raise OSError(5, "Input/output error")
        real(name)
    store.checkpoint = failing
    requests = _requests(6)
    with pytest.raises(StoreIOError, match="Input/output error"):
        store.put_many(requests)
    store.close()
    with Store.open(store_root) as store:  # recovery resolves the interrupted batch
        rows = store.entries(include_pending=True)
        assert all(r.state == "committed" for r in rows)
        for r in rows:
            store.verify(r.entry_id)
        if point in ("object.dir_fsynced", "catalog.intent"):
            assert rows == []  # failed before any manifest was renamed
        store.collect_orphans(min_age=0)
        assert list(store.layout.tmp.iterdir()) == []
        outcomes = store.put_many(requests)  # and the batch goes through afterwards
        assert {o.status for o in outcomes} <= {"committed", "present"}
        assert len(store.entries()) == 6


def test_commit_time_eviction_runs_once_after_the_batch(store_root: Path) -> None:
    with Store.open(store_root, create=True, max_bytes=200_000) as store:
        old = store.put_many(_requests(4, 20_000, ns="old"))
        seen = _record(store)
        store.put_many(_requests(6, 20_000, ns="new"))
        assert store.totals().bytes <= 200_000
        assert all(store.lookup("vllm", "new", f"k{i}") for i in range(6))
        assert sum(store.lookup("vllm", "old", f"k{i}") is not None for i in range(4)) < 4
        evicted = [n for n in seen if n == "evict.manifest_deleted"]
        assert evicted and seen.index("evict.manifest_deleted") > seen.index("catalog.committed")
        assert all(o.status == "committed" for o in old)


def test_put_many_on_a_read_only_store_and_wrong_items(store_root: Path) -> None:
    Store.open(store_root, create=True).close()
    with Store.open(store_root) as store:
        (o,) = store.put_many([{"kind": "vllm"}])  # not a PutRequest
        assert o.status == "failed" and isinstance(o.error, ConfigError)
    from spoolctl.store import ReadOnlyError

    with Store.open(store_root, read_only=True) as store, pytest.raises(ReadOnlyError):
        store.put_many(_requests(1))


def test_a_batch_committed_at_interpreter_exit(store_root: Path) -> None:
    """At exit ``concurrent.futures`` refuses new work before ``atexit`` handlers run (vLLM's
    shutdown, a controller's close): a batch committed then flushes on the calling thread."""
    import subprocess
    import sys

    script = (
        "import atexit, os, sys\n"
        "from spoolctl.store import PutRequest, Store\n"
        "s = Store.open(sys.argv[1], create=True)\n"
        "def at_exit():\n"
        "    out = s.put_many([PutRequest('vllm', 'exit', f'k{i}', {'kv': os.urandom(9000)})\n"
        "                      for i in range(6)])\n"
        "    print(','.join(o.status for o in out), flush=True)\n"
        "atexit.register(at_exit)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(store_root)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ",".join(["committed"] * 6), proc.stderr
    with Store.open(store_root) as s:
        assert len(s.live_keys("vllm", "exit")) == 6
        for row in s.entries(namespace="exit"):
            s.verify(row.entry_id)
