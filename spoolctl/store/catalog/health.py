"""How a store keeps its catalog usable: opening it (writable or read-only), repairing it
when SQLite reports damage, and the full-disk guard (a part of ``Store``).

* ``CatalogKeeper.run_with_catalog_repair``: a catalog that SQLite reports damaged (by
  result code, ``sqlite_files.is_damaged``; also a FIFO or symlink in its place) is
  quarantined and rebuilt from the manifests, and the call retried once. A read-only
  store cannot rebuild: it reports the damage in one line instead.
* ``shedding``: an operation that sheds load (or must run to let one run) that fails for
  lack of space deletes the reserve file and retries once (``reserve``).

``CatalogKeeper`` receives what it uses, not the store: the layout, whether the store is
read-only, the evidence directory, the exclusive maintenance lock (so two processes never
rebuild at once) and the two recovery calls a rebuild needs (``has_manifests``,
``index_all``).
"""

from __future__ import annotations

import errno
import logging
import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ...errors import ConfigError, CorruptionError, QuarantineReason, StoreIOError
from ..disk import dirfd
from ..disk.reserve import is_no_space
from ..disk.sqlite_files import is_damaged, sqlite_error
from .index import Catalog

if TYPE_CHECKING:
    from ..disk.reserve import Reserve
    from ..disk.root import StorePaths
    from ..maintain.quarantine import Quarantine

log = logging.getLogger("spoolctl.store")

T = TypeVar("T")


