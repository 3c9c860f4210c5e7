"""The tests' fault injection at the store's durability checkpoints (``faults.install``).

The product reads no environment variable for this: a process the tests start loads this
module through ``tests/faultboot/sitecustomize.py`` (conftest puts that directory on the
children's ``PYTHONPATH``; ``scripts/crash_matrix.py`` does the same), which reads the
variables below and installs the hook. A ``spoolctl`` started any other way -- root's
cron, a service -- never sees them.

* ``SPOOLCTL_CRASH_AT=<name>[:<n>]``: die with ``os._exit(CRASH_EXIT_CODE)`` at the n-th
  pass of checkpoint ``name`` (no cleanup handlers, no buffered writes flushed: a power cut);
* ``SPOOLCTL_FAIL_AT=<name>:<ENOSPC|EIO|...>``: raise that OSError there instead;
* ``SPOOLCTL_PAUSE_AT=<name>:<dir>``: at the checkpoint, write a line to the FIFO
  ``<dir>/reached``, then wait for a line on the FIFO ``<dir>/resume`` (a race made
  deterministic; both opened without following a symlink).

In-process tests call ``install(...)`` and ``uninstall()`` directly.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping

from spoolctl.store.disk import faults

CRASH_EXIT_CODE = 86
CRASH_ENV = "SPOOLCTL_CRASH_AT"
FAIL_ENV = "SPOOLCTL_FAIL_AT"
PAUSE_ENV = "SPOOLCTL_PAUSE_AT"
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class _Seam:
    def __init__(self, crash_at: str | None, fail_at: str | None, pause_at: str | None):
        self.crash: tuple[str, int] | None = None
        self.fail: tuple[str, int] | None = None
        self.pause: tuple[str, str] | None = None
        if crash_at:
            name, _, count = crash_at.partition(":")
            faults.known(name, CRASH_ENV)
            self.crash = (name, int(count) if count else 1)
        if fail_at:
            name, _, code = fail_at.partition(":")
            faults.known(name, FAIL_ENV)
            self.fail = (name, int(getattr(errno, code or "EIO")))
        if pause_at:
            name, _, directory = pause_at.partition(":")
            faults.known(name, PAUSE_ENV)
            self.pause = (name, directory)

    def __call__(self, name: str) -> None:
        if self.fail is not None and name == self.fail[0]:
            raise OSError(self.fail[1], os.strerror(self.fail[1]))
        if self.pause is not None and name == self.pause[0]:
            _wait_here(self.pause[1])
        if self.crash is not None and name == self.crash[0]:
            left = self.crash[1] - 1
            self.crash = (name, left)
            if left <= 0:
                os._exit(CRASH_EXIT_CODE)


def _wait_here(directory: str) -> None:
    """Tell the test the checkpoint is reached and wait until it says to go on (each FIFO
    open blocks until the test opens the other end)."""
    fd = os.open(os.path.join(directory, "reached"), os.O_WRONLY | _O_NOFOLLOW)
    with os.fdopen(fd, "w") as f:
        f.write("reached\n")
    fd = os.open(os.path.join(directory, "resume"), os.O_RDONLY | _O_NOFOLLOW)
    with os.fdopen(fd) as f:
        f.readline()


def install(*, crash_at: str | None = None, fail_at: str | None = None,
            pause_at: str | None = None) -> None:
    """Act at the named checkpoints in this process (see the module docstring for the
    forms); ValueError for a name that is not a checkpoint."""
    if crash_at or fail_at or pause_at:
        faults.install(_Seam(crash_at, fail_at, pause_at))
    else:
        faults.install(None)


def uninstall() -> None:
    faults.install(None)


def install_from_env(environ: Mapping[str, str]) -> None:
    """``install`` from the variables of a process the tests started."""
    install(crash_at=environ.get(CRASH_ENV), fail_at=environ.get(FAIL_ENV),
            pause_at=environ.get(PAUSE_ENV))
