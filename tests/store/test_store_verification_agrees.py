"""Issue 28 item 2: every reader of an object verifies it with one primitive and turns a
failure into a quarantine reason with one classifier, so the reason (a metrics label, an
alert) and the evidence kept do not depend on who found the damage (decision 2510).

A table of damage x the readers a user runs: a verified read (what the connector's restore
and the controllers do), the scrub, the export (of a small entry, read whole, and of a
large one, streamed into the archive) and request-auth. Before: a symlinked object was
``payload_missing`` for a read and ``payload_digest`` for the scrub; the scrub left a FIFO
or directory in ``objects/``; a streamed export quarantined a wrong size without its
evidence, raised a bare OSError for a symlink and quarantined nothing for a missing object.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from operator_cli import script
from owned_stores import owned_store, shared_dir
from testpaths import TESTS_DIR

from spoolctl.store import (
    CorruptionError,
    Store,
)
from spoolctl.store.maintain.auth_requests import authenticate
from spoolctl.store.maintain.scrub import Scrubber
from spoolctl.store.transfer import exporter

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

SIZE = 20_000


def _flip(obj: Path, outside: Path) -> None:
    raw = bytearray(obj.read_bytes())
    raw[SIZE // 2] ^= 0x01
    obj.write_bytes(bytes(raw))


def _truncate(obj: Path, outside: Path) -> None:
    os.truncate(obj, SIZE // 2)


def _append(obj: Path, outside: Path) -> None:
    with open(obj, "ab") as f:
        f.write(b"!")


def _missing(obj: Path, outside: Path) -> None:
    os.unlink(obj)


def _symlink(obj: Path, outside: Path) -> None:
    shutil.copy(obj, outside)  # identical bytes: following the link would "verify"
    os.unlink(obj)
    obj.symlink_to(outside)


def _dangling(obj: Path, outside: Path) -> None:
    os.unlink(obj)
    obj.symlink_to(outside)  # nothing there


def _fifo(obj: Path, outside: Path) -> None:
    os.unlink(obj)
    os.mkfifo(obj, 0o600)


def _directory(obj: Path, outside: Path) -> None:
    os.unlink(obj)
    obj.mkdir()
    (obj / "inside").write_bytes(b"x")


# damage -> (how, the quarantine reason, whether the thing at the object's path is kept as
# evidence in the item)
DAMAGE: dict[str, tuple[Callable[[Path, Path], None], str, bool]] = {
    "flipped_byte": (_flip, "payload_digest", True),
    "truncated": (_truncate, "payload_size", True),
    "one_byte_appended": (_append, "payload_size", True),
    "missing": (_missing, "payload_missing", False),
    "symlink_to_same_bytes": (_symlink, "payload_missing", True),
    "dangling_symlink": (_dangling, "payload_missing", True),
    "fifo": (_fifo, "payload_missing", True),
    "directory": (_directory, "payload_missing", True),
}


def _read(root: Path, entry_id: str) -> str:
    with Store.open(root) as store, pytest.raises(CorruptionError) as info:
        store.read(store.manifest(entry_id), "kv")
    return info.value.reason.value


def _scrub(root: Path, entry_id: str) -> str:
    with Store.open(root) as store:
        report = Scrubber(store).run(until_complete=True)
    assert report is not None and report.checked == 1 and report.unreadable == []
    [found] = report.quarantined
    assert found["entry_id"] == entry_id
    return found["reason"]


def _export(root: Path, entry_id: str) -> str:
    sink: list[bytes] = []
    report = exporter.export(root, lambda bufs: sink.extend(bytes(b) for b in bufs))
    assert (report.entries, report.corrupt) == (1, 1)  # left out; the healthy one written
    return _reason_in_quarantine(root, entry_id)


def _export_streamed(root: Path, entry_id: str) -> str:
    # ENTRY_BUFFER lowered: both entries are "large", streamed from their files into the
    # archive (the damaged one is first in access order)
    sink: list[bytes] = []
    saved = exporter.ENTRY_BUFFER
    exporter.ENTRY_BUFFER = 1000
    try:
        with pytest.raises(CorruptionError) as info:
            exporter.export(root, lambda bufs: sink.extend(bytes(b) for b in bufs))
    finally:
        exporter.ENTRY_BUFFER = saved
    assert info.value.reason.value == _reason_in_quarantine(root, entry_id)
    return info.value.reason.value


def _request_auth(root: Path, entry_id: str) -> str:
    with Store.open(root) as store:
        result = authenticate(store, entry_id)
    assert result.result == "quarantined", result
    return str(result.reason)


def _reason_in_quarantine(root: Path, entry_id: str) -> str:
    with Store.open(root) as store:
        [item] = store.quarantine_items()
    assert item.entry_id == entry_id
    return item.reason


READERS = {"read": _read, "scrub": _scrub, "export": _export,
           "export_streamed": _export_streamed, "request_auth": _request_auth}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_every_reader_gives_the_same_reason_and_keeps_the_same_evidence(
        store_root: Path, tmp_path: Path, damage: str, reader: str) -> None:
    with Store.open(store_root, create=True) as store:
        bad = store.put(kind="pytorch", namespace="ns", key="bad",
                        objects={"kv": os.urandom(SIZE)})
        store.put(kind="pytorch", namespace="ns", key="good", objects={"kv": os.urandom(SIZE)})
    digest = bad.objects[0].digest
    obj = store_root / "objects" / digest[:2] / f"{digest}.obj"
    outside = Path(os.path.realpath(tmp_path)) / "outside.obj"
    how, reason, evidence = DAMAGE[damage]
    how(obj, outside)

    assert READERS[reader](store_root, bad.entry_id) == reason
    assert _reason_in_quarantine(store_root, bad.entry_id) == reason
    with Store.open(store_root) as store:
        [item] = store.quarantine_items()
        assert store.lookup("pytorch", "ns", "bad") is None  # a miss from now on
        assert store.lookup("pytorch", "ns", "good") is not None
    # whatever occupied the object's path went into the item, never followed or opened
    assert not os.path.lexists(obj)
    assert os.path.lexists(item.path / obj.name) is evidence
    if damage == "symlink_to_same_bytes":
        assert os.path.islink(item.path / obj.name) and outside.read_bytes()


@pytest.fixture
def base():
    """A directory the unprivileged user can reach (pytest's tmp_path is root-only)."""
    yield from shared_dir("spool-verify-")


def test_an_unreadable_object_is_damage_to_no_reader(base: Path) -> None:
    """EACCES (root ignores mode bits: the readers run as an unprivileged user,
    ``tests/unprivileged.py``): every reader reports the store I/O error (the scrub: an
    ``unreadable`` finding) and nothing is quarantined or moved: fixing the mode makes the
    entry whole again. Before: a streamed export raised a bare PermissionError."""
    root, made = owned_store(base, 2)
    digest = made[0].objects[0].digest
    obj = root / "objects" / digest[:2] / f"{digest}.obj"
    obj.chmod(0)
    code = textwrap.dedent(f"""
        import json
        from spoolctl.store import Store, StoreIOError
        from spoolctl.store.transfer import exporter
        from spoolctl.store.maintain.auth_requests import authenticate
        from spoolctl.store.maintain.scrub import Scrubber
        root, entry_id, out = {str(root)!r}, {made[0].entry_id!r}, {{}}
        def run(name, fn):
            try:
                fn()
                out[name] = "no error"
            except StoreIOError as exc:
                out[name] = "StoreIOError: " + exc.message
            except Exception as exc:
                out[name] = type(exc).__name__ + ": " + str(exc)
        with Store.open(root) as s:
            run("read", lambda: s.read(s.manifest(entry_id), "kv"))
            run("request_auth", lambda: authenticate(s, entry_id))
            report = Scrubber(s).run(until_complete=True)
            out["scrub"] = [u["entry_id"] for u in report.unreadable]
        run("export", lambda: exporter.export(root, lambda bufs: None))
        exporter.ENTRY_BUFFER = 1000
        run("export_streamed", lambda: exporter.export(root, lambda bufs: None))
        with Store.open(root) as s:
            out["quarantined"] = len(s.quarantine_items())
        print(json.dumps(out))
    """)
    runner = str(TESTS_DIR.joinpath("unprivileged.py"))
    proc = script(runner, "py", code, program=sys.executable, cwd="/tmp")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    denied = "StoreIOError: reading an object failed: Permission denied"
    assert out == {"read": denied, "request_auth": denied, "export": denied,
                   "export_streamed": denied, "scrub": [made[0].entry_id],
                   "quarantined": 0}, out
    assert os.path.exists(obj)  # nothing moved
