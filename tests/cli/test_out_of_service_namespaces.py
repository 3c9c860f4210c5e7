"""The out-of-service record a vLLM worker keeps beside its rank store is judged alive or
stale by the lock its writer holds, not by its pid and hostname: engines run in containers,
each with its own PID namespace (pid 1 of one is another process in the next) and hostname.

Real processes in real namespaces (``unshare --pid --fork --mount-proc --uts``): a live
holder in another namespace, under another hostname, is alive, and a worker opening the
same rank store does not take its record away; once it is killed, its record is stale,
also when its pid and start time name a live, unrelated process here (two containers'
pid reuse), and the next worker removes it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from operator_cli import run_json

from spoolctl.connector.deployment import out_of_service as oos
from spoolctl.store import Store

pytestmark = pytest.mark.base

_UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--uts", "--kill-child"]
# The holder: an engine's recorder taking the store out, then waiting for the test.
_HOLDER = """
import socket, subprocess, sys
subprocess.run(["hostname", "engine-container"], check=True)
from spoolctl.connector.deployment.out_of_service import OutOfServiceRecorder
recorder = OutOfServiceRecorder(sys.argv[1])
recorder.update(True, "3 restore reads late or failed in a row")
assert recorder.wait(30)
print(socket.gethostname(), flush=True)
sys.stdin.read()
"""


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None or shutil.which("hostname") is None:
        return False
    proc = subprocess.run([*_UNSHARE, "true"], capture_output=True, timeout=30)
    return proc.returncode == 0


needs_unshare = pytest.mark.skipif(not _namespaces_work(),
                                   reason="needs unshare of PID and UTS namespaces (root)")


def _status(rank: Path) -> dict:
    return run_json("status", "--root", str(rank))["out_of_service"]


@needs_unshare
def test_a_holder_in_another_pid_namespace_is_judged_by_its_lock(tmp_path: Path) -> None:
    rank = tmp_path / "deploy" / "rank-0000"
    rank.parent.mkdir()
    Store.open(rank, create=True).close()
    holder = subprocess.Popen([*_UNSHARE, sys.executable, "-c", _HOLDER, str(rank)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "engine-container"
        doc = json.loads(oos.record_path(rank).read_text())
        assert doc["pid"] == 1 and doc["host"] == "engine-container"  # names nothing here
        out = _status(rank)
        assert out["stale"] is False, out
        # A worker opening the rank store here clears a previous engine's record, not a
        # live one's.
        here = oos.OutOfServiceRecorder(rank)
        here.update(False)
        assert here.wait(30)
        assert oos.record_path(rank).exists() and _status(rank)["stale"] is False
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # unshare; --kill-child takes the holder along
        holder.wait(30)
    out = _status(rank)
    assert out["stale"] is True, out
    # Two containers' pid reuse: the dead holder's pid and start time now name a live,
    # unrelated process of this namespace. The free lock still says the holder is gone.
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        doc = json.loads(oos.record_path(rank).read_text())
        doc.update(pid=other.pid, host=__import__("socket").gethostname(),
                   started=oos.process_started(other.pid))
        oos.record_path(rank).write_text(json.dumps(doc))
        assert _status(rank)["stale"] is True
    finally:
        other.kill()
        other.wait(30)
    here = oos.OutOfServiceRecorder(rank)
    here.update(False)  # the next engine's start removes a dead holder's record
    assert here.wait(30)
    assert not oos.record_path(rank).exists() and not oos.lock_path(rank).exists()
    assert "out_of_service" not in run_json("status", "--root", str(rank))


def test_a_record_of_an_older_writer_is_judged_by_pid_on_its_host(tmp_path: Path) -> None:
    """A record without a lock file (written before the lock) keeps the old judgement: by
    pid and start time on the host that wrote it, cannot tell elsewhere."""
    rank = tmp_path / "deploy" / "rank-0000"
    rank.parent.mkdir()
    Store.open(rank, create=True).close()
    base = {"schema": oos.SCHEMA, "since": 1.0, "reason": "r", "pid": os.getpid(),
            "host": __import__("socket").gethostname(),
            "started": oos.process_started(os.getpid()) or 0}
    oos.record_path(rank).write_text(json.dumps(base))
    assert oos.read(rank)["stale"] is False
    oos.record_path(rank).write_text(json.dumps({**base, "started": 1}))
    assert oos.read(rank)["stale"] is True
    oos.record_path(rank).write_text(json.dumps({**base, "host": "elsewhere"}))
    assert oos.read(rank)["stale"] is None
