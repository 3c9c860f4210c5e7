"""Where stores live under a ``--root``, and where an archive's stores go on import.

``inspect_root`` is the one scanner of roots: the CLI, export, import and the peer API all
classify a root through it, and only narrow and render what it found. A root is one of
four kinds:

* ``store``: a directory with a ``.spoolctl-root`` marker, or what an interrupted
  ``init`` left (init finishes it); its place is ``""``, or ``<deployment>/rank-NNNN``
  when its path ends like a connector rank store;
* ``deployment``: a directory holding ``rank-NNNN`` subdirectories, each one rank's store
  (with or without its marker: a rank store that lost its marker is listed, and opening
  it says what is wrong, so it is never silently left out of the ranks);
* ``base``: the connector's ``spoolctl_root``, holding at least one deployment
  directory; other entries beside them (a README, ``lost+found``, an empty directory)
  are not stores and are ignored;
* ``empty``: a path that does not exist yet, or a directory holding nothing but empty
  directories (a base root before the first engine start). ``exists`` tells the two apart.

A root this user cannot list or reach is an AccessDeniedError, never ``empty``; anything
else is a RootError naming the path. Discovery never opens a store nor follows a symlink.
``Target.route`` sends a vLLM rank store only to its own deployment's directory: chunks are
keyed through their deployment identity and cannot be re-keyed for another one.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ...errors import ArchiveError, ConfigError, RootError, access_denied
from ..disk.root import MARKER, StorePaths, check_root_path, unfinished_init
from ..format.rankdirs import is_deployment_name, parse_rank_dirname
from .archive import deployment_of, place_for, validate_place

Kind = Literal["store", "deployment", "base", "empty"]
KINDS: tuple[Kind, ...] = ("store", "deployment", "base", "empty")


@dataclass(frozen=True)
class StorePlace:
    """One store found under a root: its path, and for a rank store of the connector its
    deployment directory's name and rank. ``place`` is its archive place (``""`` or
    ``<deployment>/rank-NNNN``), None when a name cannot be carried in an archive."""

    path: Path
    deployment: str | None = None
    rank: int | None = None
    place: str | None = ""

    @property
    def archive_place(self) -> str:
        """``place``; ConfigError for a store an archive cannot carry."""
        if self.place is None:
            raise ConfigError(_not_carried(self.deployment), path=self.path,
                              fix="export the connector's own deployment directories")
        return self.place


def _not_carried(deployment: str | None) -> str:
    return (f"the deployment directory name {deployment!r} cannot be carried in an archive "
            "(letters, digits, '.', '_', '-' only; the connector names them "
            "vllm-v1-<digest>)")


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _is_store(path: Path) -> bool:
    """A marker (whatever its state: opening it says what is wrong), or what an
    interrupted ``init`` left."""
    return os.path.lexists(path / MARKER) or unfinished_init(StorePaths(path)) is not None


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _rank_children(path: Path) -> dict[int, Path]:
    """``rank-NNNN`` subdirectories (not symlinks) of ``path``, with or without a marker;
    none if ``path`` is itself a store."""
    if _is_store(path):
        return {}
    out: dict[int, Path] = {}
    for name in _listdir(path):
        rank = parse_rank_dirname(name)
        if rank is not None and _is_dir(path / name):
            out[rank] = path / name
    return out


def _place(deployment: str, rank: int) -> str | None:
    try:
        return place_for(deployment, rank)
    except ArchiveError:
        return None


def _rank_store(deployment: str, rank: int, path: Path) -> StorePlace:
    return StorePlace(path, deployment, rank, _place(deployment, rank))


def place_of_store(path: Path) -> str:
    """``<deployment>/rank-NNNN`` if ``path`` looks like a connector rank store, else ``""``."""
    rank = parse_rank_dirname(path.name)
    if rank is not None and is_deployment_name(path.parent.name):
        return place_for(path.parent.name, rank)
    return ""


def _only_empty_dirs(path: Path, names: list[str]) -> bool:
    for name in names:
        if not _is_dir(path / name):
            return False
        try:
            if os.listdir(path / name):
                return False
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class RootContents:
    """What a root is (``kind``: see the module docstring) and the stores under it.

    ``exists`` is False for an ``empty`` root that is not there yet."""

    kind: Kind
    path: Path
    stores: tuple[StorePlace, ...]
    exists: bool = True

    @property
    def quorum(self) -> bool:
        """Its rank stores are every rank of their deployments (not one picked store)."""
        return self.kind in ("deployment", "base")

    @property
    def deployments(self) -> set[str]:
        return {d for s in self.stores
                if (d := s.deployment or (deployment_of(s.place) if s.place else None))}

    def archivable(self) -> tuple[RootContents, list[tuple[StorePlace, str]]]:
        """These contents with only the stores an archive can carry, and the others with
        why (a deployment directory name other than letters, digits, ``.``, ``_``, ``-``)."""
        bad = [(s, _not_carried(s.deployment)) for s in self.stores if s.place is None]
        good = tuple(s for s in self.stores if s.place is not None)
        return RootContents(self.kind, self.path, good, self.exists), bad


def _check_readable(path: Path) -> None:
    """AccessDeniedError if this user cannot list ``path`` or look inside it: everything
    below would otherwise read as absent, and the root as an empty one ("nothing to do")."""
    try:
        os.listdir(path)
        os.lstat(path / MARKER)
    except FileNotFoundError:
        pass
    except PermissionError:
        raise access_denied(path) from None


def inspect_root(root: str | os.PathLike[str]) -> RootContents:
    """Classify ``root`` and list its stores (no store is opened); RootError for a path
    that is none of the kinds (see the module docstring)."""
    path = check_root_path(root)
    try:
        os.lstat(path)
    except PermissionError:  # a directory above it cannot be searched: not "no root here"
        raise access_denied(path, action="reach") from None
    except OSError:
        return RootContents("empty", path, (), exists=False)
    if not _is_dir(path):
        raise RootError("not a directory", path=path,
                        fix="pass a store root, a deployment directory or the connector's "
                            "spoolctl_root")
    _check_readable(path)
    if _is_store(path):
        return RootContents("store", path, (StorePlace(path, None, None, place_of_store(path)),))
    ranks = _rank_children(path)
    if ranks:
        return RootContents("deployment", path, tuple(
            _rank_store(path.name, r, p) for r, p in sorted(ranks.items())))
    names = _listdir(path)
    found = [(name, ranks) for name in names
             if _is_dir(path / name) and (ranks := _rank_children(path / name))]
    if found:
        return RootContents("base", path, tuple(
            _rank_store(name, r, p) for name, ranks in found for r, p in sorted(ranks.items())))
    if _only_empty_dirs(path, names):
        return RootContents("empty", path, ())
    raise RootError(
        "not a spoolctl store, vLLM deployment directory or base root (no .spoolctl-root "
        "marker, no rank-NNNN stores)", path=path,
        fix="point --root at a store, at the root given to `spoolctl config vllm` (the "
            "connector's spoolctl_root), or at one deployment directory under it")


def find_stores(root: str | os.PathLike[str]) -> RootContents:
    """``inspect_root`` for a source (export, peer): a root holding no store is an error,
    and so is a store an archive cannot carry."""
    contents, bad = inspect_root(root).archivable()
    if bad:
        raise ConfigError(bad[0][1], path=bad[0][0].path,
                          fix="export the connector's own deployment directories")
    if not contents.stores:
        raise RootError("no spoolctl store here", path=contents.path,
                        fix="pass a store root, a deployment directory or the connector's "
                            "spoolctl_root")
    return contents


@dataclass(frozen=True)
class Target:
    """Where an import writes: the classified ``--root`` and the deployments accepted."""

    layout: RootContents
    accept: frozenset[str] = frozenset()

    def route(self, place: str) -> Path:
        """The store path for the archive's store ``place``; ConfigError if it has none."""
        validate_place(place)
        lay, dep = self.layout, deployment_of(place)
        if lay.kind == "store":
            own = lay.stores[0].place or ""
            if place in ("", own):
                return lay.path
            raise ConfigError(
                f"the archive's store {place} belongs to deployment {dep}, but the target is "
                f"{'the store ' + own if own else 'a single store'}",
                path=lay.path, fix="import into the connector's spoolctl_root (the base "
                                   "directory): each rank store then lands where its "
                                   "engine reads it")
        if lay.kind == "deployment":
            if dep is None:
                raise ConfigError("the archive holds a single store, the target is a "
                                  "deployment directory", path=lay.path,
                                  fix="pass the store root to import into with --root")
            if dep != lay.path.name:
                raise ConfigError(
                    f"the archive's chunks belong to deployment {dep}, the target directory "
                    f"is deployment {lay.path.name}; chunks are keyed through their deployment "
                    "and are never hit by another one", path=lay.path,
                    fix="import into the connector's spoolctl_root instead")
            return lay.path / place.split("/", 1)[1]
        # base or empty
        if dep is None:
            if lay.kind == "base":
                raise ConfigError("the archive holds a single store, the target holds vLLM "
                                  "deployments", path=lay.path,
                                  fix="pass an empty directory or a store root with --root")
            return lay.path
        present = lay.deployments
        if present and dep not in present and dep not in self.accept:
            raise ConfigError(
                f"the archive's chunks belong to deployment {dep}, this root serves "
                f"{', '.join(sorted(present))}; an engine of another deployment never reads "
                "them", path=lay.path,
                fix=f"check that the replica runs the same model, dtype and topology; to "
                    f"import them anyway add --deployment {dep}")
        return lay.path / place


def check_single_layout(places: list[str]) -> None:
    """An archive holds either one single store or only rank stores (what export writes)."""
    if "" in places and len(places) > 1:
        raise ArchiveError("the archive mixes a single store with rank stores",
                           fix="the archive was not written by `spoolctl export`")
