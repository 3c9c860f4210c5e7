"""Synchronising tests without sleeping for order: one polling wait and one test clock."""

from __future__ import annotations

import time
from collections.abc import Callable


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
