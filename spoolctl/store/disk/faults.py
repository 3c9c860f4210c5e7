"""Named durability checkpoints, and the hook tests use to act at one.

Every durability step of the store calls ``checkpoint(name)`` with a name from
``CHECKPOINTS``. No hook is installed in a product process, and nothing here reads the
environment, so no variable can crash, fail or pause root's maintenance; the test suite
installs one (``tests/faultseam.py``).
"""

from __future__ import annotations

from collections.abc import Callable

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
# An export after each entry it wrote to the archive: where a signal stops it mid-stream.
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

Hook = Callable[[str], None]
_hook: Hook | None = None


def install(hook: Hook | None) -> None:
    """Call ``hook(name)`` at every checkpoint from now on (None: none). For test harnesses:
    nothing in spoolctl installs one."""
    global _hook
    _hook = hook


def checkpoint(name: str) -> None:
    """Mark a durability step (and call the installed hook, if any).

    Raises ValueError for a name not in ``CHECKPOINTS`` (a step nobody can crash-test).
    """
    if name not in CHECKPOINTS:
        known(name, "checkpoint()")
    if _hook is not None:
        _hook(name)


def known(name: str, where: str) -> None:
    """ValueError unless ``name`` is a checkpoint (``where`` says who named it)."""
    if name not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {name!r} (in {where}); "
                         f"known: {', '.join(sorted(CHECKPOINTS))}")