class CatalogKeeper:
    """The store's catalog connection and its repair (see the module docstring).

    ``exclusive_lock(what)``: the store's exclusive maintenance lock, as a context manager.
    ``has_manifests()`` / ``index_all(catalog)``: from the recovery part."""

    def __init__(self, layout: StorePaths, *, read_only: bool, evidence: Quarantine,
                 exclusive_lock: Callable[[str], AbstractContextManager[Any]],
                 has_manifests: Callable[[], bool],
                 index_all: Callable[[Catalog], Any]):
        self._layout = layout
        self._read_only = read_only
        self._evidence = evidence
        self._exclusive_lock = exclusive_lock
        self._has_manifests = has_manifests
        self._index_all = index_all
        self._catalog: Catalog | None = None

    @property
    def path(self) -> Path:
        return self._layout.state / "catalog.sqlite3"

    @property
    def catalog(self) -> Catalog:
        assert self._catalog is not None, "store is closed"
        return self._catalog

    def current(self) -> Catalog | None:
        """The open catalog, or None (closed, or closed for a repair)."""
        return self._catalog

    def close(self) -> bool:
        """Close the catalog; False if it was not open."""
        if self._catalog is None:
            return False
        self._catalog.close()
        self._catalog = None
        return True

    def open_read_only(self) -> None:
        try:
            self._catalog = Catalog(self.path, read_only=True)
        except sqlite3.DatabaseError as exc:
            if is_damaged(exc):
                raise CorruptionError(f"catalog unreadable ({exc}); a read-only open cannot "
                                      "rebuild it", reason=QuarantineReason.CATALOG,
                                      path=self.path,
                                      fix="open the store once writable (as its owner): the "
                                          "catalog is rebuilt from the manifests") from None
            if not self.path.exists():
                raise ConfigError("the store has no catalog yet", path=self.path,
                                  fix="open it once writable (as its owner) to build it"
                                  ) from None
            raise sqlite_error(exc, self.path) from None

    def open(self, *, repair: bool = True) -> None:
        """Open the catalog; a damaged or empty one of a store with manifests is rebuilt
        from them, or, without ``repair`` (a command that only reads), refused with
        CorruptionError: reading never rewrites the catalog."""
        if not repair and not _exists(self.path) and self._has_manifests():
            self._refuse_unless(repair, "no catalog while the store holds manifests")
        try:
            self._catalog = Catalog(self.path, tmp=self._layout.tmp)
        except sqlite3.DatabaseError as exc:
            if not is_damaged(exc):
                raise sqlite_error(exc, self.path) from None
            self._refuse_unless(repair, f"catalog unreadable ({exc})")
            self._rebuild(f"catalog unreadable: {exc}")
            return
        # An empty catalog (new, or a rebuild that failed midway rolled back) of a store
        # that has manifests: build it from them.
        if self._catalog.totals().entries == 0 and self._has_manifests():
            self._refuse_unless(repair, "catalog empty while the store holds manifests")
            self._rebuild(None)

    def _refuse_unless(self, repair: bool, why: str) -> None:
        if repair:
            return
        if self._catalog is not None:
            self._catalog.close()
            self._catalog = None
        raise CorruptionError(f"{why}; a command that only reads does not rebuild it",
                              reason=QuarantineReason.CATALOG, path=self.path,
                              fix="run `spoolctl scrub` (or any command that writes) to "
                                  "rebuild it from the manifests")

    def run_with_catalog_repair(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (catalog work); if SQLite reports the catalog damaged, quarantine the
        catalog, rebuild it from the manifests and run ``fn`` once more.

        Any other SQLite failure (busy, full, I/O) becomes BusyError / StoreIOError.
        """
        try:
            return fn()
        except sqlite3.DatabaseError as exc:
            if not is_damaged(exc):
                raise sqlite_error(exc, self.path) from None
            if self._read_only:
                raise CorruptionError(f"catalog corrupt ({exc}); a read-only open cannot "
                                      "rebuild it", reason=QuarantineReason.CATALOG,
                                      path=self.path,
                                      fix="open the store once writable (as its owner)"
                                      ) from None
            self._rebuild(f"catalog corrupt: {exc}")
        try:
            return fn()
        except sqlite3.DatabaseError as exc:
            raise sqlite_error(exc, self.path) from None

    def _rebuild(self, why: str | None) -> None:
        """Quarantine the catalog (if ``why``) and rebuild it from manifests.

        Runs under the exclusive maintenance lock so two processes never rebuild
        at once; every hint comes back as retain (safe: nothing is lost).
        """
        with self._exclusive_lock("rebuilding the catalog"):
            self.close()
            if why is not None:
                files = [
                    (self._layout.state / f"catalog.sqlite3{suffix}", "catalog")
                    for suffix in ("", "-wal", "-shm")
                ]
                self._evidence.add(QuarantineReason.CATALOG, why, files)
                log.warning("catalog quarantined and rebuilt: %s", why)
            self._catalog = Catalog(self.path, tmp=self._layout.tmp)
            if why is None and self._catalog.totals().entries:
                return  # another process rebuilt it while this one waited for the lock
            self._index_all(self._catalog)


def shedding(reserve: Reserve, root: Path, fn: Callable[[], T]) -> T:
    """Run ``fn``, an operation that frees space (or must work on a full disk to let one
    run); while it fails for lack of space, delete a piece of ``reserve`` and retry (at
    most once per piece)."""
    while True:
        try:
            result = fn()
            break
        except (StoreIOError, OSError) as exc:
            if not is_no_space(exc):
                raise
            if not reserve.release():
                # Nothing left to give: say so, instead of advising the very command
                # that just failed.
                what = exc.message if isinstance(exc, StoreIOError) else str(exc)
                raise StoreIOError(
                    f"{what} (the store's reserve is used up)",
                    path=getattr(exc, "path", None) or root,
                    fix="free space on this filesystem outside the store (other "
                        "files), then rerun", errno=errno.ENOSPC) from None
            log.warning("disk full: released a piece of the store's reserve (%d left)",
                        reserve.count)
    # Put the reserve back at once if the pass freed room for it, before another
    # program takes the space again (best effort: a lstat when it is in place).
    reserve.ensure()
    return result


def _exists(path: Path) -> bool:
    try:
        dirfd.lstat(path)
    except FileNotFoundError:
        return False
    return True
