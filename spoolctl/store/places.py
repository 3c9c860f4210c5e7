"""Where stores live under a ``--root``, and where an archive's stores go on import.

Three layouts are understood (the connector's is decision 0900):

* a single store: ``<root>/.spoolctl-root``; its place is ``""``, or
  ``<deployment>/rank-NNNN`` when its path ends like a connector rank store;
* a deployment directory: ``<root>/rank-NNNN/`` stores; places ``<root name>/rank-NNNN``;
* a connector base root (``spoolctl_root``): ``<root>/<deployment>/rank-NNNN/`` stores.

Discovery only lists directories and checks markers: it never opens a store, so it is safe
on a peer's root mounted read-only. Routing (``Target.route``) sends a vLLM rank store
only to the directory an engine of *its* deployment reads (decision 1602): chunks are
keyed through their deployment identity and cannot be re-keyed for another one.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from .archive import deployment_of, place_for, validate_place
from .errors import ArchiveError, ConfigError, RootError
from .root import MARKER, check_root_path

_RANK_RE = re.compile(r"rank-([0-9]{4})")
_COMPONENT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class StorePlace:
    """One store found under a root: its archive place and its path."""

    place: str
    path: Path


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _has_marker(path: Path) -> bool:
    return os.path.lexists(path / MARKER)


def _rank_children(path: Path) -> dict[int, Path]:
    """``rank-NNNN`` subdirectories (not symlinks) of ``path`` that hold a store."""
    out: dict[int, Path] = {}
    try:
        names = os.listdir(path)
    except OSError:
        return out
    for name in names:
        m = _RANK_RE.fullmatch(name)
        if m and _is_dir(path / name) and _has_marker(path / name):
            out[int(m.group(1))] = path / name
    return out


def place_of_store(path: Path) -> str:
    """``<deployment>/rank-NNNN`` if ``path`` looks like a connector rank store, else ``""``."""
    m = _RANK_RE.fullmatch(path.name)
    if m and _COMPONENT_RE.fullmatch(path.parent.name):
        return place_for(path.parent.name, int(m.group(1)))
    return ""


def _deployment_dirs(base: Path) -> dict[str, dict[int, Path]]:
    out: dict[str, dict[int, Path]] = {}
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return out
    for name in names:
        child = base / name
        if _COMPONENT_RE.fullmatch(name) and _is_dir(child) and not _has_marker(child):
            ranks = _rank_children(child)
            if ranks:
                out[name] = ranks
    return out


@dataclass(frozen=True)
class Layout:
    """What a root is: ``store``, ``deployment``, ``base`` or ``new`` (absent or empty)."""

    kind: str
    path: Path
    stores: tuple[StorePlace, ...]

    @property
    def quorum(self) -> bool:
        """Its rank stores are every rank of their deployments (not one picked store)."""
        return self.kind in ("deployment", "base")

    @property
    def deployments(self) -> set[str]:
        return {d for s in self.stores if (d := deployment_of(s.place)) is not None}


def inspect_root(root: str | os.PathLike[str]) -> Layout:
    """Classify ``root`` and list its stores (no store is opened)."""
    path = check_root_path(root)
    if not os.path.lexists(path):
        return Layout("new", path, ())
    if not _is_dir(path):
        raise RootError("not a directory", path=path, fix="pass a store root or its parent")
    if _has_marker(path):
        return Layout("store", path, (StorePlace(place_of_store(path), path),))
    ranks = _rank_children(path)
    if ranks:
        if not _COMPONENT_RE.fullmatch(path.name):
            raise RootError("a deployment directory needs a plain name", path=path,
                            fix="rename it, or pass one of its rank-NNNN stores")
        return Layout("deployment", path, tuple(
            StorePlace(place_for(path.name, r), p) for r, p in sorted(ranks.items())))
    deps = _deployment_dirs(path)
    if deps:
        return Layout("base", path, tuple(
            StorePlace(place_for(d, r), p) for d, ranks in deps.items()
            for r, p in sorted(ranks.items())))
    if not os.listdir(path):
        return Layout("new", path, ())
    raise RootError("no spoolctl store here", path=path,
                    fix="pass a store root, a deployment directory (<root>/<deployment>) or "
                        "the connector's spoolctl_root")


def find_stores(root: str | os.PathLike[str]) -> Layout:
    """``inspect_root`` for a source: a root holding no store is an error."""
    layout = inspect_root(root)
    if not layout.stores:
        raise RootError("no spoolctl store here", path=layout.path,
                        fix="pass a store root, a deployment directory or the connector's "
                            "spoolctl_root")
    return layout


@dataclass(frozen=True)
class Target:
    """Where an import writes: the classified ``--root`` and the deployments accepted."""

    layout: Layout
    accept: frozenset[str] = frozenset()

    def route(self, place: str) -> Path:
        """The store path for the archive's store ``place``; ConfigError if it has none."""
        validate_place(place)
        lay, dep = self.layout, deployment_of(place)
        if lay.kind == "store":
            own = lay.stores[0].place
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
                    fix="import into the connector's spoolctl_root instead (decision 1602)")
            return lay.path / place.split("/", 1)[1]
        # base or new
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
