"""The store's lookups and verified reads: entry ids, ``lookup`` (``lookup_many``: one
catalog query for many keys), ``manifest`` (the one way every reader gets a manifest: tag
checked when a tag key is set), ``read`` (digest or AEAD tag checked in the same pass),
``verify`` and the LRU ``touch``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence

from ..errors import (
    BusyError,
    CorruptionError,
    KeyUnavailableError,
    ManifestError,
    NotFoundError,
    QuarantineReason,
    SpoolError,
)
from .catalog.index import Catalog
from .commit.committer import PutRequest
from .context import CatalogWork
from .disk.fsio import read_manifest
from .disk.root import StorePaths
from .disk.verify import failed_object, read_verified
from .format.entry_tags import TagKey
from .format.keys import TenantId, entry_id_for, validate_entry_id
from .format.manifest import Manifest, authenticate
from .maintain.quarantining import EntryQuarantine
from .sealing import Sealer, read_binding, seal_request, sealed_fact, stored_key


class Reads:
    """The read role of one store. ``catalog`` is asked for on each use (a repair replaces
    it); ``repair`` runs catalog work through the catalog repair; ``live`` and ``release``
    are the store's."""

    def __init__(self, layout: StorePaths, *, read_only: bool, tag_key: TagKey | None,
                 sealer: Sealer | None, catalog: Callable[[], Catalog],
                 clock: Callable[[], float], repair: CatalogWork,
                 quarantining: EntryQuarantine, live: Callable[[Iterable[str]], set[str]],
                 release: Callable[[str], bool]):
        self.layout = layout
        self.read_only = read_only
        self._tag_key = tag_key
        self._sealer = sealer
        self._catalog = catalog
        self._clock = clock
        self._repair = repair
        self._quarantining = quarantining
        self._live = live
        self._release = release

    def quarantine_entry(self, entry_id: str, reason: QuarantineReason, detail: str, *,
                         bad_digests: list[str]) -> object:
        """Move ``entry_id`` into quarantine (what ``failed_object`` calls)."""
        return self._quarantining.entry(entry_id, reason, detail, bad_digests=bad_digests)

    def entry_id(self, kind: str, namespace: str, key: str, *,
                 tenant: str | TenantId | None = None) -> str:
        """The id of the entry ``key`` of ``tenant`` names (on an encrypted store)."""
        return entry_id_for(kind, namespace, self._stored_key(key, tenant))

    def _stored_key(self, key: str, tenant: str | TenantId | None) -> str:
        """The key an entry of ``tenant`` is stored under (``sealing.seal_request``)."""
        if self._sealer is None:
            seal_request(None, PutRequest("", "", "", {}, tenant=tenant))  # refuses a tenant
            return key
        return stored_key(self._sealer, tenant, key)

    def lookup(self, kind: str, namespace: str, key: str, *, touch: bool = True,
               tenant: str | TenantId | None = None) -> Manifest | None:
        """The live manifest for ``key`` (of ``tenant`` on an encrypted store), or None (a
        miss). Never raises on corruption: a bad manifest is quarantined and a miss."""
        return self.lookup_many(kind, namespace, [key], touch=touch, tenant=tenant)[0]

    def lookup_many(self, kind: str, namespace: str, keys: Sequence[str], *,
                    touch: bool = True, tenant: str | TenantId | None = None
                    ) -> list[Manifest | None]:
        """``lookup`` of every key in ``keys`` (in order) with one catalog query for all of
        them and, with ``touch``, one LRU write. Each object still has to be ``read`` (and
        is verified then)."""
        ids = [self.entry_id(kind, namespace, key, tenant=tenant) for key in keys]
        live = self._live(ids) if ids else set()
        found = [self._live_manifest(entry_id) if entry_id in live else None for entry_id in ids]
        if touch and not self.read_only and any(m is not None for m in found):
            self.touch([m.entry_id for m in found if m is not None])
        return found

    def _live_manifest(self, entry_id: str) -> Manifest | None:
        """The manifest of a live entry, or None if it is gone or bad (then quarantined)."""
        try:
            return self.manifest(entry_id)
        except (NotFoundError, CorruptionError):
            return None

    def touch(self, entry_ids: Iterable[str]) -> None:
        """Move the LRU clock of ``entry_ids`` (skipped when recent; a no-op on a
        read-only store or when the catalog is busy)."""
        if self.read_only:
            return
        ids = list(entry_ids)
        with contextlib.suppress(BusyError):
            self._repair(lambda: self._catalog().touch(ids, self._clock()))

    def manifest(self, entry_id: str) -> Manifest:
        """Load and validate the manifest of ``entry_id``.

        Raises NotFoundError if there is none, ManifestError (after quarantining the entry)
        if it is unreadable, invalid or -- with a tag key -- not authenticated by its tag
        (reason ``auth_tag``)."""
        validate_entry_id(entry_id)
        path = self.layout.manifest_path(entry_id)
        try:
            manifest = read_manifest(path, entry_id)
            if self._tag_key is not None:
                authenticate(self._tag_key, manifest, path)
            return manifest
        except FileNotFoundError:
            raise NotFoundError(f"no entry {entry_id}", path=self.layout.root,
                                fix="list entries with `spoolctl ls`") from None
        except ManifestError as exc:
            if not self.read_only:
                self._quarantining.entry(entry_id, exc.reason, exc.message)
            raise

    def read(self, manifest: Manifest, name: str, *, into: memoryview | None = None
             ) -> memoryview:
        """Object ``name`` of ``manifest``, verified against its digest in the same pass.

        On damage the entry is quarantined and CorruptionError raised (a miss); an entry
        deleted meanwhile raises NotFoundError (a miss); an unreadable object raises
        StoreIOError (nothing moved); an encrypted entry without its key raises
        KeyUnavailableError (a miss; an erased one is released)."""
        ref = manifest.object(name)
        path = self.layout.object_path(ref.digest)
        sealed = sealed_fact(manifest.index)
        try:
            if sealed is not None:  # one pass: the AEAD tag is the integrity check
                if self._sealer is None:
                    raise KeyUnavailableError(f"entry {manifest.entry_id} is encrypted and no "
                                              "master key is configured", path=self.layout.root,
                                              fix="configure the master key (docs/runbook.md)")
                return self._sealer.open(path, ref.size, into,
                                         binding=read_binding(manifest, name))
            return read_verified(path, digest=ref.digest, size=ref.size, into=into)
        except KeyUnavailableError as exc:
            if exc.erased and not self.read_only:  # crypto-erased: out of reuse, for `clean`
                with contextlib.suppress(SpoolError):
                    self._release(manifest.entry_id)
            raise
        except (OSError, CorruptionError) as exc:
            raise failed_object(self, manifest.entry_id, name, ref.digest, path, exc,
                                found_by="read").error from exc

    def read_all(self, manifest: Manifest) -> dict[str, memoryview]:
        """Every object of ``manifest``, verified (see ``read``)."""
        return {ref.name: self.read(manifest, ref.name) for ref in manifest.objects}

    def verify(self, entry_id: str) -> Manifest:
        """Re-read and verify the manifest and every object of ``entry_id`` now; returns the
        manifest. Raises NotFoundError or CorruptionError (the entry is then quarantined).
        An encrypted entry's objects are checked against their ciphertext digests, as scrub
        does: no key needed, and an entry whose key is gone is still found."""
        manifest = self.manifest(entry_id)
        sealed = sealed_fact(manifest.index) is not None
        for ref in manifest.objects:
            if not sealed:
                self.read(manifest, ref.name)
                continue
            path = self.layout.object_path(ref.digest)
            try:
                read_verified(path, digest=ref.digest, size=ref.size)
            except (OSError, CorruptionError) as exc:
                raise failed_object(self, manifest.entry_id, ref.name, ref.digest, path, exc,
                                    found_by="read").error from exc
        return manifest
