"""Hostile CLI input (hypothesis): random roots, sizes, durations, rates, entry ids, item ids
and kinds. Every command answers with exit 0/1 on valid input, or exit 2 and ONE line on
stderr (``error: ...``) -- never a traceback, never an "unexpected" error -- and nothing is
created outside the test's temporary directory. The CLI runs in-process (``main(argv)``) for
speed; a few cases run the real console script."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from spoolctl.cli.app import main
from spoolctl.store import Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
# Any text a shell could pass (no NUL: argv cannot carry it), control characters included.
ARG = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
              max_size=40)
NAME = ARG.filter(lambda s: "/" not in s)
HEXISH = st.text("0123456789abcdefABCDEF./\\%-_xz", min_size=0, max_size=70)


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return code, out.getvalue(), err.getvalue()


def assert_clean_outcome(argv: list[str], code: int, err: str) -> None:
    assert "Traceback" not in err, (argv, err)
    assert "error: unexpected" not in err, (argv, err)  # an unhandled exception
    assert code in (0, 1, 2), (argv, code, err)
    if code == 2:
        lines = err.strip("\n").split("\n")
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)


@pytest.fixture(scope="module")
def sandbox() -> Path:
    """A temp dir holding one healthy store; the cwd during the tests (relative paths land
    here, and the check below would see them)."""
    # Nested, so the directory around it is ours alone (other jobs write to /tmp too).
    base = Path(os.path.realpath(tempfile.mkdtemp(prefix="spool-hostile-"))) / "sandbox"
    base.mkdir()
    with Store.open(base / "store", create=True) as store:
        store.put(kind="pytorch", namespace="ns", key="k", objects={"kv": b"x" * 100})
    old = os.getcwd()
    os.chdir(base)
    yield base
    os.chdir(old)


def _outside_snapshot(base: Path) -> set[str]:
    return set(os.listdir(base.parent)) | {f"/{p}" for p in os.listdir("/")}


@contextlib.contextmanager
def nothing_outside(sandbox: Path, argv_log: list[list[str]]):
    """Fail this example if anything appeared next to the sandbox (e.g. through a ".."
    name) or at / while it ran; the failure names the commands it ran."""
    before = _outside_snapshot(sandbox)
    yield
    assert _outside_snapshot(sandbox) - before == set(), argv_log


def _store_tree(base: Path) -> set[str]:
    return {str(p.relative_to(base)) for p in base.rglob("*")}


@SETTINGS
@given(root=ARG)
def test_random_relative_roots_are_refused(sandbox, root: str) -> None:
    assume(not os.path.isabs(root))
    before = _store_tree(sandbox)
    argv = ["init", "--root", root]
    with nothing_outside(sandbox, [argv]):
        code, _, err = run(argv)
    assert_clean_outcome(argv, code, err)
    assert code == 2
    assert _store_tree(sandbox) == before  # nothing created, not even relative to the cwd


@SETTINGS
@given(name=NAME)
def test_random_root_names_create_nothing_outside(sandbox, name: str) -> None:
    ran: list[list[str]] = []
    with nothing_outside(sandbox, ran):
        for command in (["status"], ["ls"], ["doctor"], ["clean", "--dry-run", "--yes"]):
            argv = [*command, "--root", f"{sandbox}/{name}"]
            ran.append(argv)
            code, _, err = run(argv)
            assert_clean_outcome(argv, code, err)


@SETTINGS
@given(value=ARG)
def test_random_sizes_durations_rates(sandbox, value: str) -> None:
    root = str(sandbox / "store")
    ran: list[list[str]] = []
    with nothing_outside(sandbox, ran):
        for argv in (["init", "--root", root, "--max-size", value],
                     ["clean", "--root", root, "--min-age", value, "--dry-run", "--yes"],
                     ["scrub", "--root", root, "--rate", value, "--max-items", "1"],
                     ["scrub", "--root", root, "--max-items", value],
                     ["ls", "--root", root, "--kind", value]):
            ran.append(argv)
            code, _, err = run(argv)
            assert_clean_outcome(argv, code, err)
    with Store.open(root) as store:
        assert len(store.entries()) == 1  # nothing was cleaned or evicted by junk input


@SETTINGS
@given(ident=st.one_of(ARG, HEXISH))
def test_random_ids_and_item_names(sandbox, ident: str) -> None:
    root = str(sandbox / "store")
    before = _store_tree(sandbox)
    ran: list[list[str]] = []
    with nothing_outside(sandbox, ran):
        for argv in (["inspect", "--root", root, "--", ident],
                     ["request-auth", "--root", root, "--", ident],
                     ["quarantine", "show", "--root", root, "--", ident],
                     ["quarantine", "restore", "--root", root, "--", ident],
                     ["quarantine", "purge", "--root", root, "--yes", "--", ident]):
            ran.append(argv)
            code, _, err = run(argv)
            assert_clean_outcome(argv, code, err)
            assert code in (1, 2), (argv, code)  # nothing valid to find
    assert _store_tree(sandbox) - before <= {"store/state/auth.sqlite3",
                                             "store/state/auth.sqlite3-wal",
                                             "store/state/auth.sqlite3-shm"}


@pytest.mark.parametrize("ident", ["../../../../etc/passwd", "..", "00/../..", "%2e%2e%2f",
                                   "a" * 64 + "/../x", "\u2024\u2024/etc", "ab\ncd"])
def test_traversal_ids_never_resolve_to_paths(sandbox, ident: str) -> None:
    root = str(sandbox / "store")
    for argv in (["inspect", "--root", root, "--", ident],
                 ["quarantine", "restore", "--root", root, "--", ident]):
        code, _, err = run(argv)
        assert code == 2, (argv, err)
        assert_clean_outcome(argv, code, err)


@pytest.mark.parametrize("argv", [
    ["init", "--root", "relative/dir"],
    ["inspect", "--root", "{root}", "../../etc/passwd"],
    ["clean", "--root", "{root}", "--min-age", "1e400s", "--dry-run"],
    ["scrub", "--root", "{root}", "--rate", "-1MiB/s"],
])
def test_real_console_script_one_line_exit_2(sandbox, argv: list[str]) -> None:
    exe = Path(sys.executable).with_name("spoolctl")
    argv = [a.replace("{root}", str(sandbox / "store")) for a in argv]
    proc = subprocess.run([str(exe), *argv], capture_output=True, text=True, timeout=60,
                          cwd=sandbox, env={**os.environ, "COLUMNS": "80"})
    assert proc.returncode == 2, proc.stderr
    assert_clean_outcome(argv, proc.returncode, proc.stderr)
    assert not (sandbox / "relative").exists()
