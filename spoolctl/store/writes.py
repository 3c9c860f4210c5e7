"""The store's commits: ``put``, ``put_many`` and the import's ``commit_prebuilt``, each a
batch handed to the committer under the shared maintenance lock, through the catalog
repair, then a bounded commit-time eviction."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

from ..errors import BusyError, ConfigError, SpoolError, StoreIOError
from .commit.committer import Committer, Payload, Pending, PutOutcome, PutRequest
from .commit.inputs import check_put, known_size
from .context import CatalogWork, Limits, WritableGuard
from .format.keys import TenantId
from .format.manifest import Manifest
from .sealing import Sealer, seal_request

T = TypeVar("T")

# Bounded work done inline after a commit; the rest is left to the next pass/cron.
COMMIT_EVICTION_BUDGET = 256


class Writes:
    """The commit role of one store. ``repair`` runs catalog work through the catalog
    repair; ``maintenance(what)`` holds the shared maintenance lock; ``over_capacity`` and
    ``evict(budget)`` are the commit-time capacity check and eviction."""

    def __init__(self, committer: Committer, sealer: Sealer | None, writable: WritableGuard,
                 limits: Limits, root: Path, *, repair: CatalogWork,
                 maintenance: Callable[[str], AbstractContextManager[object]],
                 over_capacity: Callable[[], bool], evict: Callable[[int], object]):
        self._committer = committer
        self._sealer = sealer
        self._writable = writable
        self._limits = limits
        self._root = root
        self._repair = repair
        self._maintenance = maintenance
        self._over_capacity = over_capacity
        self._evict = evict

    def put(
        self,
        *,
        kind: str,
        namespace: str,
        key: str,
        objects: Mapping[str, Payload],
        meta: Mapping[str, Any] | None = None,
        index: Mapping[str, Any] | None = None,
        supersedes: str | None = None,
        evict: bool = True,
        tenant: str | TenantId | None = None,
    ) -> Manifest:
        """Commit one entry (manifest-last) and return its manifest; an existing entry is
        returned as is (revived if released). ``supersedes`` is released in the same catalog
        transaction. ``evict=False`` skips the commit-time capacity check. ``tenant``: on an
        encrypted store, whose keys seal the entry (None: the default tenant).

        Raises ConfigError / InvalidIdError for bad arguments (nothing written),
        CapacityError if the entry does not fit, StoreIOError on a disk failure (nothing
        visible), BusyError on lock timeout."""
        request = PutRequest(kind, namespace, key, objects, meta, index, supersedes, tenant)
        check_put(**request.__dict__)
        request = seal_request(self._sealer, request)
        entry_id = check_put(**request.__dict__)
        self._writable("committing an entry")
        outcome = self._commit([Pending(entry_id, request=request)], evict)[0]
        if outcome.error is not None:
            raise outcome.error
        assert outcome.manifest is not None
        return outcome.manifest

    def put_many(self, requests: Iterable[PutRequest], *, evict: bool = True
                 ) -> list[PutOutcome]:
        """Commit many entries together (group commit); one outcome per request, in order.

        Per entry all or nothing: an entry refused (bad arguments, no room, unwritable
        objects) has ``outcome.error`` and nothing of it is visible. A failure shared by
        the batch raises BusyError / StoreIOError. Callers bound a batch's size: staged
        payloads stay referenced until the batch is durable."""
        pending: list[Pending] = []
        for r in list(requests):
            try:
                if not isinstance(r, PutRequest):
                    raise ConfigError(f"put_many takes PutRequest items, got {type(r).__name__}",
                                      fix="pass PutRequest(kind=..., namespace=..., key=..., "
                                          "objects=...)")
                check_put(**r.__dict__)
                r = seal_request(self._sealer, r)
                pending.append(Pending(check_put(**r.__dict__), request=r))
            except SpoolError as exc:
                pending.append(Pending("", outcome=PutOutcome("", "failed", error=exc)))
        self._writable("committing entries")
        return self._commit(pending, evict)

    def _commit(self, pending: list[Pending], evict: bool) -> list[PutOutcome]:
        first_try = True

        def commit() -> None:
            nonlocal first_try
            if not first_try:
                # The catalog was rebuilt mid-commit and the batch runs again: a streamed
                # payload was consumed by the first try and cannot be read twice.
                for p in pending:
                    if p.outcome is None and p.request and any(
                            known_size(v) is None for v in p.request.objects.values()):
                        p.fail(StoreIOError("the catalog was repaired during this commit; a "
                                            "streamed payload cannot be read twice",
                                            path=self._root, fix="commit the entry again"))
            first_try = False
            with self._maintenance("committing entries"):
                self._committer.commit([p for p in pending if p.outcome is None])
        if any(p.outcome is None for p in pending):
            self._repair(commit)
        if evict and self._limits.max_bytes is not None and self._over_capacity():
            with contextlib.suppress(BusyError):
                self._evict(COMMIT_EVICTION_BUDGET + len(pending))
        outcomes = [p.outcome for p in pending if p.outcome is not None]
        assert len(outcomes) == len(pending), "every entry of a batch has an outcome"
        return outcomes

    def commit_prebuilt(self, pending: list[Pending], given: dict[str, Path]) -> None:
        """Commit entries whose manifests were built, and objects staged in ``tmp/`` and
        verified, elsewhere (the import); sets each one's outcome. ``given`` (digest ->
        staged file) is consumed; an entry already committed is reported present, not
        revived. Raises as ``put_many`` does for a shared failure."""
        self._writable("importing entries")

        def commit() -> None:
            with self._maintenance("importing entries"):
                self._committer.commit([p for p in pending if p.outcome is None],
                                       given=given, revive=False)
        self._repair(commit)
