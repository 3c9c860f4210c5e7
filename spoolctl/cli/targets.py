"""What a command acts on: ``--root`` resolved into the stores under it, and a user-typed
entry id resolved into an entry.

What a ``--root`` is (a store, a vLLM deployment directory, a vLLM base root or an empty
root) is decided by the store's one scanner, ``spoolctl.store.transfer.places.inspect_root``,
with the same kinds and refusals for every command and for the library's export/import/peer
API. This module only narrows (``--rank N``, ``--deployment
NAME``) and applies one CLI rule: a path that does not exist is the one store a command
acts on (``init`` creates it; other commands say it is not a store). Commands loop over
``Targets.stores`` (see ``fanout``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spoolctl.store import ConfigError, CorruptionError, NotFoundError, QuarantineReason

from .common import resolve_root

if TYPE_CHECKING:
    from spoolctl.store import (
        Kind,
        RootContents,
        Store,
        StorePlace,
    )


@dataclass(frozen=True)
class StoreTarget:
    """One store to act on; ``rank`` and ``deployment`` (the deployment directory's name)
    are set for the rank stores of a deployment."""

    root: Path
    rank: int | None = None
    deployment: str | None = None

    @property
    def label(self) -> str:
        """``<deployment>/rank-NNNN`` (or ``rank-NNNN``, or the root) for people."""
        if self.rank is None:
            return str(self.root)
        name = f"rank-{self.rank:04d}"
        return f"{self.deployment}/{name}" if self.deployment else name

    def to_json(self) -> dict[str, Any]:
        return {"root": str(self.root), "rank": self.rank, "deployment": self.deployment}


@dataclass(frozen=True)
class Targets:
    """What a ``--root`` names (``kind``, ``places.inspect_root``'s), the stores to act on,
    and what the scanner found there before narrowing (``contents``)."""

    given: Path
    kind: Kind
    stores: tuple[StoreTarget, ...]
    contents: RootContents | None = None

    @property
    def single(self) -> bool:
        return self.kind == "store"


def targets_json(targets: Targets) -> dict[str, Any]:
    """``targets`` as JSON, for a bounded child to hand back (``disk_deadline``); the
    scanner's ``contents`` stay behind (``targets_from_json`` leaves them None)."""
    return {"given": str(targets.given), "kind": targets.kind,
            "stores": [t.to_json() for t in targets.stores]}


def targets_from_json(doc: dict[str, Any]) -> Targets:
    """The ``Targets`` of ``targets_json`` (without ``contents``)."""
    return Targets(Path(doc["given"]), doc["kind"], tuple(
        StoreTarget(Path(t["root"]), t["rank"], t["deployment"]) for t in doc["stores"]))


def _target(found: StorePlace) -> StoreTarget:
    return StoreTarget(found.path, found.rank, found.deployment)


def resolve_targets(root: Path | str | list[str] | None, *, rank: int | None = None,
                    deployment: str | None = None) -> Targets:
    """Resolve ``--root`` (default: ``$SPOOLCTL_ROOT`` or the user's store) into stores,
    narrowed by ``rank`` / ``deployment``.

    RootError for a path that is none of the kinds (``inspect_root``), ConfigError for
    filters that match nothing or do not apply.
    """
    from spoolctl.store import inspect_root
    contents = inspect_root(resolve_root(root))
    path = contents.path
    if contents.kind == "store" or not contents.exists:
        if rank is not None or deployment is not None:
            raise ConfigError("--rank and --deployment apply to a vLLM base root or "
                              "deployment directory, not to one store", path=path,
                              fix="drop them, or point --root at the base root")
        return Targets(path, "store", (StoreTarget(path),), contents)
    if contents.kind == "empty":
        if deployment is not None or rank is not None:
            raise ConfigError("no vLLM deployment under this root yet", path=path,
                              fix="start the engine first, or drop --rank/--deployment")
        return Targets(path, "empty", (), contents)
    if contents.kind == "deployment" and deployment is not None:
        raise ConfigError("--deployment applies to a vLLM base root; --root is already "
                          "one deployment directory", path=path, fix="drop --deployment")
    groups: dict[str, dict[int, StorePlace]] = {}
    for found in contents.stores:
        groups.setdefault(found.deployment or "", {})[found.rank or 0] = found
    return Targets(path, contents.kind, _narrow(path, groups, rank, deployment), contents)


def _narrow(base: Path, groups: dict[str, dict[int, StorePlace]], rank: int | None,
            deployment: str | None) -> tuple[StoreTarget, ...]:
    from spoolctl.store import resolve_deployment
    if deployment is not None:
        try:
            name = resolve_deployment(deployment, groups)
        except ConfigError as exc:
            raise ConfigError(exc.message, path=base, fix=exc.fix) from None
        groups = {name: groups[name]}
    out = [_target(found)
           for name in sorted(groups) for r, found in sorted(groups[name].items())
           if rank is None or r == rank]
    if not out:
        have = sorted({r for g in groups.values() for r in g})
        raise ConfigError(f"no store for rank {rank} here", path=base,
                          fix="ranks here: " + ", ".join(f"{r}" for r in have[:20]))
    return tuple(out)


def resolve_entry(store: Store, text: str) -> str:
    """Resolve a user-typed id/prefix; an unknown one is not found (exit 1), and an entry
    now in quarantine is a finding (exit 1) naming the item. A malformed id is a usage
    error (exit 2, InvalidIdError from the store)."""
    try:
        entry_id: str = store.resolve(text)
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
    raise NotFoundError(f"no entry {text[:64]} in the store", path=store.root,
                        fix="list entries with `spoolctl ls`")


def _reason(value: str) -> QuarantineReason:
    try:
        return QuarantineReason(value)
    except ValueError:
        return QuarantineReason.UNKNOWN
