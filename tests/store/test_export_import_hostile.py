"""Hostile and damaged archives fed to the real ``spoolctl import``: each is refused with ONE
line (exit 1; exit 2 for capacity), no traceback, nothing written outside the target root,
nothing of the defective entry published, every visible entry complete and verified, and
no temp files left. Archives are built from a real export, then altered member by member."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
from transfer_support import cli, cli_json, files_under, fill, snapshot, tmp_files

from spoolctl.store import Store
from spoolctl.store.format.digest import hash_bytes

Members = list[tuple[tarfile.TarInfo, bytes]]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Members]:
    """A store of four entries (one object each plus a shared one) and its archive's members."""
    base = Path(os.path.realpath(tmp_path_factory.mktemp("hostile-src")))
    fill(base / "src", 4, size=3000)
    cli_json("export", "--root", str(base / "src"), "-o", str(base / "a.tar"))
    with tarfile.open(base / "a.tar") as tf:
        members = [(m, tf.extractfile(m).read()) for m in tf.getmembers()]
    return base / "src", members


def build(members: Members, fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tf:
        for info, data in members:
            info = _copy(info)
            if info.isreg():
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return out.getvalue()


def _copy(info: tarfile.TarInfo) -> tarfile.TarInfo:
    new = tarfile.TarInfo(info.name)
    for attr in ("size", "mode", "mtime", "type", "linkname", "uid", "gid"):
        setattr(new, attr, getattr(info, attr))
    return new


def reg(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o600
    return info, data


def index_of(members: Members, name_prefix: str) -> int:
    return next(i for i, (m, _) in enumerate(members) if m.name.startswith(name_prefix))


def objects(members: Members) -> list[int]:
    return [i for i, (m, _) in enumerate(members) if m.name.startswith("objects/")]


def manifests(members: Members) -> list[int]:
    return [i for i, (m, _) in enumerate(members) if m.name.startswith("manifests/")]


def set_index(members: Members, change: Callable[[dict], None]) -> Members:
    out = list(members)
    doc = json.loads(out[0][1])
    change(doc)
    out[0] = reg(out[0][0].name, json.dumps(doc).encode())
    return out


def refused(base: Path, data: bytes, *, code: int = 1, match: str = "") -> Path:
    """Import ``data`` from stdin into a fresh root under ``base``; assert the refusal."""
    target = base / "target"
    before = {k: v for k, v in files_under(base).items() if not k.startswith("target")}
    proc = cli("import", "--root", str(target), "-", stdin=data)
    err = proc.stderr.decode()
    assert proc.returncode == code, err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and match in err, err
    after = {k: v for k, v in files_under(base).items() if not k.startswith("target")}
    assert after == before  # nothing written outside the target root
    if target.exists():
        assert tmp_files(target) == []
        with Store.open(target) as store:
            for row in store.entries(include_pending=True):
                assert row.state == "committed"
                store.verify(row.entry_id)
    return target


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return Path(os.path.realpath(tmp_path))


@pytest.mark.parametrize("name", ["../evil.obj", "/tmp/evil.obj", "objects/ab/../../../evil",
                                  "./objects/x", "objects/../../../../tmp/evil"])
def test_path_traversal_names(base, exported, name):
    _src, members = exported
    bad = list(members)
    bad.insert(1, reg(name, b"evil"))
    refused(base, build(bad), match="unexpected member name")
    assert not (base.parent / "evil.obj").exists() and not Path("/tmp/evil.obj").exists()


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE])
def test_links_and_directories(base, exported, kind):
    _src, members = exported
    i = objects(members)[0]
    info = tarfile.TarInfo(members[i][0].name)
    info.type = kind
    info.linkname = "/etc/passwd"
    bad = list(members)
    bad[i] = (info, b"")
    target = refused(base, build(bad), match="only regular files")
    # nothing the member describes was made: no link anywhere under base (the target root
    # included), and no directory or link where the object would have gone
    assert not any(p.is_symlink() for p in base.rglob("*"))
    placed = target / info.name
    assert not placed.is_symlink() and not placed.is_dir() and not placed.exists()


def test_pax_long_name_is_refused(base, exported):
    _src, members = exported
    bad = list(members)
    bad.insert(1, reg("objects/ab/" + "a" * 200, b"x"))
    refused(base, build(bad, tarfile.PAX_FORMAT), match="pax header")


