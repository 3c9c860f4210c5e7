"""Mounting ``tests/fusefs.py`` (a FUSE filesystem the tests control) over a directory, and
always taking it down again: ``ControlledMount`` copies the directory's contents to a
backing directory, mounts the filesystem over it and tells it to fail (``eio``) or block
(``hang``) on command. ``close`` releases every hung operation first (they complete), then
unmounts lazily (``fusermount3 -u -z``) and ends the daemon, killing it if it does not exit
(the kernel then fails whatever still waits on the mount with ENOTCONN): no test can leave
a process, or the suite, stuck on it. ``Mounts`` holds a test's mounts (the ``fuse`` fixture
of ``tests/store/test_disk_faults.py``) and ``skip_without_fuse`` skips where FUSE cannot mount.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_until

HERE = Path(__file__).parent
# Where mfusepy is when it is not in the test environment itself (a local check).
FUSE_PATH = os.environ.get("SPOOLCTL_TEST_FUSE_PATH", "")


@functools.cache
def fuse_missing() -> str | None:
    """Why a FUSE mount cannot be made on this host (a skip reason), or None (asked once
    per process)."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this host"
    if shutil.which("fusermount3") is None:
        return "fusermount3 missing (Debian fuse3; scripts/ci_tools.sh installs it)"
    env = {**os.environ, "PYTHONPATH": FUSE_PATH}
    if subprocess.run([sys.executable, "-c", "import mfusepy"], env=env,
                      capture_output=True).returncode:
        return "mfusepy not importable (the dev extra installs it)"
    return None


def skip_without_fuse() -> None:
    """Skip the calling test (or fixture) where a FUSE mount cannot be made."""
    missing = fuse_missing()
    if missing:
        pytest.skip(missing)


class ControlledMount:
    """``tests/fusefs.py`` mounted over ``directory`` (its contents moved to a backing
    directory next to ``work``). A context manager; ``close`` is idempotent."""

    def __init__(self, directory: Path, work: Path):
        self.mount = Path(directory)
        work.mkdir(parents=True, exist_ok=True)
        self.backing = work / f"backing-{self.mount.name}"
        self.control = work / f"control-{self.mount.name}"
        self.control.write_text("")
        shutil.copytree(self.mount, self.backing, symlinks=True)
        for child in list(self.mount.iterdir()):
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() \
                else child.unlink()
        self._daemon: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, str(HERE / "fusefs.py"), str(self.backing), str(self.mount),
             str(self.control)], env={**os.environ, "PYTHONPATH": FUSE_PATH},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: os.path.ismount(self.mount), what="the FUSE mount")
        except BaseException:
            self.close()
            raise

    def _set(self, lines: list[str]) -> None:
        tmp = self.control.with_suffix(".new")
        tmp.write_text("".join(f"{line}\n" for line in lines))
        os.replace(tmp, self.control)  # the daemon never reads half a file

    def eio(self, *patterns: str) -> None:
        """Opens and reads of paths containing one of ``patterns`` fail with EIO."""
        self._set(list(patterns))

    def hang(self, pattern: str = "/") -> None:
        """Every operation on paths containing ``pattern`` blocks (``/``: all of them)."""
        self._set([f"hang {pattern}"])

    def refuse_links(self) -> None:
        """Hard links fail with EPERM (a filesystem without them); the rest passes through."""
        self._set(["nolink"])

    def release(self) -> None:
        """The disk works again: hung operations complete, nothing fails."""
        self._set([])

    def close(self) -> None:
        if self._daemon is None:
            return
        daemon, self._daemon = self._daemon, None
        self.release()
        subprocess.run(["fusermount3", "-u", "-z", str(self.mount)], capture_output=True)
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=10)

    def __enter__(self) -> ControlledMount:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Mounts:
    """The mounts of one test: ``over(directory)`` mounts ``tests/fusefs.py`` over it (each
    mount's backing and control files in its own folder under ``work``); ``close`` takes
    them all down, the last made first. Skips the test where FUSE cannot mount. A context
    manager."""

    def __init__(self, work: Path):
        skip_without_fuse()
        self._work = work
        self._made = 0
        self._stack = contextlib.ExitStack()

    def over(self, directory: Path) -> ControlledMount:
        self._made += 1
        return self._stack.enter_context(ControlledMount(directory, self._work / str(self._made)))

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Mounts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
