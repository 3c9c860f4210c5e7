"""Issue 49 item 2: a root this user cannot read is an error, never "nothing to do".

A cron job under the wrong user, or a mount that came back with other permissions: the
maintenance commands (``status --check``, ``clean``, ``scrub``, ``metrics``) used to see an
empty root and exit 0 for months. Now each exits 2 with one line naming the path, the user
and the fix (an ``AccessDeniedError`` document with ``--json``), and ``metrics --textfile``
writes ``spoolctl_store_up 0`` with ``spoolctl_store_down_reason{reason="permission_denied"}``.

Root ignores mode bits, so the commands run as ``nobody`` (``tests/unprivileged.py``) on a
store root owns with mode 0700 (run as another user, the store is its own with mode 0).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from operator_cli import script
from testpaths import TESTS_DIR

from spoolctl.store import Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

RUNNER = str(TESTS_DIR.joinpath("unprivileged.py"))
sys.path.insert(0, str(TESTS_DIR))
from owned_stores import shared_dir  # noqa: E402
from unprivileged import unprivileged_uid  # noqa: E402

USER = "nobody" if os.geteuid() == 0 else None
CLOSED = 0o700 if os.geteuid() == 0 else 0o000


@pytest.fixture
def base():
    yield from shared_dir("spool-access-")


def cli(*args: str):
    return script(RUNNER, "cli", *args, program=sys.executable, cwd="/tmp")


def _closed_store(base: Path) -> Path:
    root = base / "store"
    with Store.open(root, create=True) as store:
        store.put(kind="pytorch", namespace="ns", key="k", objects={"kv": b"x" * 100})
    root.chmod(CLOSED)
    return root


def _one_denied_line(proc, root: Path) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1, proc.stderr
    line = proc.stderr
    assert "permission denied" in line and str(root) in line and "Traceback" not in line
    assert "unexpected" not in line and "nothing to" not in proc.stdout + line
    if USER:
        assert f"user {USER}" in line and "run it as root" in line, line


@pytest.mark.parametrize("command", [["status", "--check"], ["clean", "--yes"], ["scrub"],
                                     ["metrics"], ["ls"]])
def test_a_root_this_user_cannot_read_is_an_error(base: Path, command: list[str]) -> None:
    root = _closed_store(base)
    try:
        _one_denied_line(cli(*command, "--root", str(root)), root)
        proc = cli(*command, "--root", str(root), "--json")
        _one_denied_line(proc, root)
        doc = json.loads(proc.stdout)
        assert doc["ok"] is False and doc["exit"] == 2
        assert doc["error"]["kind"] == "AccessDeniedError" and doc["error"]["path"] == str(root)
    finally:
        root.chmod(0o700)


def test_metrics_textfile_says_store_up_0_and_why(base: Path) -> None:
    root = _closed_store(base)
    out = base / "prom"
    out.mkdir()
    os.chown(out, unprivileged_uid(), unprivileged_uid())
    prom = out / "spoolctl.prom"
    try:
        proc = cli("metrics", "--root", str(root), "--textfile", str(prom))
        _one_denied_line(proc, root)
    finally:
        root.chmod(0o700)
    lines = [line for line in prom.read_text().splitlines() if not line.startswith("#")]
    assert lines == ["spoolctl_store_up 0.0",
                     'spoolctl_store_down_reason{reason="permission_denied"} 1.0'], lines


def test_a_root_under_a_directory_this_user_cannot_search(base: Path) -> None:
    """The path itself cannot be reached (a parent without search permission): not "no
    store here yet" (init's advice), the same permission line."""
    outer = base / "outer"
    outer.mkdir()
    root = outer / "store"
    Store.open(root, create=True).close()
    outer.chmod(CLOSED)
    try:
        for command in (["status", "--check"], ["clean", "--yes"]):
            proc = cli(*command, "--root", str(root))
            assert proc.returncode == 2 and "permission denied" in proc.stderr, proc.stderr
            assert f"{outer} cannot be searched" in proc.stderr, proc.stderr
            assert "init" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    finally:
        outer.chmod(0o755)
