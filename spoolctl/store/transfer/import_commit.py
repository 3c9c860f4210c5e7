"""Publish a batch of already-verified entries into a store (the import's one commit path).

An import already holds each object in the store's ``tmp/``, flushed and proven to match its
digest, so its entries go to the store's group commit as prebuilt entries: the same steps,
checkpoints and crash guarantees as ``Store.put_many``, without hashing the objects again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..commit.committer import Pending, PutOutcome, object_present
from ..format.manifest import Manifest
from ..store import Store

__all__ = ["StagedEntry", "object_present", "publish_entries"]


@dataclass
class StagedEntry:
    """One verified entry waiting to be published: ``data`` is the manifest envelope;
    ``staged`` maps the digests of the objects it brought (verified files in ``tmp/``) to
    their paths. Every other object it names must be in the store or staged earlier in the
    batch."""

    manifest: Manifest
    data: bytes
    staged: dict[str, Path] = field(default_factory=dict)
    hint: str = "retain"  # the source's hint, kept: released entries stay released


def publish_entries(store: Store, batch: list[StagedEntry]) -> dict[str, PutOutcome]:
    """Commit ``batch`` (manifest-last, crash-safe); return each entry id's outcome:
    ``committed``, ``present`` (already committed; not revived), ``vanished`` (an object it
    relies on is gone) or ``failed`` (its manifest could not be written).

    Staged files are consumed, also on error. Raises StoreIOError on a disk failure,
    BusyError if the maintenance lock cannot be taken.
    """
    given = {d: p for e in batch for d, p in e.staged.items()}
    if not batch:
        return {}
    pending = [Pending(e.manifest.entry_id, manifest=e.manifest, data=e.data, hint=e.hint)
               for e in batch]
    store.commit_prebuilt(pending, given)
    return {p.entry_id: p.outcome for p in pending if p.outcome is not None}
