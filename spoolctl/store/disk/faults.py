"""Named durability checkpoints for crash testing.

Every durability step of the store calls ``checkpoint(name)`` with a name from
``CHECKPOINTS`` (any other name is refused). In production this is two set lookups.
A test sets ``SPOOLCTL_CRASH_AT=<name>`` (optionally ``<name>:<n>`` to crash at the
n-th pass) in a subprocess, which then dies with
``os._exit(CRASH_EXIT_CODE)`` exactly there, like a power cut or kill -9
(no cleanup handlers, no buffered writes flushed).
"""

from __future__ import annotations

import errno
import os

CRASH_EXIT_CODE = 86
ENV = "SPOOLCTL_CRASH_AT"
# ``SPOOLCTL_FAIL_AT=<name>:<ENOSPC|EIO|...>`` raises that OSError at the checkpoint instead,
# to prove a disk error there leaves the store consistent.
FAIL_ENV = "SPOOLCTL_FAIL_AT"
# ``SPOOLCTL_PAUSE_AT=<name>:<dir>`` stops at the checkpoint until a test has acted there: the
# process writes a line to the FIFO ``<dir>/reached``, then waits for a line on the FIFO
# ``<dir>/resume``. This makes a race deterministic (a store writer swapping a directory
# for a symlink between root's listing and its unlinks, issue 35.1), without sleeps.
PAUSE_ENV = "SPOOLCTL_PAUSE_AT"

# Every checkpoint the store passes, by operation. ``checkpoint()`` refuses any other name, so
# this list cannot go stale: a new durability step must be named here to run at all.
# A commit (``Store.put``, ``Store.put_many``, an import) passes them in this order, each
# once per object, manifest or directory of the batch (``commit``): crash at the n-th pass
# with ``<name>:<n>`` to stop in the middle of a step of a batch.
COMMIT_CHECKPOINTS: tuple[str, ...] = (
    "object.tmp_written", "manifest.tmp_written", "catalog.intent", "object.fsynced",
    "manifest.fsynced", "object.published", "object.dir_fsynced",
    "manifest.published", "manifest.dir_fsynced", "catalog.committed",
)
DELETE_CHECKPOINTS: tuple[str, ...] = tuple(
    f"{step}.{point}" for step in ("clean", "evict")
    for point in ("manifest_deleted", "catalog_deleted", "object_deleted"))
QUARANTINE_CHECKPOINTS: tuple[str, ...] = ("quarantine.catalog_deleted", "quarantine.moved")
SCRUB_CHECKPOINTS: tuple[str, ...] = ("scrub.progress_saved",)
# Between a listing and the deletions it chose (``gc.clean_tmp``, a quarantine purge): where
# a swap would race.
RACE_CHECKPOINTS: tuple[str, ...] = ("tmp.listed", "quarantine.listed")
# An export after each entry it wrote to the archive: where a signal stops it mid-stream
# (tests of what an interrupted export leaves behind, decision 2310).
TRANSFER_CHECKPOINTS: tuple[str, ...] = ("export.entry_written",)
# Creating a store (``root.create_or_adopt``): the layout is made, the marker is not yet;
# the marker's draft is written in ``tmp/``, not yet renamed.
INIT_CHECKPOINTS: tuple[str, ...] = ("init.layout_made", "init.marker_drafted")
# Migrating an older catalog: its steps are done, the transaction not yet committed.
# Upgrading an older store: the hint log renamed into place (its transaction open), then
# committed with the marker not yet requiring it.
CATALOG_CHECKPOINTS: tuple[str, ...] = ("catalog.migrated", "catalog.hints_seeded",
                                        "upgrade.hints_seeded")
CHECKPOINTS: frozenset[str] = frozenset(
    COMMIT_CHECKPOINTS + DELETE_CHECKPOINTS + QUARANTINE_CHECKPOINTS + SCRUB_CHECKPOINTS
    + RACE_CHECKPOINTS + TRANSFER_CHECKPOINTS + INIT_CHECKPOINTS + CATALOG_CHECKPOINTS)

_target: str | None = None
_countdown = 0
_fail: tuple[str, int] | None = None
_pause: tuple[str, str] | None = None


def _load() -> None:
    global _target, _countdown, _fail, _pause
    pause = os.environ.get(PAUSE_ENV)
    if pause:
        point, _, directory = pause.partition(":")
        _known(point, PAUSE_ENV)
        _pause = (point, directory)
    else:
        _pause = None
    fail = os.environ.get(FAIL_ENV)
    if fail:
        point, _, code = fail.partition(":")
        _known(point, FAIL_ENV)
        _fail = (point, int(getattr(errno, code or "EIO")))
    else:
        _fail = None
    spec = os.environ.get(ENV)
    if not spec:
        _target = None
        return
    name, _, count = spec.partition(":")
    _known(name, ENV)
    _target = name
    _countdown = int(count) if count else 1


def _known(name: str, where: str) -> None:
    if name not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {name!r} (in {where}); "
                         f"known: {', '.join(sorted(CHECKPOINTS))}")


_load()


def checkpoint(name: str) -> None:
    """Mark a durability step; die here if a test asked for it.

    Raises ValueError for a name not in ``CHECKPOINTS`` (a step nobody can crash-test).
    """
    global _countdown
    if name not in CHECKPOINTS:
        _known(name, "checkpoint()")
    if _fail is not None and name == _fail[0]:
        raise OSError(_fail[1], os.strerror(_fail[1]))
    if _pause is not None and name == _pause[0]:
        _wait_here(_pause[1])
    if _target is None or name != _target:
        return
    _countdown -= 1
    if _countdown <= 0:
        os._exit(CRASH_EXIT_CODE)


def _wait_here(directory: str) -> None:
    """Tell the test this checkpoint is reached and wait until it says to go on (each
    FIFO open blocks until the test opens the other end)."""
    with open(os.path.join(directory, "reached"), "w") as f:
        f.write("reached\n")
    with open(os.path.join(directory, "resume")) as f:
        f.readline()


def reload() -> None:
    """Re-read the environment (for in-process unit tests)."""
    _load()
