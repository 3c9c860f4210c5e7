"""Issue 49 item 4: a root path too long for the store's files is refused before anything is
created; the longest accepted one is a whole, working store.

SQLite cannot open a database whose path (with its ``-journal``) reaches 512 bytes: ``init``
on a 501-byte root used to create the directories and the marker, then fail at the catalog,
and ``doctor`` called the half-made store's catalog corrupt. Now ``init`` refuses such a root
with one line and creates nothing (all or nothing); a root of exactly the limit works end to
end (init, put, scrub, clean, doctor without a failed check). A name longer than a
filesystem's 255 bytes is the same one-line refusal, never "unexpected OSError".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from operator_cli import script

from spoolctl.store import RootError, Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

LIMIT = 476  # bytes: 512 - len("-journal") - len("/state/auth_requests.sqlite3")


def _root_of(base: Path, size: int) -> Path:
    """A path under ``base`` of exactly ``size`` bytes, in names of at most 200 bytes."""
    path = str(base)
    while len(path) < size:
        room = size - len(path) - 1
        path += "/" + "d" * min(200, room if room != 201 else 199)
    assert len(path) == size, (len(path), size)
    return Path(path)


def _refused(proc, what: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1 and what in proc.stderr, proc.stderr
    assert "unexpected" not in proc.stderr and "corrupt" not in proc.stderr


def test_a_root_too_long_for_sqlite_is_refused_and_nothing_is_made(tmp_path: Path) -> None:
    base = tmp_path / "b"
    root = _root_of(base, LIMIT + 25)
    _refused(script("init", "--root", str(root)), "store root path is too long")
    assert not base.exists()  # all or nothing: not even the first directory
    for command in (["status", "--check"], ["clean", "--yes"]):
        _refused(script(*command, "--root", str(root)), "store root path is too long")
    doctor = script("doctor", "--root", str(root), "--json")  # a finding, not "corrupt"
    assert doctor.returncode == 1
    assert [(c["name"], c["status"]) for c in json.loads(doctor.stdout)["checks"]] == \
        [("root.path", "fail")]
    assert "too long" in doctor.stdout and "corrupt" not in doctor.stdout
    with pytest.raises(RootError, match="too long"):
        Store.open(root, create=True)
    assert not base.exists()


def test_the_longest_root_accepted_is_a_whole_store(tmp_path: Path) -> None:
    root = _root_of(tmp_path / "b", LIMIT)
    assert script("init", "--root", str(root)).returncode == 0
    with Store.open(root) as store:
        m = store.put(kind="pytorch", namespace="ns", key="k", objects={"kv": os.urandom(999)})
        store.release(m.entry_id)
    for command in (["scrub"], ["clean", "--yes"], ["status", "--check"]):
        proc = script(*command, "--root", str(root))
        assert proc.returncode == 0, (command, proc.stderr)
    doctor = script("doctor", "--root", str(root), "--json")
    assert doctor.returncode == 0, doctor.stdout
    assert not [c for c in json.loads(doctor.stdout)["checks"] if c["status"] == "fail"]


def test_a_name_longer_than_the_filesystem_takes_is_one_line(tmp_path: Path) -> None:
    root = tmp_path / ("n" * 300)
    for command in (["init"], ["status"], ["clean", "--yes"]):
        _refused(script(*command, "--root", str(root)), "a name in the store root path is "
                                                         "too long")
