"""The items of a commit batch: a ``PutRequest`` (the arguments of ``Store.put``), its
``PutOutcome``, and the ``Pending`` entry the committer works on."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import SpoolError
from ..disk.fsio import Flushing
from ..format.manifest import Manifest

Payload = bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview]


@dataclass(frozen=True)
class PutRequest:
    """One entry for ``Store.put_many``: the arguments of ``Store.put``."""

    kind: str
    namespace: str
    key: str
    objects: Mapping[str, Payload]
    meta: Mapping[str, Any] | None = None
    index: Mapping[str, Any] | None = None
    supersedes: str | None = None
    # encrypted stores: whose keys seal it, a name or a sealing.TenantId
    tenant: Any = None


@dataclass
class PutOutcome:
    """What became of one entry of a batch.

    ``status``: ``committed`` (written now), ``present`` (already committed: returned as
    is), ``failed`` (refused: ``error`` says why; nothing of it is visible) or ``vanished``
    (an imported entry whose object is no longer in the store)."""

    entry_id: str
    status: str
    manifest: Manifest | None = None
    error: SpoolError | None = None

    @property
    def ok(self) -> bool:
        return self.manifest is not None


@dataclass
class Pending:
    """One entry of a batch being committed (internal to the commit and its callers).

    Either ``request`` (payloads to stage; the manifest is built here) or ``manifest`` +
    ``data`` (an entry built elsewhere, its objects already verified in ``tmp/``: the
    import's path) is set."""

    entry_id: str
    request: PutRequest | None = None
    manifest: Manifest | None = None
    data: bytes | None = None
    staged: list[tuple[str, Flushing]] = field(default_factory=list)
    manifest_tmp: Flushing | None = None
    outcome: PutOutcome | None = None
    hint: str = "retain"  # the hint it is committed with (an import keeps the source's)

    def built(self) -> tuple[Manifest, bytes]:
        """The entry's manifest and its encoding, set once it is staged."""
        assert self.manifest is not None and self.data is not None, "entry not staged"
        return self.manifest, self.data

    def staged_manifest(self) -> Flushing:
        """The temp file its manifest was staged to, set once it is staged."""
        assert self.manifest_tmp is not None, "manifest not staged"
        return self.manifest_tmp

    def fail(self, error: SpoolError, status: str = "failed") -> None:
        self.outcome = PutOutcome(self.entry_id, status, error=error)
