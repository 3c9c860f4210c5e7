"""The tenant of a genai controller on an encrypted store: its keys and entry ids."""

from __future__ import annotations

import logging

from spoolctl.store import Store, entry_id_for

from ..contract import CachePrepareParams
from ..tenant_guard import master_key_lost, refuse_tenant_without_encryption
from .records import KIND

log = logging.getLogger("spoolctl.genai")


class GenaiTenant:
    """The tenant of a genai controller on an encrypted store.

    A genai entry holds only a record of a server resource; its prompt-derived part, the
    controller key, becomes a keyed hash under the tenant's naming key, and the entry is
    committed with ``tenant=``, so another tenant (or none) misses and ``keys revoke``
    releases it. ``tenant=`` on a plain store is a ConfigError; a master key that is not
    the keyring's is one warning, then every lookup misses and nothing is recorded."""

    def __init__(self, store: Store, tenant: str | None):
        self._store = store
        refuse_tenant_without_encryption(store, tenant)
        sealer = store.sealer
        if sealer is None:
            self.active, self.tenant, self.lost = False, None, False
            return
        self.active, self.tenant = True, tenant
        sealer.tenant_id(tenant)  # a bad name is a ConfigError now, not at the first prepare
        self.lost = master_key_lost(store)
        if self.lost:
            log.warning("the configured master key (id %s) is not the one this store's keyring "
                        "was written under: every genai cache record is a miss and none is "
                        "recorded (docs/runbook.md, key loss)", sealer.master.key_id)

    def key(self, params: CachePrepareParams) -> str:
        """The controller key of ``params`` for this tenant."""
        if not self.active:
            return params.key()
        assert self._store.sealer is not None
        return self._store.sealer.sealed_key(self.tenant, "genai:" + params.key())

    def entry_id(self, namespace: str, key: str) -> str:
        if not self.active:
            return entry_id_for(KIND, namespace, key)
        return self._store.entry_id(KIND, namespace, key, tenant=self.tenant)
