"""Synchronising tests without sleeping for order: one polling wait, one test clock, and a
process held at a store checkpoint."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest


def wait_until(condition: Callable[[], object], timeout: float = 30.0, *,
               what: str = "the condition", interval: float = 0.01) -> object:
    """Poll ``condition`` until it returns something truthy, and return that; fail the test
    naming ``what`` after ``timeout`` seconds. The poll interval only bounds how soon a met
    condition is seen: no test result depends on it."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} was not reached within {timeout:g} s")
        time.sleep(interval)


class StepClock:
    """A wall clock for ``Store.open(clock=...)`` that moves ``step`` seconds at every
    reading, from the real time it was made: every timestamp it gives is distinct and
    ordered like the calls, whatever the timer's resolution."""

    def __init__(self, step: float = 1.0, start: float | None = None) -> None:
        self.step = step
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def wait_for_server(url: str, proc, log: Callable[[], str], timeout: float) -> None:
    """Wait until ``url`` answers 200 while ``proc`` runs; fail with the server's log tail
    when it exits or does not come up (and kill it then)."""
    import urllib.error
    import urllib.request

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    try:
        wait_until(up, timeout, what=f"{url} answering", interval=1.0)
    except AssertionError:
        if proc.poll() is None:
            proc.kill()
            raise AssertionError(f"server not ready after {timeout:g} s:\n{log()[-4000:]}") \
                from None
        raise


class Paused:
    """A process stopped at a store checkpoint (``SPOOLCTL_PAUSE_AT``) until ``resume`` (or a
    signal). ``env`` is the variable to add to that process's environment; the FIFOs live in
    a new directory under ``base`` (default: the system's temp directory)."""

    def __init__(self, point: str, base: Path | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="spool-pause-", dir=base))
        os.mkfifo(self.dir / "reached")
        os.mkfifo(self.dir / "resume")
        self.env = {"SPOOLCTL_PAUSE_AT": f"{point}:{self.dir}"}

    def wait_reached(self, proc: subprocess.Popen) -> None:
        """Block until ``proc`` is at the checkpoint; fail if it exits first."""
        got: list[str] = []
        reader = threading.Thread(
            target=lambda: got.append((self.dir / "reached").read_text()), daemon=True)
        reader.start()
        while reader.is_alive():
            reader.join(0.1)
            if proc.poll() is not None and reader.is_alive():
                os.close(os.open(self.dir / "reached", os.O_WRONLY | os.O_NONBLOCK))
                reader.join()
                _out, err = proc.communicate()
                pytest.fail(f"exited ({proc.returncode}) before the checkpoint: {err}")
        assert got == ["reached\n"]

    def resume(self) -> None:
        (self.dir / "resume").write_text("go\n")

