"""Publish a batch of already-verified entries into a store (the import's one commit path).

``Store.put`` takes payload bytes and hashes them as it writes them. An import already
holds each object in the store's ``tmp/``, written, flushed and proven to match its digest
while it was read from the archive; copying and hashing it again would double the work.
This module hands such entries to the store's group commit (``commit.Committer``) as
prebuilt entries: the same steps, checkpoints and crash guarantees as ``Store.put_many``
(docs/format.md), skipping only the staging of objects the import already staged. An entry
already committed is reported present (not revived); one that relies on an object no longer
in the store is reported vanished. See decisions 1601 and 1400.
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
    """One verified entry waiting to be published.

    ``data`` is the manifest envelope to write; ``staged`` maps the digests of objects this
    entry brought (files in the store's ``tmp/``, already verified and flushed) to their
    paths. Every other object the manifest names must already be in the store (or staged by
    an earlier entry of the same batch)."""

    manifest: Manifest
    data: bytes
    staged: dict[str, Path] = field(default_factory=dict)
    hint: str = "retain"  # the source's hint, kept (decision 2311)


def publish_entries(store: Store, batch: list[StagedEntry]) -> dict[str, PutOutcome]:
    """Commit ``batch`` (manifest-last, crash-safe); return each entry id's outcome
    (``PutOutcome.status``): ``committed``, ``present`` (a committed entry of that id
    already existed, or another writer recorded it first: the staged copy is
    dropped), ``vanished`` (an object it relies on is no
    longer in the store) or ``failed`` (its manifest could not be written: ``error``).

    Staged files are consumed: moved into the store or deleted, also on error. Raises
    StoreIOError on a disk failure (entries whose manifest was not yet published stay
    invisible), BusyError if the maintenance lock cannot be taken.
    """
    given = {d: p for e in batch for d, p in e.staged.items()}
    if not batch:
        return {}
    pending = [Pending(e.manifest.entry_id, manifest=e.manifest, data=e.data, hint=e.hint)
               for e in batch]
    store.commit_prebuilt(pending, given)
    return {p.entry_id: p.outcome for p in pending if p.outcome is not None}
