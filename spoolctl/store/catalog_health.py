"""How a store keeps its catalog usable: opening it (writable or read-only), repairing it
when SQLite reports damage, and the two guards every operation passes.

* ``run_with_catalog_repair``: a catalog that SQLite reports damaged (by result code,
  ``sqlite_files.is_damaged``; also a FIFO or symlink in its place) is quarantined and
  rebuilt from the manifests, and the call retried once. A read-only store cannot
  rebuild: it reports the damage in one line instead.
* ``_writable``: ReadOnlyError for any write on a store opened ``read_only``.
* ``_shedding``: an operation that sheds load (or must run to let one run) that fails for
  lack of space deletes the reserve file and retries once (``reserve``, decision 1103).

``CatalogHealth`` is the base class of ``Store``; it uses the store's ``layout``,
``read_only``, ``reserve``, ``quarantine``, ``maintenance`` and recovery part.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .catalog import Catalog
from .errors import ConfigError, CorruptionError, QuarantineReason, ReadOnlyError, StoreIOError
from .ownership import give_back
from .reserve import is_no_space
from .sqlite_files import is_damaged, sqlite_error

if TYPE_CHECKING:
    from .quarantine import Quarantine
    from .recovery import Recovery
    from .reserve import Reserve
    from .root import Layout

log = logging.getLogger("spoolctl.store")

T = TypeVar("T")


class CatalogHealth:
    """The catalog and its repair, plus the read-only and full-disk guards (see above)."""

    layout: Layout
    read_only: bool
    reserve: Reserve
    quarantine: Quarantine
    _catalog: Catalog | None
    _recovery: Recovery

    def maintenance(self, *, exclusive: bool, what: str, wait: bool = True) -> Any:
        raise NotImplementedError

    @property
    def root(self) -> Path:
        return self.layout.root

    @property
    def catalog(self) -> Catalog:
        assert self._catalog is not None, "store is closed"
        return self._catalog

    def close(self) -> None:
        if self._catalog is not None:
            self._catalog.close()
            self._catalog = None
            if not self.read_only and self.reserve.count < self.reserve.most:
                # The last connection's close deleted SQLite's -wal/-shm files: take that
                # room back into the reserve before another program does.
                self.reserve.ensure()
            if not self.read_only:
                give_back(self.layout)  # root on another user's store (issue 30.5)

    def _writable(self, what: str) -> None:
        """ReadOnlyError unless this store was opened for writing."""
        if self.read_only:
            raise ReadOnlyError(f"{what}: the store was opened read-only", path=self.root,
                                fix="open it without read_only=True, as its owner")

    def _shedding(self, fn: Callable[[], T]) -> T:
        """Run ``fn``, an operation that frees space (or must work on a full disk to let
        one run); while it fails for lack of space, delete a piece of the reserve and retry
        (at most once per piece)."""
        while True:
            try:
                result = fn()
                break
            except (StoreIOError, OSError) as exc:
                if not is_no_space(exc):
                    raise
                if not self.reserve.release():
                    # Nothing left to give: say so, instead of advising the very command
                    # that just failed.
                    what = exc.message if isinstance(exc, StoreIOError) else str(exc)
                    raise StoreIOError(
                        f"{what} (the store's reserve is used up)",
                        path=getattr(exc, "path", None) or self.root,
                        fix="free space on this filesystem outside the store (other "
                            "files), then rerun", errno=errno.ENOSPC) from None
                log.warning("disk full: released a piece of the store's reserve (%d left)",
                            self.reserve.count)
        # Put the reserve back at once if the pass freed room for it, before another
        # program takes the space again (best effort: a lstat when it is in place).
        self.reserve.ensure()
        return result

    # -- catalog health ----------------------------------------------------------------

    @property
    def _catalog_path(self) -> Path:
        return self.layout.state / "catalog.sqlite3"

    def _open_catalog_read_only(self) -> None:
        try:
            self._catalog = Catalog(self._catalog_path, read_only=True)
        except sqlite3.DatabaseError as exc:
            if is_damaged(exc):
                raise CorruptionError(f"catalog unreadable ({exc}); a read-only open cannot "
                                      "rebuild it", reason=QuarantineReason.CATALOG,
                                      path=self._catalog_path,
                                      fix="open the store once writable (as its owner): the "
                                          "catalog is rebuilt from the manifests") from None
            if not self._catalog_path.exists():
                raise ConfigError("the store has no catalog yet", path=self._catalog_path,
                                  fix="open it once writable (as its owner) to build it"
                                  ) from None
            raise sqlite_error(exc, self._catalog_path) from None

    def _open_catalog(self) -> None:
        try:
            self._catalog = Catalog(self._catalog_path)
        except sqlite3.DatabaseError as exc:
            if not is_damaged(exc):
                raise sqlite_error(exc, self._catalog_path) from None
            self._rebuild_catalog(f"catalog unreadable: {exc}")
            return
        # An empty catalog (new, or a rebuild that failed midway rolled back) of a store
        # that has manifests: build it from them.
        if self._catalog.totals().entries == 0 and self._recovery.has_manifests():
            self._rebuild_catalog(None)

    def run_with_catalog_repair(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (catalog work); if SQLite reports the catalog damaged, quarantine the
        catalog, rebuild it from the manifests and run ``fn`` once more.

        Any other SQLite failure (busy, full, I/O) becomes BusyError / StoreIOError.
        """
        try:
            return fn()
        except sqlite3.DatabaseError as exc:
            if not is_damaged(exc):
                raise sqlite_error(exc, self._catalog_path) from None
            if self.read_only:
                raise CorruptionError(f"catalog corrupt ({exc}); a read-only open cannot "
                                      "rebuild it", reason=QuarantineReason.CATALOG,
                                      path=self._catalog_path,
                                      fix="open the store once writable (as its owner)"
                                      ) from None
            self._rebuild_catalog(f"catalog corrupt: {exc}")
        try:
            return fn()
        except sqlite3.DatabaseError as exc:
            raise sqlite_error(exc, self._catalog_path) from None

    def _rebuild_catalog(self, why: str | None) -> None:
        """Quarantine the catalog (if ``why``) and rebuild it from manifests.

        Runs under the exclusive maintenance lock so two processes never rebuild
        at once; every hint comes back as retain (safe: nothing is lost).
        """
        with self.maintenance(exclusive=True, what="rebuilding the catalog"):
            self.close()
            if why is not None:
                files = [
                    (self.layout.state / f"catalog.sqlite3{suffix}", "catalog")
                    for suffix in ("", "-wal", "-shm")
                ]
                self.quarantine.add(QuarantineReason.CATALOG, why, files)
                log.warning("catalog quarantined and rebuilt: %s", why)
            self._catalog = Catalog(self._catalog_path)
            if why is None and self._catalog.totals().entries:
                return  # another process rebuilt it while this one waited for the lock
            self._recovery.index_all(self._catalog)
