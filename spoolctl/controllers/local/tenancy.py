"""Tenants of the local prompt-cache controllers on an encrypted store.

A controller opened with ``tenant=`` on a store with a master key seals its entries with that
tenant's data key (``Store.put(..., tenant=)``), and finds only that tenant's entries. Contracts:

* Entry ids are the store's tenant-keyed ids (``Store.entry_id(..., tenant=)``): the same
  prompt of two tenants (or of a tenant and the default tenant, ``tenant=None``) gives two
  unrelated entries, so another tenant's lookup is a plain miss -- tokens as a cold run.
* Nothing prompt-derived stays in clear text in a sealed entry's manifest or catalog row:
  the token ids and prefix digests -- and what a format names in ``sealed_meta`` /
  ``sealed_layout`` (mlx-vlm: image digests, its snapshot's hashes) -- move
  into a sealed object (``PREFIX_OBJECT``) and the
  params' group and element hashes and the rows' token marks are keyed per tenant (equal
  prompts of two tenants do not show equal hashes); base selection looks only at the
  tenant's own rows.
* A store without encryption takes ``tenant=`` as a ConfigError (it would isolate nothing);
  a master key that is not the keyring's (a lost key replaced) is one warning line at open,
  after which every lookup misses and nothing is persisted (``keyring.current`` refuses).
  A revoked tenant's entries are misses (the catalog released them; a read that finds its
  key gone is ``KeyUnavailableError``, a NotFoundError the engine treats as a miss).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from spoolctl.store import CorruptionError, Manifest, QuarantineReason, Store

from ..tenant_guard import master_key_lost, refuse_tenant_without_encryption
from .entry_format import Plan
from .tokens import MARK_CHARS

log = logging.getLogger("spoolctl.controllers")

PREFIX_OBJECT = "prefix"  # the sealed object that holds a sealed entry's token meta
SECRET_META = ("tokens", "prefix_offsets", "prefix_hashes")
LAYOUT_KEY = "layout"  # in the sealed object: the format's ``sealed_layout`` values


class Tenancy:
    """The tenant a controller's entries belong to (see the module docstring). Inactive
    (every method an identity) on a store without encryption and no tenant."""

    def __init__(self, store: Store, tenant: str | None, kind: str, *,
                 sealed_meta: tuple[str, ...] = (), sealed_layout: tuple[str, ...] = ()):
        sealer = store.sealer
        self._store, self._kind = store, kind
        # meta keys (and keys of meta["layout"]) that go into the sealed object
        self._secret = SECRET_META + tuple(k for k in sealed_meta if k not in SECRET_META)
        self._secret_layout = tuple(sealed_layout)
        refuse_tenant_without_encryption(store, tenant)
        if sealer is None:
            self.active, self.tenant, self.tenant_id, self.lost = False, None, None, False
            return
        self.active, self.tenant = True, tenant
        self.tenant_id = sealer.tenant_id(tenant)
        # The keyring's master key is not this one: nothing of the store is readable and
        # nothing can be sealed; the engine then neither finds nor persists (one line here).
        self.lost = master_key_lost(store)
        if self.lost:
            log.warning("the configured master key (id %s) is not the one this store's keyring "
                        "was written under: every cache entry is a miss and nothing is "
                        "persisted (docs/runbook.md, key loss)", sealer.master.key_id)

    def _keyed(self, label: str, value: str) -> str:
        assert self._store.sealer is not None
        return self._store.sealer.sealed_key(self.tenant, f"{label}:{value}")

    def mark_key(self) -> Callable[[str], str] | None:
        """How a catalog token mark is bound to this tenant (None: stored as computed)."""
        if not self.active:
            return None
        return lambda digest: self._keyed("mark", digest)[:MARK_CHARS]

    def entry_id(self, namespace: str, key: str) -> str:
        """The id the entry ``key`` of this tenant is stored under."""
        return self._store.entry_id(self._kind, namespace, key, tenant=self.tenant)

    def plan(self, plan: Plan | None) -> Plan | None:
        """``plan`` with the tenant's entry id and tenant-keyed group and element hashes."""
        if plan is None or not self.active:
            return plan
        return dataclasses.replace(
            plan, entry_id=self._store.entry_id(self._kind, plan.namespace, plan.key,
                                                tenant=self.tenant),
            group=self._keyed("group", plan.group),
            elements=tuple(self._keyed("element", e) for e in plan.elements))

    def seal_meta(self, meta: dict[str, Any], objects: dict[str, Any]
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(meta, objects)`` to commit: for a sealed entry the token meta moves into the
        sealed ``PREFIX_OBJECT``; unchanged otherwise."""
        if not self.active:
            return meta, objects
        secret = {k: meta[k] for k in self._secret if k in meta}
        clear = {k: v for k, v in meta.items() if k not in self._secret}
        layout = clear.get("layout")
        if self._secret_layout and isinstance(layout, Mapping):
            secret[LAYOUT_KEY] = {k: layout[k] for k in self._secret_layout if k in layout}
            clear["layout"] = {k: v for k, v in layout.items() if k not in self._secret_layout}
        return clear, {**objects, PREFIX_OBJECT: json.dumps(secret).encode()}

    def open_meta(self, manifest: Manifest, objects: dict[str, Any] | None = None
                  ) -> tuple[Mapping[str, Any], dict[str, Any] | None]:
        """The manifest's whole meta (token meta read back from ``PREFIX_OBJECT`` of a sealed
        entry, from ``objects`` when given, else read from the store) and ``objects``
        without it. CorruptionError (the entry quarantined) if the object is not JSON."""
        if not self.active or PREFIX_OBJECT not in {o.name for o in manifest.objects}:
            return manifest.meta, objects
        if objects is not None:
            objects = dict(objects)
            raw = objects.pop(PREFIX_OBJECT)
        else:
            raw = self._store.read(manifest, PREFIX_OBJECT)
        try:
            secret = json.loads(bytes(raw))
            if not isinstance(secret, dict):
                raise ValueError("not an object")
        except ValueError:
            self._store.quarantine_entry(manifest.entry_id, QuarantineReason.MANIFEST_VALIDATION,
                                         "sealed token meta is not a JSON object")
            raise CorruptionError("sealed token meta is not a JSON object",
                                  reason=QuarantineReason.MANIFEST_VALIDATION) from None
        meta = {**manifest.meta, **{k: secret[k] for k in self._secret if k in secret}}
        hidden = secret.get(LAYOUT_KEY)
        if self._secret_layout and isinstance(hidden, dict) and \
                isinstance(meta.get("layout"), Mapping):
            meta["layout"] = {**meta["layout"],
                              **{k: hidden[k] for k in self._secret_layout if k in hidden}}
        return meta, objects

    def own(self, index: Any) -> bool:
        """Whether a catalog row's index is this tenant's (always, when inactive)."""
        if not self.active:
            return True
        fact = index.get("sealed") if isinstance(index, Mapping) else None
        return isinstance(fact, Mapping) and fact.get("tenant") == self.tenant_id

    def base_manifest(self, namespace: str, key: str, entry_id: str) -> Manifest | None:
        """The live manifest of a base row, or None. A sealed row's key is already the
        stored (tenant-keyed) one, so it is found by its entry id."""
        if not self.active:
            return self._store.lookup(self._kind, namespace, key, touch=False)
        if not self._store.live([entry_id]):
            return None
        manifest = self._store.manifest(entry_id)
        # the catalog row chose it: read it only if its key (bound to its id) names this
        # tenant, so its objects are opened for this tenant or not at all
        return manifest if manifest.key.startswith(f"t:{self.tenant_id}:") else None


class SealedFormat:
    """An ``EntryFormat`` whose plans carry the tenant's entry ids (``Tenancy.plan``);
    everything else is the wrapped format's."""

    def __init__(self, inner: Any, tenancy: Tenancy):
        self._inner = inner
        self._tenancy = tenancy

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def plan(self, params: Any) -> Plan | None:
        return self._tenancy.plan(self._inner.plan(params))

    def entry_id(self, params: Any) -> str:
        plan = self.plan(params)
        if plan is not None:
            return plan.entry_id
        return self._inner.entry_id(params)  # no cacheable prefix: no entry either way
