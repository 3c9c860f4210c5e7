"""Fault injection is unreachable from a product process (issue 47, item 8).

The crash, failure and pause points the tests use were environment variables the product
read: anyone who could set root's environment could crash maintenance mid-commit, and the
pause wrote its FIFO with a plain ``open(..., "w")`` that followed a symlink. Now the
product has a no-op hook registry (``faults.install``) and the tests install their seam
(``tests/faultseam.py``) through their own bootstrap. Real ``spoolctl`` processes started
as cron starts them: without the tests' bootstrap on their path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAULT_BOOT, REPO

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

SPOOLCTL = str(Path(sys.executable).with_name("spoolctl"))
VARIABLES = ("SPOOLCTL_CRASH_AT", "SPOOLCTL_FAIL_AT", "SPOOLCTL_PAUSE_AT")


def _product_env(**extra: str) -> dict[str, str]:
    """The environment of a spoolctl the tests did not instrument (no fault bootstrap)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLCTL_")}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != FAULT_BOOT]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env | extra


def test_the_package_reads_none_of_the_fault_variables() -> None:
    hits = [f"{path.relative_to(REPO)}: {name}"
            for path in sorted((REPO / "spoolctl").rglob("*.py"))
            for name in ("CRASH_AT", "FAIL_AT", "PAUSE_AT")
            if name in path.read_text(errors="replace")]
    assert hits == []
    faults_src = (REPO / "spoolctl" / "store" / "disk" / "faults.py").read_text()
    assert "os.environ" not in faults_src and "getenv" not in faults_src


@pytest.mark.parametrize(("variable", "value"), [
    ("SPOOLCTL_CRASH_AT", "init.layout_made"),
    ("SPOOLCTL_CRASH_AT", "catalog.intent"),
    ("SPOOLCTL_FAIL_AT", "init.marker_drafted:EIO"),
    ("SPOOLCTL_FAIL_AT", "tmp.listed:ENOSPC"),
])
def test_a_product_process_ignores_crash_and_fail_points(tmp_path: Path, variable: str,
                                                         value: str) -> None:
    root = Path(os.path.realpath(tmp_path)) / "store"
    env = _product_env(**{variable: value})
    for argv in (["init", "--root", str(root)], ["clean", "--tmp", "--yes", "--root", str(root)],
                 ["status", "--root", str(root)]):
        proc = subprocess.run([SPOOLCTL, *argv], env=env, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (argv, proc.returncode, proc.stderr)
    code = ("from spoolctl.store import Store; import sys\n"
            "with Store.open(sys.argv[1]) as s: s.put(kind='pytorch', namespace='m', key='k',"
            " objects={'kv': b'x' * 99})")
    proc = subprocess.run([sys.executable, "-c", code, str(root)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr  # a commit passes every commit checkpoint


def _planted_link(base: Path) -> tuple[Path, Path]:
    """(victim, trap): ``trap/reached`` is a symlink to the file ``victim``."""
    victim = base / "victim"
    victim.write_text("precious\n")
    trap = base / "trap"
    trap.mkdir()
    (trap / "reached").symlink_to(victim)
    return victim, trap


def test_a_product_process_never_pauses_or_writes_through_a_planted_link(
        tmp_path: Path) -> None:
    """The pause point wrote ``<dir>/reached`` with a plain open: a planted symlink there
    made root write into any file. A product process neither pauses nor writes."""
    base = Path(os.path.realpath(tmp_path))
    victim, trap = _planted_link(base)
    root = base / "store"
    for point in ("init.layout_made", "tmp.listed"):
        env = _product_env(SPOOLCTL_PAUSE_AT=f"{point}:{trap}")
        for argv in (["init", "--root", str(root)],
                     ["clean", "--tmp", "--yes", "--root", str(root)]):
            proc = subprocess.run([SPOOLCTL, *argv], env=env, capture_output=True, text=True,
                                  timeout=60, stdin=subprocess.DEVNULL)
            assert proc.returncode == 0, (argv, proc.stderr)
    assert victim.read_text() == "precious\n"


def test_the_tests_seam_still_crashes_a_process_the_tests_start(tmp_path: Path) -> None:
    """The control: the same variable in a process the tests start (the bootstrap on its
    path, as conftest arranges) crashes it at the checkpoint."""
    from faultseam import CRASH_EXIT_CODE

    root = Path(os.path.realpath(tmp_path)) / "store"
    assert FAULT_BOOT in os.environ["PYTHONPATH"].split(os.pathsep)
    env = {**os.environ, "SPOOLCTL_CRASH_AT": "init.layout_made"}
    proc = subprocess.run([SPOOLCTL, "init", "--root", str(root)], env=env,
                          capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == CRASH_EXIT_CODE, proc.stderr


def test_the_seams_pause_does_not_follow_a_planted_link(tmp_path: Path) -> None:
    """Even in the tests' own processes the pause opens its FIFOs without following a link."""
    base = Path(os.path.realpath(tmp_path))
    victim, trap = _planted_link(base)
    env = {**os.environ, "SPOOLCTL_PAUSE_AT": f"init.layout_made:{trap}"}
    proc = subprocess.run([SPOOLCTL, "init", "--root", str(base / "store")], env=env,
                          capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode != 0 and victim.read_text() == "precious\n"
