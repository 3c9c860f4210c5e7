"""Issue 49 item 7: leftovers and lies in the small print.

* An export killed with -9 leaves ``.NAME.PID.part``; the next export to that name removes
  it once its writer is gone (and the metrics textfile's ``.tmp`` likewise).
* A time stamped by a clock that ran ahead says "in the future", never "0s ago".
* ``--version`` names the build: ``0.1.0+g<commit>``, different for two commits, read from
  the checkout at run time (and recorded by ``setup.py`` at build time).
* ``status`` says what it does not know about a model namespace, never "? (None, ...)".
* Integers beyond 2**53 - 1 are strings in ``--json`` (jq and JavaScript round them).
* A drive root that is not ASCII labels its gauges; it no longer refuses every root.
* ``--json`` is one line per document off a terminal, indented on one or with ``--pretty``.
"""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from operator_cli import ENV, SPOOLCTL, run, script
from testpaths import REPO_DIR

from spoolctl.store import Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

REPO = REPO_DIR
YEAR = 364 * 86400


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    with Store.open(root, create=True) as s:
        s.put(kind="pytorch", namespace="ns", key="k", objects={"kv": b"x" * 100})
    return root


def test_a_killed_exports_part_file_is_removed_by_the_next_export(store: Path,
                                                                   tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    dead, alive = _dead_pid(), os.getppid()
    left = out / f".replica.tar.{dead}.part"  # what `export -o replica.tar` killed -9 leaves
    busy = out / f".replica.tar.{alive}.part"  # a writer still running: never touched
    fresh = out / f".replica.tar.{_dead_pid()}.part"  # written a moment ago: maybe elsewhere
    for part in (left, busy, fresh):
        part.write_bytes(b"half an archive")
    old = time.time() - 3600
    for part in (left, busy):
        os.utime(part, (old, old))
    assert script("export", "--root", str(store), "-o", str(out / "replica.tar")
                  ).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(["replica.tar", busy.name,
                                                            fresh.name])
    prom_left = out / f".spoolctl.prom.{dead}.tmp"
    prom_left.write_bytes(b"spoolctl_store_up 1.0\n")
    os.utime(prom_left, (old, old))
    assert script("metrics", "--root", str(store), "--textfile",
                  str(out / "spoolctl.prom")).returncode == 0
    assert not prom_left.exists()


def test_a_time_from_the_future_says_so(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with Store.open(root, create=True, clock=lambda: time.time() + YEAR) as s:
        m = s.put(kind="pytorch", namespace="ns", key="k", objects={"kv": b"x"})
    code, out, err = run("ls", "--root", str(root))
    assert code == 0, err
    assert "in the future" in out and "0s ago" not in out, out
    code, out, _ = run("inspect", m.entry_id, "--root", str(root))
    assert "created     in the future" in out, out


def test_version_names_the_commit_of_the_checkout() -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not run from a git checkout")
    proc = script("--version")
    assert proc.returncode == 0, proc.stderr
    found = re.fullmatch(r"spoolctl (\d+\.\d+\.\d+)\+g([0-9a-f]{12})\n", proc.stdout)
    assert found, proc.stdout
    git = shutil.which("git")
    if git:
        head = subprocess.run([git, "-C", str(REPO), "rev-parse", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
        assert head.startswith(found.group(2))


def test_two_commits_give_two_versions(tmp_path: Path) -> None:
    """A clone of the package at two commits: the run-time version (from the checkout's
    git files) and the build-time one (``setup.py --version``) differ and name each."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("no git")
    repo = tmp_path / "clone"
    (repo / "spoolctl").mkdir(parents=True)
    for rel in ("setup.py", "spoolctl/__init__.py", "spoolctl/version.py"):
        shutil.copy2(REPO / rel, repo / rel)
    env = {**ENV, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "PYTHONPATH": str(repo)}

    def git_run(*args: str) -> str:
        proc = subprocess.run([git, "-C", str(repo), *args], capture_output=True, text=True,
                              env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    def versions() -> tuple[str, str]:
        at_run = subprocess.run([sys.executable, "-c", "from spoolctl.version import version;"
                                 "print(version())"], capture_output=True, text=True,
                                env=env, cwd=repo)
        built = subprocess.run([sys.executable, "setup.py", "--version"], capture_output=True,
                               text=True, env=env, cwd=repo)
        return at_run.stdout.strip(), (built.stdout.strip().splitlines() or [""])[-1]

    git_run("init", "-q")
    git_run("add", "-A")
    git_run("commit", "-qm", "one")
    first = versions()
    (repo / "spoolctl" / "__init__.py").write_text(
        (REPO / "spoolctl" / "__init__.py").read_text() + "# another commit\n")
    git_run("commit", "-qam", "two")
    second = versions()
    for (at_run, built), ref in ((first, "HEAD~1"), (second, "HEAD")):
        commit = git_run("rev-parse", "--short=12", ref)
        assert at_run.endswith(f"+g{commit}"), at_run
        if built:  # setuptools present (always in CI): the wheel's version is the same
            assert built == at_run, (built, at_run)
    assert first[0] != second[0]


def test_status_says_what_it_does_not_know_about_a_model(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with Store.open(root, create=True) as s:  # entries that record no model identity
        s.put(kind="pytorch", namespace="model-x", key="k", objects={"kv": b"x"})
    code, out, err = run("status", "--root", str(root))
    assert code == 0, err
    line = next(line for line in out.splitlines() if "model model-x" in line)
    assert "?" not in line and "None" not in line, line
    assert "unknown (its entries record no model, framework or weights)" in line


def test_integers_beyond_two_to_the_53_are_strings_in_json() -> None:
    from spoolctl.cli.common import exact_ints

    doc = {"version": 2**63 - 25, "small": 2**53 - 1, "neg": -(2**60), "flag": True,
           "rows": [{"v": 2**53}, 7]}
    assert exact_ints(doc) == {"version": str(2**63 - 25), "small": 2**53 - 1,
                               "neg": str(-(2**60)), "flag": True,
                               "rows": [{"v": str(2**53)}, 7]}


def test_a_drive_root_that_is_not_ascii_labels_its_gauges(tmp_path: Path) -> None:
    roots = [tmp_path / "nvme0-spül", tmp_path / "nvme1"]
    for root in roots:
        Store.open(root, create=True).close()
    proc = script("metrics", *(a for r in roots for a in ("--root", str(r))))
    assert proc.returncode == 0, proc.stderr
    for root in roots:
        assert f'drive="{root}"' in proc.stdout and f'drive="{root}",rank=""}} 1.0' in \
            proc.stdout.replace('spoolctl_store_up{deployment="",', "{"), proc.stdout


def test_json_is_one_line_for_logs_and_indented_for_people(store: Path) -> None:
    piped = script("status", "--root", str(store), "--json")
    assert piped.returncode == 0 and piped.stdout.count("\n") == 1, piped.stdout
    assert json.loads(piped.stdout)["entries"] == 1
    pretty = script("status", "--root", str(store), "--json", "--pretty")
    assert pretty.stdout.count("\n") > 10 and json.loads(pretty.stdout)["entries"] == 1
    main, other = pty.openpty()  # a terminal: indented, as before
    try:
        proc = subprocess.run([SPOOLCTL, "status", "--root", str(store), "--json"],
                              stdout=other, stderr=subprocess.PIPE, env=ENV, timeout=120)
        os.close(other)
        chunks = []
        while True:
            try:
                chunk = os.read(main, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(main)
    shown = b"".join(chunks).decode()
    assert proc.returncode == 0 and shown.count("\n") > 10, shown
