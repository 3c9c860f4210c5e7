"""Issue 49 item 3: output is written whole, or the command fails with exit 3.

On a real, small tmpfs filled up to the last page (another program's files), each command
runs as its own process:

* ``ls --json > FILE`` with ``PYTHONUNBUFFERED=1`` (common in container images; the tests'
  environment sets it): Python's unbuffered stdout dropped the rest of a short write, so a
  cut document was left and the exit code was 0. Now: exit 3, one line naming stdout.
* ``metrics --textfile``: one ``os.write`` wrote a cut exposition and renamed it into place
  (node_exporter served half the gauges). Now: exit 3, the previous file unchanged, no temp
  file left.
* ``export -o /dev/full`` and ``export -o FILE`` on the full disk: exit 3 (was 2, usage),
  no archive and no ``.part`` left.
* ``ls --json | head -c 10``: the reader goes away; exit 141 and nothing on stderr, as any
  filter killed by SIGPIPE.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from operator_cli import ENV, SPOOLCTL, script
from test_operator_full_disk import fill

from spoolctl.store import Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

SLACK = 4096  # one page left free: less than every output below


def _fill_leaving(fs: Path, slack: int = SLACK) -> None:
    """Fill ``fs`` (another program's files) so that exactly ``slack`` bytes stay free."""
    keep = fs / "slack"
    keep.write_bytes(b"\0" * slack)
    fill(fs)
    keep.unlink()
    assert 0 < os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize <= slack


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    with Store.open(root, create=True) as s:
        for i in range(40):
            s.put(kind="pytorch", namespace="ns", key=f"key-{i}", objects={"kv": b"x" * 64})
    return root


def _one_output_line(proc: subprocess.CompletedProcess, where: str) -> None:
    assert proc.returncode == 3, (proc.returncode, proc.stderr)
    err = proc.stderr if isinstance(proc.stderr, str) else proc.stderr.decode()
    assert err.count("\n") == 1 and "cannot write the output" in err and where in err, err
    assert "unexpected" not in err and "Traceback" not in err


def test_stdout_on_a_full_disk_is_exit_3_not_a_cut_document(store: Path, mount_tmpfs) -> None:
    fs = mount_tmpfs("1m")
    _fill_leaving(fs)
    out = fs / "ls.json"
    with open(out, "w") as f:
        proc = subprocess.run([SPOOLCTL, "ls", "--root", str(store), "--json"], stdout=f,
                              stderr=subprocess.PIPE, text=True, env=ENV, timeout=120)
    _one_output_line(proc, "stdout")
    assert ENV.get("PYTHONUNBUFFERED") == "1"  # the case that silently cut it


def test_metrics_textfile_is_never_replaced_by_a_cut_one(store: Path, mount_tmpfs) -> None:
    fs = mount_tmpfs("1m")
    prom = fs / "spoolctl.prom"
    assert script("metrics", "--root", str(store), "--textfile", str(prom)).returncode == 0
    before = prom.read_bytes()
    assert len(before) > SLACK
    with Store.open(store) as s:  # the next exposition differs: the file must not change
        s.put(kind="pytorch", namespace="ns", key="one-more", objects={"kv": b"y"})
    _fill_leaving(fs)
    proc = script("metrics", "--root", str(store), "--textfile", str(prom))
    _one_output_line(proc, str(prom))
    assert prom.read_bytes() == before
    assert sorted(p.name for p in fs.iterdir() if not p.name.startswith("filler-")) == \
        ["spoolctl.prom"]


def test_export_to_a_full_output_is_exit_3_and_leaves_nothing(store: Path,
                                                               mount_tmpfs) -> None:
    if os.path.exists("/dev/full"):
        _one_output_line(script("export", "--root", str(store), "-o", "/dev/full"),
                         "/dev/full")
        with open("/dev/full", "wb") as full:
            proc = subprocess.run([SPOOLCTL, "export", "--root", str(store)], stdout=full,
                                  stderr=subprocess.PIPE, text=True, env=ENV, timeout=120)
        _one_output_line(proc, "stdout")
    fs = mount_tmpfs("1m")
    _fill_leaving(fs)
    target = fs / "replica.tar"
    _one_output_line(script("export", "--root", str(store), "-o", str(target)), str(target))
    assert not [p for p in fs.iterdir() if not p.name.startswith("filler-")]


def test_a_reader_that_goes_away_is_exit_141_and_silent(store: Path) -> None:
    with Store.open(store) as s:  # a document larger than a pipe's buffer (64 KiB)
        for i in range(300):
            s.put(kind="pytorch", namespace="ns", key=f"more-{i}", objects={"kv": b"z"})
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash for `set -o pipefail`")
    proc = subprocess.run([bash, "-o", "pipefail", "-c", '"$0" "$@" | head -c 10 >/dev/null',
                           SPOOLCTL, "ls", "--root", str(store), "--json", "--limit", "10000"],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 141, proc
    assert proc.stderr == "", proc.stderr