def test_object_bytes_that_do_not_match_their_digest(base, exported):
    _src, members = exported
    bad = list(members)
    i = objects(members)[1]
    data = bytearray(members[i][1])
    data[0] ^= 1
    bad[i] = reg(members[i][0].name, bytes(data))
    target = refused(base, build(bad), match="does not match its digest")
    # nothing of the damaged entry is visible; the entries before it are complete
    assert len(snapshot(target)) == sum(1 for j in manifests(members) if j < i)


def test_object_size_that_differs_from_its_manifest(base, exported):
    from spoolctl.store.format.manifest import Manifest, ObjectRef, decode, encode

    _src, members = exported
    bad = list(members)
    i = objects(members)[1]
    extra = members[i][1] + b"!"  # a valid object of another size under its own digest
    digest = hash_bytes(extra)
    bad[i] = reg(f"objects/{digest[:2]}/{digest}.obj", extra)
    refused(base, build(bad), match="not named by it")
    # the member is honest, the manifest (re-signed) claims another size for it
    j = manifests(members)[0]
    m = decode(members[j][1])
    ref = next(r for r in m.objects if r.name == "kv")
    lie = Manifest.new(kind=m.kind, namespace=m.namespace, key=m.key, created=m.created,
                       objects=tuple(ObjectRef(r.name, r.digest, r.size + 7) if r is ref else r
                                     for r in m.objects), meta=m.meta, index=m.index)
    bad = list(members)
    bad[j] = reg(members[j][0].name, encode(lie))
    refused(base, build(bad), match="manifest " + m.entry_id + " says")


def test_index_that_understates_bytes_or_entries(base, exported):
    _src, members = exported

    def fewer_bytes(doc):
        doc["stores"][0]["bytes"] = 100

    def fewer_entries(doc):
        doc["stores"][0]["entries"] = 1

    refused(base, build(set_index(members, fewer_bytes)), match="more bytes")
    refused(base, build(set_index(members, fewer_entries)), match="more entries")


def test_end_record_that_disagrees(base, exported):
    _src, members = exported
    bad = list(members)
    doc = json.loads(bad[-1][1])
    doc["stores"][0]["entries"] += 1
    bad[-1] = reg(bad[-1][0].name, json.dumps(doc).encode())
    target = refused(base, build(bad), match="end record disagrees")
    assert len(snapshot(target)) == 4  # every entry was complete and verified


@pytest.mark.parametrize("fraction", [0.01, 0.3, 0.55, 0.8, 0.999])
def test_truncated_streams(base, exported, fraction):
    src, members = exported
    data = build(members)
    content = len(data.rstrip(b"\0"))  # the end record's last byte; zero padding follows
    cut = data[:int(content * fraction)]
    target = refused(base, cut, match="truncated" if fraction > 0.05 else "")
    if target.exists():  # what was complete before the cut is imported, verified
        expected = snapshot(src)
        got = snapshot(target)
        assert all(got[e] == expected[e] for e in got)


def test_duplicated_members(base, exported):
    _src, members = exported
    o, m = objects(members)[0], manifests(members)[0]
    refused(base, build([*members[:o + 1], members[o], *members[o + 1:]]), match="duplicated")
    refused(base, build([*members[:m + 1], members[m], *members[m + 1:]]), match="duplicated")
    refused(base, build([members[0], *members]), match="duplicated archive index")


def test_manifest_naming_an_object_the_archive_lacks(base, exported):
    _src, members = exported
    i = objects(members)[-1]  # the last entry's own object
    refused(base, build(members[:i] + members[i + 1:]), match="lacks")


def test_object_not_named_by_the_next_manifest(base, exported):
    _src, members = exported
    stray = b"stray bytes"
    digest = hash_bytes(stray)
    bad = list(members)
    bad.insert(manifests(members)[1], reg(f"objects/{digest[:2]}/{digest}.obj", stray))
    refused(base, build(bad), match="not named by it")


def test_member_of_a_store_the_index_does_not_list(base, exported):
    _src, members = exported
    bad = list(members)
    name = members[objects(members)[0]][0].name
    bad.insert(1, reg(f"vllm-v1-{'c' * 48}/rank-0000/{name}", members[objects(members)[0]][1]))
    refused(base, build(bad), match="does not list")


def test_manifest_tampered_or_moved_to_another_entry(base, exported):
    _src, members = exported
    m1, m2 = manifests(members)[:2]
    bad = list(members)
    doc = json.loads(members[m1][1])
    doc["body"]["meta"]["i"] = 999  # the envelope digest no longer matches
    bad[m1] = reg(members[m1][0].name, json.dumps(doc).encode())
    refused(base, build(bad), match="invalid")
    bad = list(members)
    bad[m2] = reg(members[m2][0].name, members[m1][1])  # entry 1's manifest under entry 2's id
    refused(base, build(bad), match="invalid")


