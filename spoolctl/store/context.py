"""What the store's parts receive instead of the whole ``Store``.

``Store`` (``store.py``) is composed of parts -- the committer (``commit``), the garbage
collector (``gc``), recovery (``recovery``), the entry quarantine (``quarantining``), the
catalog keeper (``catalog_health``) and the read-only queries (``queries``) -- and hands
each one a ``PartContext``: the few things a part may use, named, and nothing else. So a
part never reaches back into the facade, no module below ``store.py`` imports it (a test
walks the imports), and what a part depends on is read in one line.

* ``layout``: where the files are;
* ``catalog``: the open catalog, asked for on each use (a repair replaces it);
* ``checkpoint``: the crash-test hook (``faults.checkpoint``; a test may swap the
  store's ``checkpoint`` attribute, and the hook follows it);
* ``quarantine``: moving an entry's files into quarantine (``quarantining``);
* ``limits``: the max size (from the marker: ``set_max_bytes`` changes it) and the lock
  timeout;
* ``writable``: the guard that raises ReadOnlyError on a store opened read-only;
* ``clock``: wall-clock seconds for LRU and commit times (injectable in tests);
* ``tag_key``: the key that tags and authenticates entries, or None;
* ``key_available``: on an encrypted store, whether an entry's objects can still be
  decrypted (False once its tenant's key was revoked or retired: ``sealing``); None when
  encryption is off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from ..errors import ReadOnlyError

if TYPE_CHECKING:
    from pathlib import Path

    from .catalog.index import Catalog
    from .disk.root import Marker, StorePaths
    from .format.entry_tags import TagKey
    from .format.manifest import Manifest
    from .maintain.quarantining import EntryQuarantine


T = TypeVar("T")


class CatalogWork(Protocol):
    """Runs catalog work through the catalog repair (``Store.run_with_catalog_repair``)."""

    def __call__(self, fn: Callable[[], T], /) -> T: ...


class Limits:
    """The store's limits, live: ``marker`` is replaced when the max size changes."""

    def __init__(self, marker: Marker, lock_timeout: float):
        self.marker = marker
        self.lock_timeout = lock_timeout

    @property
    def max_bytes(self) -> int | None:
        return self.marker.max_bytes


class WritableGuard:
    """ReadOnlyError for any write on a store opened ``read_only``."""

    def __init__(self, root: Path, read_only: bool):
        self.root = root
        self.read_only = read_only

    def __call__(self, what: str) -> None:
        if self.read_only:
            raise ReadOnlyError(f"{what}: the store was opened read-only", path=self.root,
                                fix="open it without read_only=True, as its owner")


@dataclass(frozen=True)
class PartContext:
    """The narrow view of one store its parts work through (see the module docstring)."""

    layout: StorePaths
    catalog: Callable[[], Catalog]
    checkpoint: Callable[[str], None]
    quarantine: EntryQuarantine
    limits: Limits
    writable: WritableGuard
    clock: Callable[[], float]
    tag_key: TagKey | None
    key_available: Callable[[Manifest], bool] | None = None

    @property
    def root(self) -> Path:
        return self.layout.root
