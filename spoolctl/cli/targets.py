"""What a command acts on: ``--root`` resolved into the stores under it, and a user-typed
entry id resolved into an entry.

A ``--root`` names one of (decision 1100):

* a **store**: a directory with a ``.spoolctl-root`` marker (or one to be created);
* a vLLM **deployment directory** ``<base>/<deployment digest>`` holding one
  ``rank-NNNN`` store per rank (the connector's layout, ``spoolctl.connector.topology``);
* a vLLM **base root**: the ``spoolctl_root`` given to the connector (what
  ``spoolctl config vllm --root R`` prints), holding deployment directories;
* an **empty** directory: a base root before the first engine start (nothing to do).

Anything else (a non-empty directory that is none of these) is a one-line error that
says what a root may be; it never advises creating a store where the connector keeps its
deployments. ``--rank N`` and ``--deployment NAME`` narrow a deployment or base root.
``resolve_targets`` is the one place that tells these apart; commands loop over
``Targets.stores`` (see ``fanout``).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from spoolctl.store import (
    ConfigError,
    CorruptionError,
    NotFoundError,
    QuarantineReason,
    RootError,
    Store,
)
from spoolctl.store.root import MARKER, Layout, check_root_path, unfinished_init

from .common import resolve_root

Kind = Literal["store", "deployment", "base", "empty"]


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

    def to_json(self) -> dict:
        return {"root": str(self.root), "rank": self.rank, "deployment": self.deployment}


@dataclass(frozen=True)
class Targets:
    """What a ``--root`` names (see the module docstring) and the stores to act on."""

    given: Path
    kind: Kind
    stores: tuple[StoreTarget, ...]

    @property
    def single(self) -> bool:
        return self.kind == "store"


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def rank_stores(path: Path) -> dict[int, Path]:
    """The ``rank-NNNN`` store directories directly under ``path`` (none if ``path`` is
    itself a store or not a directory). Symlinks are never followed."""
    from spoolctl.connector.topology import rank_of_dirname  # pure; the layout's one owner

    if not _is_real_dir(path) or os.path.lexists(path / MARKER) or \
            unfinished_init(Layout(path)) is not None:  # init finishes it
        return {}
    found = {}
    try:
        children = list(os.scandir(path))
    except OSError:
        return {}
    for child in children:
        rank = rank_of_dirname(child.name)
        if rank is not None and child.is_dir(follow_symlinks=False):
            found[rank] = Path(child.path)
    return found


def deployments(base: Path) -> tuple[dict[str, dict[int, Path]], list[str]] | None:
    """The deployment directories under a base root (name -> rank stores) and the names of
    its empty subdirectories; None if ``base`` is not a base root (a file or symlink in it,
    or a subdirectory that is neither a deployment nor empty)."""
    try:
        children = list(os.scandir(base))
    except OSError:
        return None
    found: dict[str, dict[int, Path]] = {}
    empty: list[str] = []
    for child in children:
        if not child.is_dir(follow_symlinks=False):
            return None
        ranks = rank_stores(Path(child.path))
        if ranks:
            found[child.name] = ranks
            continue
        try:
            if os.listdir(child.path):
                return None
        except OSError:
            return None
        empty.append(child.name)
    return found, empty


def resolve_targets(root: Path | None, *, rank: int | None = None,
                    deployment: str | None = None) -> Targets:
    """Resolve ``--root`` (default: ``$SPOOLCTL_ROOT`` or the user's store) into stores,
    narrowed by ``rank`` / ``deployment``.

    A path that does not exist, or holds a store marker, is one store (opening it says
    what is wrong). Raises RootError for a path that is none of the kinds above and
    ConfigError for filters that match nothing or do not apply.
    """
    path = check_root_path(resolve_root(root))
    if not _is_real_dir(path) or os.path.lexists(path / MARKER) or \
            unfinished_init(Layout(path)) is not None:  # init finishes it
        if rank is not None or deployment is not None:
            raise ConfigError("--rank and --deployment apply to a vLLM base root or "
                              "deployment directory, not to one store", path=path,
                              fix="drop them, or point --root at the base root")
        return Targets(path, "store", (StoreTarget(path),))
    ranks = rank_stores(path)
    if ranks:
        if deployment is not None:
            raise ConfigError("--deployment applies to a vLLM base root; --root is already "
                              "one deployment directory", path=path, fix="drop --deployment")
        return Targets(path, "deployment", _narrow(path, {path.name: ranks}, rank, None))
    found = deployments(path)
    if found is None:
        raise RootError(
            "not a spoolctl store, vLLM deployment directory or base root (no .spoolctl-root "
            "marker, no rank-NNNN stores)", path=path,
            fix="point --root at a store, at the root given to `spoolctl config vllm`, or at "
                "one deployment directory under it")
    groups, _empty = found
    if not groups:
        if deployment is not None or rank is not None:
            raise ConfigError("no vLLM deployment under this root yet", path=path,
                              fix="start the engine first, or drop --rank/--deployment")
        return Targets(path, "empty", ())
    return Targets(path, "base", _narrow(path, groups, rank, deployment))


def _narrow(base: Path, groups: dict[str, dict[int, Path]], rank: int | None,
            deployment: str | None) -> tuple[StoreTarget, ...]:
    if deployment is not None:
        names = [n for n in groups if n == deployment] or \
            ([n for n in groups if n.startswith(deployment)] if len(deployment) >= 4 else [])
        if len(names) != 1:
            what = "matches more than one" if len(names) > 1 else "matches no"
            raise ConfigError(f"--deployment {deployment[:64]!r} {what} deployment directory",
                              path=base, fix="use one of: " + ", ".join(sorted(groups)[:10]))
        groups = {names[0]: groups[names[0]]}
    out = [StoreTarget(p, r, name)
           for name in sorted(groups) for r, p in sorted(groups[name].items())
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
    raise NotFoundError(f"no entry {text[:64]} in the store", path=store.root,
                        fix="list entries with `spoolctl ls`")


def _reason(value: str) -> QuarantineReason:
    try:
        return QuarantineReason(value)
    except ValueError:
        return QuarantineReason.UNKNOWN
