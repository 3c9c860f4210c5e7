"""What a command acts on: ``--root`` resolved into the stores under it, and a user-typed
entry id resolved into an entry.

A ``--root`` names either one store (a directory with a ``.spoolctl-root`` marker, or one
to be created), or a vLLM deployment directory ``<base>/<deployment digest>`` holding one
``rank-NNNN`` store per rank (the connector's layout, ``spoolctl.connector.topology``).
``resolve_targets`` is the one place that tells them apart; a command that acts on every
store it names loops over ``Targets.stores`` and reports per store.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from spoolctl.store import (
    ConfigError,
    CorruptionError,
    NotFoundError,
    QuarantineReason,
    Store,
)
from spoolctl.store.root import MARKER

from .common import resolve_root


@dataclass(frozen=True)
class StoreTarget:
    """One store to act on; ``rank`` is set for a rank store of a deployment directory."""

    root: Path
    rank: int | None = None


@dataclass(frozen=True)
class Targets:
    """What a ``--root`` names: ``kind`` "store" (one store) or "deployment" (its ranks)."""

    given: Path
    kind: Literal["store", "deployment"]
    stores: tuple[StoreTarget, ...]


def rank_stores(path: Path) -> dict[int, Path]:
    """The ``rank-NNNN`` store directories directly under ``path`` (none if ``path`` is
    itself a store or not a directory). Symlinks are never followed."""
    from spoolctl.connector.topology import rank_of_dirname  # pure; the layout's one owner

    if not path.is_dir() or (path / MARKER).exists():
        return {}
    found = {}
    for child in path.iterdir():
        rank = rank_of_dirname(child.name)
        if rank is not None and child.is_dir() and not child.is_symlink():
            found[rank] = child
    return found


def resolve_targets(root: Path | None) -> Targets:
    """Resolve ``--root`` (default: ``$SPOOLCTL_ROOT`` or the user's store) into stores.

    A path that is neither a store nor a deployment directory is returned as one store,
    so that opening it reports what is wrong with it.
    """
    path = resolve_root(root)
    ranks = rank_stores(path)
    if ranks:
        return Targets(path, "deployment",
                       tuple(StoreTarget(p, rank) for rank, p in sorted(ranks.items())))
    return Targets(path, "store", (StoreTarget(path),))


def resolve_entry(store: Store, text: str) -> str:
    """Resolve a user-typed id/prefix; an unknown one is a usage error (exit 2), except
    that an entry now in quarantine is a finding (exit 1) naming the item."""
    try:
        entry_id = store.resolve(text)
        if store.row(entry_id) is not None:
            return entry_id
    except NotFoundError:
        pass
    for item in store.quarantine_items():
        if item.entry_id and item.entry_id.startswith(text):
            raise CorruptionError(
                f"entry {item.entry_id[:16]} is quarantined ({item.reason})",
                reason=_reason(item.reason), path=item.path, entry_id=item.entry_id,
                fix=f"see `spoolctl quarantine show {item.item_id}`")
    raise ConfigError(f"no entry {text[:64]} in the store", path=store.root,
                      fix="list entries with `spoolctl ls`")


def _reason(value: str) -> QuarantineReason:
    try:
        return QuarantineReason(value)
    except ValueError:
        return QuarantineReason.UNKNOWN