def test_members_after_the_end_record(base, exported):
    _src, members = exported
    refused(base, build([*members, members[objects(members)[0]]]), match="after the end record")
    refused(base, build(members) + b"trailing garbage", match="after the end of the archive")


def test_archive_far_larger_than_the_store(base, exported):
    _src, members = exported

    def huge(doc):
        doc["stores"][0]["bytes"] = 1 << 50  # one PiB

    data = build(set_index(members, huge))
    small = base / "target"
    assert cli("init", "--root", str(small), "--max-size", "1MiB").returncode == 0
    refused(base, data, code=2, match="more than its max size")
    assert snapshot(small) == {}
    proc = cli("import", "--root", str(base / "unbounded"), "-", stdin=data)
    assert proc.returncode == 2 and b"the disk has" in proc.stderr
    assert not (base / "unbounded").exists()


def test_not_an_archive_and_a_foreign_tar(base):
    refused(base, b"\x00" * 10240, match="not a spoolctl archive")
    refused(base, build([reg("README", b"hello")]), match="unexpected member name")
    refused(base, build([reg("spoolctl-archive.json", b"{nope")]), match="not valid JSON")


def test_random_damage_is_refused_or_harmless(base, exported):
    """Seeded random byte flips, cuts and splices of a real archive: the import either
    refuses it (ArchiveError) or imports entries identical to the source; never another
    exception, never an entry that does not verify."""
    from spoolctl.errors import ArchiveError, CapacityError, ConfigError
    from spoolctl.store.transfer.importer import Importer

    src, members = exported
    good = build(members)
    content = len(good.rstrip(b"\0"))
    expected = snapshot(src)
    rng = random.Random(21)
    for i in range(60):
        data = bytearray(good)
        op = i % 3
        if op == 0:
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(content)] ^= 1 << rng.randrange(8)
        elif op == 1:
            data = data[:rng.randrange(content)]
        else:
            a, b = sorted(rng.randrange(content) for _ in range(2))
            data = data[:a] + data[b:]
        target = base / f"t{i}"
        # a refusal (a flip in the index can also make it claim more bytes or another place)
        with contextlib.suppress(ArchiveError, CapacityError, ConfigError):
            Importer(target).from_archive(io.BytesIO(bytes(data)))
        if target.exists():
            got = snapshot(target)
            assert all(got[e] == expected[e] for e in got), i
            assert tmp_files(target) == []


def _with_size_field(data: bytes, member_prefix: str, field: bytes) -> bytes:
    """``data`` with the size field of the first member named ``member_prefix...`` replaced
    by ``field`` (12 bytes) and the header's checksum made right again: a crafted header."""
    out = bytearray(data)
    off = 0
    while not bytes(out[off:off + 100]).rstrip(b"\0").decode().startswith(member_prefix):
        size = tarfile.nti(bytes(out[off + 124:off + 136]))
        off += 512 + (size + 511) // 512 * 512
    out[off + 124:off + 136] = field
    out[off + 148:off + 156] = b" " * 8
    out[off + 148:off + 156] = b"%06o\0 " % sum(out[off:off + 512])
    return bytes(out)


@pytest.mark.parametrize("field", [
    tarfile.itn(-5, 12, tarfile.GNU_FORMAT),  # base-256, negative
    tarfile.itn(-(1 << 80), 12, tarfile.GNU_FORMAT),
    b"\xff" * 12,  # base-256 -1
    b"99999999999\0",  # not octal
], ids=["minus-5", "minus-2**80", "minus-1", "not-octal"])
@pytest.mark.parametrize("member", ["objects/", "manifests/", "spoolctl-archive.json"])
def test_a_crafted_size_field_is_a_one_line_refusal_with_nothing_left(base, exported, field,
                                                                      member):
    """A header whose size is negative (a base-256 field) or not a number is refused like any
    other defect: one line, exit 1, no traceback and no ``.part`` file in the target."""
    _src, members = exported
    data = _with_size_field(build(members), member, field)
    refused(base, data, match="error:")
    archive = base / "crafted.tar"
    archive.write_bytes(data)
    proc = cli("import", "--root", str(base / "from-file"), str(archive))
    err = proc.stderr.decode()
    assert proc.returncode == 1 and len(err.strip().splitlines()) == 1, err
    assert "unexpected" not in err and "Traceback" not in err, err
    if (base / "from-file").exists():
        assert tmp_files(base / "from-file") == []
