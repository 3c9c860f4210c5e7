"""The store's read-only queries: totals, listings, id resolution (a part of ``Store``).

``Queries`` receives what it reads: the catalog (asked for on each use: a repair replaces
it), the catalog repair wrapper every catalog call goes through (a damaged catalog is
rebuilt and the call retried once) and the layout. ``Store`` exposes each query under its
own name (``Store.totals``, ``Store.entries``...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import InvalidIdError, NotFoundError
from .catalog.index import Catalog, CatalogRow, Totals
from .catalog.rows import shown_id
from .context import CatalogWork
from .format.keys import validate_entry_id, validate_entry_prefix
from .maintain.gc import tmp_usage

if TYPE_CHECKING:
    from .disk.root import StorePaths

T = TypeVar("T")


class Queries:
    """A store's queries (see the module docstring)."""

    def __init__(self, layout: StorePaths, catalog: Callable[[], Catalog],
                 repairing: CatalogWork):
        self._layout = layout
        self._catalog = catalog
        self._repairing = repairing

    def _run(self, fn: Callable[[Catalog], T]) -> T:
        return self._repairing(lambda: fn(self._catalog()))

    def live(self, entry_ids: Iterable[str]) -> set[str]:
        """Which of ``entry_ids`` are committed and retained (catalog only; no file I/O)."""
        ids = list(entry_ids)
        return self._run(lambda c: c.live(ids))

    def live_keys(self, kind: str, namespace: str) -> set[str]:
        """Keys of the committed, retained entries of ``(kind, namespace)`` (catalog only)."""
        return self._run(lambda c: c.live_keys(kind, namespace))

    def totals(self) -> Totals:
        return self._run(lambda c: c.totals())

    def by_kind(self) -> dict[str, dict[str, int]]:
        return self._run(lambda c: c.by_kind())

    def released(self) -> tuple[int, int]:
        """(count, bytes) of released entries waiting for cleanup."""
        return self._run(lambda c: c.released_stats())

    def entries(self, **filters: Any) -> list[CatalogRow]:
        """Catalog rows; see ``Catalog.list`` for filters (kind, namespace, hint, sort, limit).
        Malformed rows are skipped (``malformed_rows`` reports them)."""
        return self._run(lambda c: c.list(**filters))

    def malformed_rows(self, limit: int = 100) -> list[tuple[str, str]]:
        """(entry id as stored, reason) of catalog rows that are not what spoolctl writes
        (skipped by every listing and cleanup; ``collect_orphans`` repairs them)."""
        return [(shown_id(e), why) for e, why in self._run(lambda c: c.malformed(limit))]

    def malformed_count(self) -> int:
        return self._run(lambda c: c.malformed_count())

    def row(self, entry_id: str) -> CatalogRow | None:
        validate_entry_id(entry_id)
        return self._run(lambda c: c.get(entry_id))

    def resolve(self, text: str) -> str:
        """Resolve a full id or a unique prefix (>= 4 hex) to an entry id."""
        validate_entry_prefix(text)
        if len(text) == 64:
            return text
        matches = self._run(lambda c: c.resolve_prefix(text))
        if not matches:
            raise NotFoundError(f"no entry matches {text}", path=self._layout.root,
                                fix="list entries with `spoolctl ls`")
        if len(matches) > 1:
            raise InvalidIdError(f"entry prefix {text} is ambiguous",
                                 fix="type more characters of the id")
        return matches[0]

    def tmp_usage(self) -> tuple[int, int, bool]:
        """(files, bytes, complete) of tmp/ (``gc.tmp_usage``: a bounded count)."""
        return tmp_usage(self._layout.tmp)
