"""Units of export/import: the archive grammar and tar framing, the index, selection
(newest first, budget, whole vLLM chunks across ranks) and routing of rank stores."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from spoolctl.errors import ArchiveError
from spoolctl.store import ConfigError, Store
from spoolctl.store.transfer.archive import (
    INDEX_NAME,
    ArchiveIndex,
    SectionCount,
    StoreSection,
    TarReader,
    TarWriter,
    end_record,
    manifest_member,
    object_member,
    parse_end_record,
    parse_member,
)
from spoolctl.store.transfer.places import Target, find_stores, inspect_root
from spoolctl.store.transfer.selection import Candidate, Selection, plan, resolve_deployments

D1 = "vllm-v1-" + "a" * 48
D2 = "vllm-v1-" + "b" * 48
HEX = "ab" + "0" * 62


# -- member grammar ------------------------------------------------------------------------


@pytest.mark.parametrize("name", [
    f"objects/ab/{HEX}.obj", f"manifests/ab/{HEX}.json",
    f"{D1}/rank-0003/objects/ab/{HEX}.obj", INDEX_NAME,
])
def test_member_grammar_accepts_what_export_writes(name):
    m = parse_member(name, 10)
    assert m.name == name


@pytest.mark.parametrize("name", [
    "../etc/passwd", "/etc/passwd", f"objects/ab/../../{HEX}.obj", f"./objects/ab/{HEX}.obj",
    f"objects/cd/{HEX}.obj",                      # fan-out does not match the digest
    f"objects/ab/{HEX.upper()}.obj", f"objects/ab/{HEX}.json",  # wrong case / extension
    f"manifests/ab/{HEX}.obj", f"{D1}/objects/ab/{HEX}.obj",   # place without a rank
    f"../rank-0000/objects/ab/{HEX}.obj", f"{D1}/rank-00001/objects/ab/{HEX}.obj",
    f"objects/ab/{HEX}.obj/", "objects\\ab\\x.obj", "", "spoolctl-archive.json.bak",
])
def test_member_grammar_refuses_anything_else(name):
    with pytest.raises(ArchiveError):
        parse_member(name, 1)


def test_member_sizes_are_bounded():
    with pytest.raises(ArchiveError, match="claims"):
        parse_member(f"manifests/ab/{HEX}.json", 64 << 20)
    with pytest.raises(ArchiveError, match="index"):
        parse_member(INDEX_NAME, 64 << 20)


def test_member_names_round_trip():
    assert parse_member(object_member(f"{D1}/rank-0001", HEX), 1).place == f"{D1}/rank-0001"
    m = parse_member(manifest_member("", HEX), 1)
    assert (m.area, m.hexid, m.place) == ("manifest", HEX, "")


# -- tar framing -----------------------------------------------------------------------------


def _write(members: list[tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    w = TarWriter(lambda bufs: out.write(b"".join(bytes(b) for b in bufs)))
    for name, data in members:
        w.add(name, data, 1_700_000_000)
    w.close()
    return out.getvalue()


def test_written_stream_is_a_standard_tar_with_long_names():
    long = f"{D1}/rank-0000/objects/ab/{HEX}.obj"  # > 100 characters: ustar prefix field
    raw = _write([(INDEX_NAME, b"{}"), (long, b"x" * 1000)])
    assert len(raw) % 10240 == 0
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        names = [(m.name, m.size, m.mode, m.type) for m in tf.getmembers()]
        assert tf.extractfile(long).read() == b"x" * 1000
    assert names == [(INDEX_NAME, 2, 0o600, tarfile.REGTYPE),
                     (long, 1000, 0o600, tarfile.REGTYPE)]
    reader = TarReader(io.BytesIO(raw))
    assert reader.next().area == "index"
    assert reader.read_all() == b"{}"
    m = reader.next()
    assert (m.name, m.size) == (long, 1000)
    assert reader.read_all() == b"x" * 1000
    assert reader.next() is None and reader.clean_eof


def _tar_with(info: tarfile.TarInfo, data: bytes = b"", fmt=tarfile.USTAR_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tf:
        tf.addfile(info, io.BytesIO(data) if data else None)
    return out.getvalue()


@pytest.mark.parametrize("kind,text", [
    (tarfile.SYMTYPE, "symbolic link"), (tarfile.LNKTYPE, "hard link"),
    (tarfile.DIRTYPE, "directory"), (tarfile.FIFOTYPE, "FIFO"), (tarfile.CHRTYPE, "device"),
])
def test_reader_refuses_links_and_special_files(kind, text):
    info = tarfile.TarInfo(f"objects/ab/{HEX}.obj")
    info.type = kind
    info.linkname = "/etc/passwd"
    with pytest.raises(ArchiveError, match=text):
        TarReader(io.BytesIO(_tar_with(info))).next()


def test_reader_refuses_pax_headers_and_gnu_long_names():
    info = tarfile.TarInfo("objects/ab/" + "x" * 300)
    info.size = 1
    for fmt in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        with pytest.raises(ArchiveError, match=r"pax|GNU"):
            TarReader(io.BytesIO(_tar_with(info, b"x", fmt))).next()


def test_reader_reports_truncation_and_bad_headers():
    raw = _write([(INDEX_NAME, b"{" + b" " * 2000 + b"}")])
    for cut in (100, 600, 1500):
        r = TarReader(io.BytesIO(raw[:cut]))
        with pytest.raises(ArchiveError, match="truncated"):
            r.next()
            r.read_all()
    bad = bytearray(raw)
    bad[10] ^= 0x20  # name byte: the header checksum no longer matches
    with pytest.raises(ArchiveError, match="invalid tar header"):
        TarReader(io.BytesIO(bytes(bad))).next()
    r = TarReader(io.BytesIO(raw[:512 + 2048]))  # whole member, no end marker: EOF
    r.next()
    r.read_all()
    assert r.next() is None and not r.clean_eof


def test_reader_refuses_data_after_the_end_marker():
    raw = _write([(INDEX_NAME, b"{}")]) + b"junk" * 10
    r = TarReader(io.BytesIO(raw))
    r.next()
    r.read_all()
    with pytest.raises(ArchiveError, match="after the end"):
        r.next()


# -- index and end record -----------------------------------------------------------------


def test_index_round_trip_and_validation():
    idx = ArchiveIndex(stores=(StoreSection(f"{D1}/rank-0000", 3, 300, kinds={"vllm": 3}),))
    back = ArchiveIndex.from_bytes(idx.to_bytes())
    assert back.stores == idx.stores and back.bytes == 300 and back.entries == 3
    bad_docs = [
        b"not json", b"[]", json.dumps({"schema": "other"}).encode(),
        json.dumps({"schema": "spoolctl-archive/v1", "stores": [{"place": "../x"}]}).encode(),
        json.dumps({"schema": "spoolctl-archive/v1", "stores": [
            {"place": "", "entries": -1, "bytes": 0}]}).encode(),
        json.dumps({"schema": "spoolctl-archive/v1", "stores": [
            {"place": "", "entries": 1, "bytes": 1, "kinds": {"evil": 1}}]}).encode(),
        json.dumps({"schema": "spoolctl-archive/v1", "stores": [
            {"place": "", "entries": 1, "bytes": 1}, {"place": "", "entries": 1,
                                                       "bytes": 1}]}).encode(),
    ]
    for doc in bad_docs:
        with pytest.raises(ArchiveError):
            ArchiveIndex.from_bytes(doc)
    counts = parse_end_record(end_record([SectionCount("", 2, 3, 4)]))
    assert counts[""].to_json() == {"place": "", "entries": 2, "objects": 3, "bytes": 4}


# -- selection -------------------------------------------------------------------------------


def _c(place, key, t, size=10, kind="vllm", ns="ns"):
    return Candidate(place, f"{place}:{key}", kind, ns, key, size, t)


def test_newest_first_and_greedy_budget():
    cands = {"": [_c("", "a", 1, 50), _c("", "b", 3, 60), _c("", "c", 2, 30)]}
    p = plan(cands, Selection(max_bytes=100), quorum=False)
    assert [c.key for c in p.parts] == ["b", "c"] and p.over_budget == 1 and p.bytes == 90
    p = plan(cands, Selection(kinds=frozenset({"pytorch"})), quorum=False)
    assert p.parts == [] and p.filtered == 3


def test_vllm_chunks_are_taken_whole_across_ranks():
    r0, r1 = f"{D1}/rank-0000", f"{D1}/rank-0001"
    cands = {r0: [_c(r0, "k1", 5), _c(r0, "k2", 9)], r1: [_c(r1, "k1", 6)]}
    p = plan(cands, Selection(), quorum=True)
    assert [(c.place, c.key) for c in p.parts] == [(r0, "k1"), (r1, "k1")]
    assert p.incomplete_chunks == 1
    # a rank store that exists but holds nothing makes every chunk incomplete
    p = plan({**cands, f"{D1}/rank-0002": []}, Selection(), quorum=True)
    assert p.parts == [] and p.incomplete_chunks == 2
    # a budget counts the whole chunk (both shards)
    p = plan(cands, Selection(max_bytes=15), quorum=True)
    assert p.parts == [] and p.over_budget == 2
    # one rank store picked by hand: its own entries, no quorum
    p = plan({r0: cands[r0]}, Selection(), quorum=False)
    assert len(p.parts) == 2


def test_resolve_deployments_by_name_or_unique_prefix():
    assert resolve_deployments([D1[:12]], [D1, D2]) == {D1}
    with pytest.raises(ConfigError, match="more than one"):
        resolve_deployments(["vllm-v1-"], [D1, D2])
    with pytest.raises(ConfigError, match="no"):
        resolve_deployments(["vll"], [D1])  # too short to be a prefix
    with pytest.raises(ConfigError):
        resolve_deployments(["zz"], [D1])


# -- layouts and routing -----------------------------------------------------------------------


def _mk(path: Path) -> Path:
    Store.open(path, create=True).close()
    return path


def test_inspect_root_layouts(tmp_path: Path):
    base = Path(os.path.realpath(tmp_path))
    _mk(base / "base" / D1 / "rank-0000")
    _mk(base / "base" / D1 / "rank-0001")
    _mk(base / "single")
    lay = inspect_root(base / "base")
    assert lay.kind == "base" and lay.quorum
    assert [s.place for s in lay.stores] == [f"{D1}/rank-0000", f"{D1}/rank-0001"]
    assert inspect_root(base / "base" / D1).kind == "deployment"
    one = inspect_root(base / "base" / D1 / "rank-0001")
    assert one.kind == "store" and one.stores[0].place == f"{D1}/rank-0001" and not one.quorum
    assert inspect_root(base / "single").stores[0].place == ""
    assert inspect_root(base / "nothing-yet").kind == "empty"
    (base / "junk").mkdir()
    (base / "junk" / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a spoolctl store"):
        inspect_root(base / "junk")
    with pytest.raises(ConfigError, match="no spoolctl store"):
        find_stores(base / "nothing-yet")
    os.symlink(base / "single", base / "link")
    with pytest.raises(ConfigError, match="symlink"):
        inspect_root(base / "link")


def test_routing_sends_rank_stores_only_to_their_own_deployment(tmp_path: Path):
    base = Path(os.path.realpath(tmp_path))
    fresh = Target(inspect_root(base / "fresh"))
    assert fresh.route(f"{D1}/rank-0001") == base / "fresh" / D1 / "rank-0001"
    assert fresh.route("") == base / "fresh"
    _mk(base / "b" / D2 / "rank-0000")
    serving = Target(inspect_root(base / "b"))
    with pytest.raises(ConfigError, match=r"another deployment|never reads") as exc:
        serving.route(f"{D1}/rank-0000")
    assert "--deployment" in str(exc.value)
    assert Target(inspect_root(base / "b"), frozenset({D1})).route(f"{D1}/rank-0000") == \
        base / "b" / D1 / "rank-0000"
    assert serving.route(f"{D2}/rank-0000") == base / "b" / D2 / "rank-0000"
    with pytest.raises(ConfigError, match="single store"):
        serving.route("")
    dep = Target(inspect_root(base / "b" / D2))
    assert dep.route(f"{D2}/rank-0000") == base / "b" / D2 / "rank-0000"
    with pytest.raises(ConfigError, match="deployment"):
        dep.route(f"{D1}/rank-0000")
    rank = Target(inspect_root(base / "b" / D2 / "rank-0000"))
    assert rank.route(f"{D2}/rank-0000") == base / "b" / D2 / "rank-0000"
    assert rank.route("") == base / "b" / D2 / "rank-0000"
    with pytest.raises(ConfigError, match="spoolctl_root"):
        rank.route(f"{D2}/rank-0001")


def test_staging_hashes_small_objects_on_the_reading_thread(store: Store):
    """An import stages an object up to ``INLINE_HASH_MAX`` hashing it between its reads and
    writes, with no hand-off per chunk (decision 2941): here the pool is shut down, so a
    hand-off would fail. The staged file holds the bytes; a wrong digest still deletes it;
    a larger object still uses the pool."""
    from concurrent.futures import ThreadPoolExecutor

    from spoolctl.store import hash_bytes
    from spoolctl.store.transfer.ingest import (
        INLINE_HASH_MAX,
        DigestMismatch,
        stage_object,
    )

    class Stream:
        def __init__(self, data: bytes):
            self.f = io.BytesIO(data)

        def readinto(self, view: memoryview) -> int:
            return self.f.readinto(view)

        def skip(self) -> None:
            self.f.read()

    closed = ThreadPoolExecutor(1)
    closed.shutdown()
    data = os.urandom(INLINE_HASH_MAX)  # four 1 MiB chunks
    path = stage_object(store, Stream(data), len(data), hash_bytes(data), closed)
    assert path.read_bytes() == data
    with pytest.raises(DigestMismatch):
        stage_object(store, Stream(data), len(data), "0" * 64, closed)
    assert sorted(p.name for p in store.layout.tmp.iterdir()) == [path.name]
    big = data + b"x"
    with pytest.raises(RuntimeError, match="shutdown"):  # over the limit: pipelined
        stage_object(store, Stream(big), len(big), hash_bytes(big), closed)


def test_export_and_peer_copy_refuse_a_store_no_archive_carries(tmp_path: Path):
    """A caller-classified layout holding a rank store whose deployment name an archive
    cannot carry is refused with one ConfigError (it crashed with a TypeError)."""
    from spoolctl.store.transfer.exporter import export
    from spoolctl.store.transfer.importer import Importer
    from spoolctl.store.transfer.peer import import_from_root

    base = Path(os.path.realpath(tmp_path))
    with Store.open(base / "src" / "bad name" / "rank-0000", create=True) as st:
        st.put(kind="pytorch", namespace="ns", key="k", objects={"data": b"x" * 10})
    layout = inspect_root(base / "src")
    assert [s.place for s in layout.stores] == [None]
    written: list[bytes] = []
    with pytest.raises(ConfigError, match="cannot be carried in an archive"):
        export(base / "src", lambda bufs: written.extend(bytes(b) for b in bufs), layout=layout)
    assert written == []
    with pytest.raises(ConfigError, match="cannot be carried in an archive"):
        import_from_root(Importer(base / "dst"), base / "src", layout=layout)
