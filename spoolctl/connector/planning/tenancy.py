"""Tenants of an encrypted rank store in the connector.

With a master key configured (``SPOOLCTL_MASTER_KEY_FILE`` / ``SPOOLCTL_MASTER_KEY`` /
``SPOOLCTL_MASTER_KEY_COMMAND``, the same for every process of the deployment), a request's
tenant is its ``cache_salt`` (the default tenant for an unsalted request):

* ``TenantKeys.keys``: the scheduler turns a request's chunk chain (``chain``, already bound
  to the salt) into *tenant chunk keys* (``TenantNames.chunk_key``): 32 bytes like every chunk
  key -- so plans, inventory reports and KV events are unchanged -- of which the first 8 are the
  tenant's opaque id and the rest a hash under that tenant's naming key. Without the master
  key nobody can tell from a store which prompt, or which salt, an entry belongs to, nor that
  two tenants stored the same prompt.
* ``commit_tenant``: a worker commits a chunk under its key as given, sealed with the data key
  of the tenant the key names (``TenantId.of``); it never sees a salt.
* ``store_problem``: an encrypted store this process cannot write (no master key, or another
  one than its keyring's): one log line at start, every encrypted entry a miss, and nothing
  stored (a tenant's KV is never written in clear into a store meant to be encrypted).
* ``TenantLabels``: per-tenant metrics name a tenant by its opaque id only, for at most a
  configured number of tenants per process (the rest are ``other``), so label cardinality
  stays bounded whatever clients send as salts.

Plain stores (no master key) are unchanged: chunk keys as ``chain`` makes them, no tenant
metrics.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from spoolctl.store import MasterKey, Store, TenantId, TenantNames

# The label of the tenants past the cap.
OTHER = "other"


class TenantKeys:
    """The scheduler's naming of chunk keys per tenant (see the module docstring)."""

    def __init__(self, names: TenantNames):
        self._names = names

    @classmethod
    def from_environment(cls) -> TenantKeys | None:
        """None when no master key is configured; ConfigError (one line, at start-up) when
        one is configured but unusable (unreadable file, missing ``cryptography``)."""
        master = MasterKey.from_environment()
        return cls(TenantNames(master)) if master is not None else None

    def keys(self, cache_salt: str | None, chain_keys: Sequence[str]) -> list[str]:
        """The tenant chunk keys of ``chain_keys`` for the tenant ``cache_salt`` names."""
        return [self._names.chunk_key(cache_salt, k) for k in chain_keys]

    def tenant_id(self, cache_salt: str | None) -> str:
        return self._names.tenant_id(cache_salt)


def key_tenant(key: str) -> str:
    """The opaque tenant id a tenant chunk key begins with."""
    return key[:16]


def commit_tenant(store: Store, key: str) -> TenantId | None:
    """The tenant to seal chunk ``key`` for in ``store`` (None: a plain store)."""
    return TenantId.of(key) if store.sealer is not None else None


def store_problem(store: Store) -> str | None:
    """Why this process must not write ``store`` (an encrypted store it holds no usable
    master key for), or None. Never names a key, only ids."""
    keyring = store.layout.state / "keyring.json"
    sealer = store.sealer
    if sealer is None:
        if keyring.exists():
            return ("the rank store is encrypted (it has a keyring) and no master key is "
                    "configured: its encrypted entries are misses and nothing is stored "
                    "until the key is back (SPOOLCTL_MASTER_KEY_FILE; docs/runbook.md, "
                    "key loss)")
        return None
    if keyring.exists() and not sealer.keyring.master_matches:
        return (f"master key {sealer.master.key_id} is not the key this rank store's keyring "
                "was written under: its encrypted entries are misses and nothing is stored "
                "(configure the store's master key; docs/runbook.md, key loss)")
    return None


class TenantLabels:
    """Label values for per-tenant metrics: a tenant's opaque id for the first ``cap``
    tenants this process sees, ``other`` for the rest. Thread-safe."""

    def __init__(self, cap: int):
        self._cap = cap
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def label(self, tid: str) -> str:
        with self._lock:
            if tid in self._seen:
                return tid
            if len(self._seen) < self._cap:
                self._seen.add(tid)
                return tid
        return OTHER

    @property
    def enabled(self) -> bool:
        return self._cap > 0

