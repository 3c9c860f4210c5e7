"""Issue 30.3 and 30.11: a long-running command stopped by Ctrl-C (SIGINT) or SIGTERM stops
at once, says what it did, exits 130 / 143 (decision 2310) and leaves nothing behind.

Real processes and real signals (only a process shows them). Where the signal lands is made
deterministic without sleeps: a fake OpenAI server holds every request until the test ends,
and the store's pause checkpoints (``SPOOLCTL_PAUSE_AT``) stop a command at a named step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI, prompt_tokens
from operator_cli import ENV, SPOOLCTL, run_json
from transfer_support import fill
from waiting import Paused

from spoolctl.store import Store


def start(*argv: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([SPOOLCTL, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, env={**ENV, **(env or {})})


# -- 30.3: prefill --server ----------------------------------------------------------------


def test_prefill_server_stops_at_ctrl_c_and_reports_what_it_did(tmp_path: Path) -> None:
    """80 prompts, 2 in flight, the server never answers: SIGINT stops at once (nothing more
    sent, the two in flight not waited for), prints the report, exits 130. Before: every
    remaining prompt was still sent and the process waited for all of them."""
    arrived = threading.Semaphore(0)
    gate = threading.Event()

    def complete(body: dict, _attempt: int):
        arrived.release()
        gate.wait(120)
        return 200, {"usage": {"prompt_tokens": prompt_tokens(body)}}

    fake = FakeOpenAI(complete)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(f"prompt number {i}") + "\n" for i in range(80)))
    try:
        proc = start("prefill", "--server", fake.url, "--prompts-file", str(prompts),
                     "--concurrency", "2", "--json")
        for _ in range(2):
            assert arrived.acquire(timeout=60), proc.communicate(timeout=5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        sent = len(fake.bodies)
    finally:
        gate.set()
        fake.close()
    assert proc.returncode == 130, (out, err)
    doc = json.loads(out)
    assert doc["interrupted"] is True
    assert (doc["ok"], doc["abandoned"], doc["not_sent"]) == (0, 2, 78)
    assert sent == 2  # nothing was sent after the signal
    assert "interrupted (SIGINT): 0 prompts prefilled, 78 not sent, 2 in flight" in err
    assert "Traceback" not in err


# -- 30.3 / 30.11: export, import, scrub, clean -----------------------------------------------


@pytest.fixture
def source(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    fill(root, 6, size=2000)
    return root


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_export_to_a_file_leaves_no_part_file(
        tmp_path: Path, source: Path, sig: signal.Signals, code: int) -> None:
    """Before: SIGTERM killed the process without cleanup, leaving ``.out.tar.<pid>.part``."""
    out = tmp_path / "out" / "archive.tar"
    out.parent.mkdir()
    pause = Paused("export.entry_written")
    proc = start("export", "--root", str(source), "-o", str(out), env=pause.env)
    pause.wait_reached(proc)
    proc.send_signal(sig)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert list(out.parent.iterdir()) == []  # neither the archive nor a hidden .part
    assert (f"interrupted ({sig.name}): export stopped after 1 entries; no archive written"
            in err)


def test_ctrl_c_during_import_keeps_what_was_committed(tmp_path: Path, source: Path) -> None:
    archive = tmp_path / "a.tar"
    run_json("export", "--root", str(source), "-o", str(archive))
    target = tmp_path / "dst"
    pause = Paused("catalog.committed")
    proc = start("import", str(archive), "--root", str(target), env=pause.env)
    pause.wait_reached(proc)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted (SIGINT): import stopped" in err and "Traceback" not in err
    with Store.open(target) as st:
        rows = st.entries()
        for row in rows:  # what is listed is whole
            st.read_all(st.manifest(row.entry_id))
    assert not any((target / "tmp").iterdir())


def test_ctrl_c_during_scrub_until_complete_exits_130(tmp_path: Path, source: Path) -> None:
    pause = Paused("scrub.progress_saved")
    proc = start("scrub", "--root", str(source), "--until-complete", "--max-items", "1",
                 env=pause.env)
    pause.wait_reached(proc)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted (SIGINT)" in err and "Traceback" not in err


def test_interrupted_clean_then_ls_agrees_with_inspect(tmp_path: Path, source: Path) -> None:
    """30.11: SIGINT after clean deleted the first manifest, before the catalog rows: ``ls``
    must not list an entry ``inspect`` says does not exist. Before: it did."""
    with Store.open(source) as st:
        ids = [r.entry_id for r in st.entries()]
        for entry_id in ids[:3]:
            st.release(entry_id)
    pause = Paused("clean.manifest_deleted")
    proc = start("clean", "--released", "--yes", "--root", str(source), env=pause.env)
    pause.wait_reached(proc)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    listed = [e["entry_id"] for e in run_json("ls", "--root", str(source))["entries"]]
    for entry_id in listed:
        run_json("inspect", entry_id, "--root", str(source))  # exit 0: it exists
    assert len(listed) >= 3  # the retained ones
    run_json("clean", "--released", "--yes", "--root", str(source))
    assert len(run_json("ls", "--root", str(source))["entries"]) == 3


# Ctrl-C while the CLI is still importing: made deterministic by an import hook that
# raises KeyboardInterrupt (what SIGINT does) when the CLI module is imported.
_INTERRUPT_AT_IMPORT = """
import sys

class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "spoolctl.cli.app":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, Interrupt())
sys.argv = ["spoolctl", "status"]
import runpy
runpy.run_module("spoolctl", run_name="__main__")
"""


def test_ctrl_c_while_the_cli_is_importing_exits_130_without_a_traceback(
        tmp_path: Path) -> None:
    """The console script's entry (``spoolctl`` and ``python -m spoolctl``) turns a Ctrl-C
    in the second the CLI takes to import into one line and exit 130. Before: a Python
    traceback ending in KeyboardInterrupt."""
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLCTL_")}
    proc = subprocess.run([sys.executable, "-c", _INTERRUPT_AT_IMPORT], capture_output=True,
                          text=True, timeout=60, env=env, cwd=tmp_path)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("interrupted (SIGINT): stopped before the command "
                                   "started; nothing was done")
