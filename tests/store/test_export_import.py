"""``spoolctl export`` / ``import`` with real stores, files, pipes and the console script:
identical entries after a round trip, a listable tar, skipping what is present, filters and
budgets, capacity, peer roots read without being touched, vLLM rank layouts and deployment
routing, crashes and disk errors mid-import."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest
from faultseam import CRASH_EXIT_CODE
from transfer_support import (
    ENV,
    SPOOLCTL,
    cli,
    cli_json,
    files_under,
    fill,
    payload,
    snapshot,
    tmp_files,
)

from spoolctl.store import Store

D1 = "vllm-v1-" + "1" * 48
D2 = "vllm-v1-" + "2" * 48


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return Path(os.path.realpath(tmp_path))


def test_round_trip_through_a_file_is_identical_and_listable_by_tar(base: Path):
    a, b, archive = base / "a", base / "b", base / "a.tar"
    fill(a, 12)
    doc = cli_json("export", "--root", str(a), "-o", str(archive))
    assert (doc["entries"], doc["objects"]) == (12, 13)  # the shared object once
    proc = subprocess.run(["tar", "-tvf", str(archive)], capture_output=True, text=True,
                          check=True)
    names = [line.split()[-1] for line in proc.stdout.splitlines()]
    assert names[0] == "spoolctl-archive.json" and names[-1] == "spoolctl-archive-end.json"
    assert sum(n.startswith("objects/") for n in names) == 13
    assert sum(n.startswith("manifests/") for n in names) == 12
    assert all(line.startswith("-rw-------") for line in proc.stdout.splitlines())
    got = cli_json("import", "--root", str(b), str(archive))
    assert (got["complete"], got["imported"], got["objects_written"]) == (True, 12, 13)
    assert snapshot(b) == snapshot(a)  # manifest bytes, payloads, kind/ns/key/hint/index
    assert cli("scrub", "--root", str(b)).returncode == 0
    assert tmp_files(b) == []


def test_pipe_between_two_processes_with_json_summaries(base: Path):
    a, b = base / "a", base / "b"
    fill(a, 8, size=300_000)
    proc = subprocess.run(f"'{SPOOLCTL}' export --root '{a}' --json | "
                          f"'{SPOOLCTL}' import --root '{b}' - --json",
                          shell=True, capture_output=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    exported = json.loads(proc.stderr)  # the archive owns stdout, so export reports on stderr
    imported = json.loads(proc.stdout)
    assert exported["entries"] == imported["imported"] == 8
    assert imported["source_bytes"] == exported["archive_bytes"]
    assert imported["bytes_written"] == exported["bytes"]
    assert snapshot(b) == snapshot(a)


def test_second_import_skips_present_entries_and_objects(base: Path):
    a, b, archive = base / "a", base / "b", base / "a.tar"
    fill(a, 10)
    cli_json("export", "--root", str(a), "-o", str(archive))
    cli_json("import", "--root", str(b), str(archive))
    again = cli_json("import", "--root", str(b), str(archive))
    assert (again["imported"], again["present"], again["bytes_written"]) == (0, 10, 0)
    with Store.open(b) as store:  # lose three entries, keep the shared object
        for row in store.entries(sort="id")[:3]:
            store.release(row.entry_id)
        store.clean_released()
    third = cli_json("import", "--root", str(b), str(archive))
    assert (third["imported"], third["present"]) == (3, 7)
    assert third["objects_written"] == 3 and third["objects_present"] == 8  # 7 + shared
    assert snapshot(b) == snapshot(a)


def test_export_filters_and_budget_take_the_most_recently_used(base: Path):
    a = base / "a"
    ids = fill(a, 6, size=10_000)  # committed in order: the last is the most recent
    fill(a, 2, kind="mlx", namespace="other", prefix="m")
    with Store.open(a) as store:
        store.release(ids[0])
    only = cli_json("export", "--root", str(a), "-o", str(base / "mlx.tar"), "--kind", "mlx")
    assert only["entries"] == 2 and only["left_out"]["filtered"] == 6
    rel = cli_json("export", "--root", str(a), "-o", str(base / "rel.tar"), "--hint", "release")
    assert rel["entries"] == 1
    with Store.open(a) as store:
        sizes = {r.entry_id: r.size for r in store.entries()}
    budget = sizes[ids[5]] + sizes[ids[4]] + 10
    doc = cli_json("export", "--root", str(a), "-o", str(base / "b.tar"), "--namespace",
                   "model-x", "--limit-size", str(budget))
    assert doc["entries"] == 2 and doc["left_out"]["over_budget"] == 3
    cli_json("import", "--root", str(base / "b"), str(base / "b.tar"))
    assert set(snapshot(base / "b")) == {ids[5], ids[4]}


def test_capacity_is_respected_and_an_oversized_archive_refused(base: Path):
    a, archive = base / "a", base / "a.tar"
    fill(a, 20, size=50_000, shared=False)
    cli_json("export", "--root", str(a), "-o", str(archive))
    small = base / "small"
    assert cli("init", "--root", str(small), "--max-size", "600000").returncode == 0
    proc = cli("import", "--root", str(small), str(archive))
    assert proc.returncode == 2 and b"more than its max size" in proc.stderr
    assert len(proc.stderr.decode().strip().splitlines()) == 1
    assert snapshot(small) == {} and tmp_files(small) == []
    roomy = base / "roomy"  # fits the archive, but not under its 90% low watermark
    with Store.open(a) as store:
        total = store.totals().bytes
    cli("init", "--root", str(roomy), "--max-size", str(int(total * 1.0)))
    doc = cli_json("import", "--root", str(roomy), str(archive))
    with Store.open(roomy) as store:
        assert store.totals().bytes <= int(store.max_bytes * 0.9)
    assert doc["skipped_capacity"] >= 1 and doc["imported"] + doc["skipped_capacity"] == 20
    newest = [r.entry_id for r in Store.open(a).entries(sort="access")][:doc["imported"]]
    assert set(snapshot(roomy)) == set(newest)  # what fits is the most recently used


def test_peer_root_is_only_read_and_its_defects_skipped(base: Path):
    a, b = base / "a", base / "b"
    ids = fill(a, 9, size=20_000)
    with Store.open(a) as store:  # one corrupt object, one missing object on the peer
        bad = store.layout.object_path(store.manifest(ids[2]).object("kv").digest)
        gone = store.layout.object_path(store.manifest(ids[3]).object("kv").digest)
    data = bytearray(bad.read_bytes())
    data[100] ^= 1
    bad.write_bytes(bytes(data))
    gone.unlink()
    before = files_under(a)
    doc = cli_json("import", "--root", str(b), str(a))
    assert files_under(a) == before  # nothing written, cleaned or locked on the peer
    assert (doc["imported"], doc["skipped_corrupt"], doc["skipped_vanished"]) == (7, 1, 1)
    assert set(snapshot(b)) == set(ids) - {ids[2], ids[3]}
    assert cli("scrub", "--root", str(b)).returncode == 0
    limited = cli_json("import", "--root", str(base / "c"), str(a), "--limit-size", "45000")
    assert limited["imported"] == 2  # newest first by manifest time, within the budget


def _connector_root(root: Path) -> dict[str, list[str]]:
    """A connector base root: deployment D1 with two ranks; chunks k0..k3 on both, k4 only on
    rank 0 (a chunk some rank lacks is a miss everywhere)."""
    keys = {}
    for rank, n in ((0, 5), (1, 4)):
        keys[rank] = fill(root / D1 / f"rank-{rank:04d}", n, kind="vllm",
                          namespace=f"vllm-v1-ns-rank{rank}", prefix="chunk", shared=False)
    return keys


def test_connector_layout_round_trip_keeps_whole_chunks_on_every_rank(base: Path):
    a, b = base / "a", base / "b"
    ids = _connector_root(a)
    archive = base / "a.tar"
    doc = cli_json("export", "--root", str(a), "-o", str(archive))
    assert doc["entries"] == 8 and doc["left_out"]["incomplete_chunks"] == 1
    got = cli_json("import", "--root", str(b), str(archive))
    assert got["imported"] == 8 and {p["place"] for p in got["stores"]} == \
        {f"{D1}/rank-0000", f"{D1}/rank-0001"}
    assert set(snapshot(b / D1 / "rank-0000")) == set(ids[0][:4])
    assert set(snapshot(b / D1 / "rank-0001")) == set(ids[1])
    status = cli_json("status", "--root", str(b / D1))
    assert status["agree"] and status["complete_chunks"] == 4
    # a single rank store exported by hand goes back to that rank only
    one = cli_json("export", "--root", str(a / D1 / "rank-0001"), "-o", str(base / "r1.tar"))
    assert one["stores"][0]["place"] == f"{D1}/rank-0001"


def test_chunks_of_another_deployment_are_refused_unless_named(base: Path):
    a, archive = base / "a", base / "a.tar"
    _connector_root(a)
    cli_json("export", "--root", str(a), "-o", str(archive))
    other = base / "other"
    fill(other / D2 / "rank-0000", 1, kind="vllm", namespace="vllm-v1-x")
    before = files_under(other)
    proc = cli("import", "--root", str(other), str(archive))
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "--deployment " + D1 in err and len(err.splitlines()) == 1
    assert files_under(other) == before  # refused before anything was written
    proc = cli("import", "--root", str(other / D2), str(archive))  # the D2 deployment dir
    assert proc.returncode == 2 and b"never hit by another" in proc.stderr
    proc = cli("import", "--root", str(other / D2 / "rank-0000"), str(archive))
    assert proc.returncode == 2 and b"spoolctl_root" in proc.stderr
    doc = cli_json("import", "--root", str(other), str(archive), "--deployment", D1[:14])
    assert doc["imported"] == 8 and (other / D1 / "rank-0001").is_dir()


# The import commits through the store's group commit: its checkpoints, mid-batch.
COMMIT_STEPS = ["manifest.tmp_written:5", "manifest.fsynced", "object.published:3",
                "object.dir_fsynced:2", "catalog.intent", "manifest.published:4",
                "manifest.dir_fsynced", "catalog.committed"]


@pytest.mark.parametrize("step", COMMIT_STEPS)
def test_crash_mid_import_leaves_only_complete_entries(base: Path, step: str):
    a, b, archive = base / "a", base / "b", base / "a.tar"
    fill(a, 10, size=30_000)
    cli_json("export", "--root", str(a), "-o", str(archive))
    proc = cli("import", "--root", str(b), str(archive), env={"SPOOLCTL_CRASH_AT": step})
    assert proc.returncode == CRASH_EXIT_CODE, proc.stderr.decode()
    expected = snapshot(a)
    with Store.open(b) as store:  # recovery: pending rows resolved, dead writer's tmp removed
        rows = store.entries(include_pending=True)
        assert all(r.state == "committed" for r in rows)
        for r in rows:  # every visible entry is complete and verifies
            store.verify(r.entry_id)
        assert tmp_files(b) == []
    visible = snapshot(b)
    assert all(visible[e] == expected[e] for e in visible)
    if step.startswith("manifest.published"):
        assert len(visible) == 4  # the four manifests renamed before the crash
    doc = cli_json("import", "--root", str(b), str(archive))
    assert doc["complete"] and snapshot(b) == expected
    assert cli("scrub", "--root", str(b)).returncode == 0


def test_disk_error_while_publishing_is_one_line_and_leaves_the_store_consistent(base: Path):
    a, b, archive = base / "a", base / "b", base / "a.tar"
    fill(a, 6)
    cli_json("export", "--root", str(a), "-o", str(archive))
    proc = cli("import", "--root", str(b), str(archive),
               env={"SPOOLCTL_FAIL_AT": "manifest.published:ENOSPC"})
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "No space left" in err and len(err.splitlines()) == 1
    with Store.open(b) as store:
        for r in store.entries(include_pending=True):
            store.verify(r.entry_id)
    assert tmp_files(b) == []
    assert cli_json("import", "--root", str(b), str(archive))["complete"]
    assert snapshot(b) == snapshot(a)


def test_export_leaves_out_a_corrupt_entry_and_quarantines_it(base: Path):
    a, archive = base / "a", base / "a.tar"
    ids = fill(a, 5)
    with Store.open(a) as store:
        path = store.layout.object_path(store.manifest(ids[1]).object("kv").digest)
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    doc = cli_json("export", "--root", str(a), "-o", str(archive))
    assert doc["entries"] == 4 and doc["left_out"]["corrupt"] == 1
    with Store.open(a) as store:
        assert [q.entry_id for q in store.quarantine_items()] == [ids[1]]
    got = cli_json("import", "--root", str(base / "b"), str(archive))
    assert got["imported"] == 4 and ids[1] not in snapshot(base / "b")


def test_large_objects_are_streamed_and_a_late_mismatch_stops_the_archive(base: Path,
                                                                          monkeypatch):
    from spoolctl.errors import ArchiveError, CorruptionError
    from spoolctl.store.disk import verify
    from spoolctl.store.transfer import exporter
    from spoolctl.store.transfer.archive import FdSink
    from spoolctl.store.transfer.importer import Importer

    monkeypatch.setattr(exporter, "ENTRY_BUFFER", 1000)
    monkeypatch.setattr(verify, "PIPE_CHUNK", 4096)  # several chunks per object
    a = base / "a"
    ids = fill(a, 3, size=50_000)
    with open(base / "a.tar", "wb") as f:
        report = exporter.export(a, FdSink(f.fileno()))
    assert report.entries == 3
    with open(base / "a.tar", "rb") as f:
        assert Importer(base / "b").from_archive(f).total("imported") == 3
    assert snapshot(base / "b") == snapshot(a)
    with Store.open(a) as store:
        path = store.layout.object_path(store.manifest(ids[0]).object("kv").digest)
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    path.write_bytes(bytes(data))
    with open(base / "bad.tar", "wb") as f, pytest.raises(CorruptionError, match="incomplete"):
        exporter.export(a, FdSink(f.fileno()))
    with open(base / "bad.tar", "rb") as f, \
            pytest.raises(ArchiveError, match="does not match its digest"):
        Importer(base / "c").from_archive(f)


def test_output_file_rules(base: Path):
    a = base / "a"
    fill(a, 2)
    out = base / "x.tar"
    out.write_text("keep me")
    proc = cli("export", "--root", str(a), "-o", str(out))
    assert proc.returncode == 2 and b"exists" in proc.stderr and out.read_text() == "keep me"
    assert cli("export", "--root", str(a), "-o", str(out), "--force").returncode == 0
    assert tarfile.is_tarfile(out)
    proc = cli("export", "--root", str(base / "missing"), "-o", str(base / "y.tar"))
    assert proc.returncode == 2 and sorted(p.name for p in base.iterdir()) == ["a", "x.tar"]
    fifo = base / "fifo"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    assert cli("export", "--root", str(a), "-o", str(fifo)).returncode == 0
    reader.join(30)
    got = cli_json("import", "--root", str(base / "b"), "-", stdin=received[0])
    assert got["imported"] == 2


def test_import_of_a_pipe_that_is_not_an_archive_is_one_line(base: Path):
    for data in (b"", b"hello world\n" * 100, os.urandom(5000), payload("x", 20_000)):
        proc = cli("import", "--root", str(base / "b"), "-", stdin=data)
        err = proc.stderr.decode()
        assert proc.returncode == 1 and err.startswith("error:") and len(err.splitlines()) == 1
        assert "Traceback" not in err
    assert not (base / "b").exists() or snapshot(base / "b") == {}
