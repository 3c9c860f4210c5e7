"""The store's read-only queries: facts, totals, listings, id resolution (a part of
``Store``, kept in its own module).

Every catalog call goes through ``run_with_catalog_repair`` (a damaged catalog is rebuilt
and the call retried once). Mixed into ``Store``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .catalog import CatalogRow, Totals
from .errors import InvalidIdError, NotFoundError
from .facts import StoreFacts, collect
from .gc import tmp_usage
from .keys import validate_entry_id, validate_entry_prefix
from .rows import shown_id

if TYPE_CHECKING:
    from .store import Store


class Queries:
    """``Store``'s queries (see the module docstring)."""

    def facts(self: Store) -> StoreFacts:
        """One snapshot of everything status, metrics and gauges report (``facts``)."""
        return collect(self)

    def totals(self: Store) -> Totals:
        return self.run_with_catalog_repair(lambda: self.catalog.totals())

    def by_kind(self: Store) -> dict[str, dict[str, int]]:
        return self.run_with_catalog_repair(lambda: self.catalog.by_kind())

    def released(self: Store) -> tuple[int, int]:
        """(count, bytes) of released entries waiting for cleanup."""
        return self.run_with_catalog_repair(lambda: self.catalog.released_stats())

    def entries(self: Store, **filters: Any) -> list[CatalogRow]:
        """Catalog rows; see ``Catalog.list`` for filters (kind, namespace, hint, sort, limit).
        Malformed rows are skipped (``malformed_rows`` reports them)."""
        return self.run_with_catalog_repair(lambda: self.catalog.list(**filters))

    def malformed_rows(self: Store, limit: int = 100) -> list[tuple[str, str]]:
        """(entry id as stored, reason) of catalog rows that are not what spoolctl writes
        (skipped by every listing and cleanup; ``collect_orphans`` repairs them)."""
        return [(shown_id(e), why) for e, why in
                self.run_with_catalog_repair(lambda: self.catalog.malformed(limit))]

    def malformed_count(self: Store) -> int:
        return self.run_with_catalog_repair(lambda: self.catalog.malformed_count())

    def row(self: Store, entry_id: str) -> CatalogRow | None:
        validate_entry_id(entry_id)
        return self.run_with_catalog_repair(lambda: self.catalog.get(entry_id))

    def resolve(self: Store, text: str) -> str:
        """Resolve a full id or a unique prefix (>= 4 hex) to an entry id."""
        validate_entry_prefix(text)
        if len(text) == 64:
            return text
        matches = self.run_with_catalog_repair(lambda: self.catalog.resolve_prefix(text))
        if not matches:
            raise NotFoundError(f"no entry matches {text}", path=self.root,
                                fix="list entries with `spoolctl ls`")
        if len(matches) > 1:
            raise InvalidIdError(f"entry prefix {text} is ambiguous",
                                 fix="type more characters of the id")
        return matches[0]

    def tmp_usage(self: Store) -> tuple[int, int]:
        """(files, bytes) under tmp/."""
        return tmp_usage(self.layout.tmp)
