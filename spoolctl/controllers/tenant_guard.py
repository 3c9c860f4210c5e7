"""What every controller checks when it is opened with ``tenant=``.

One refusal, one message for all of them: a tenant on a store without encryption at rest
would isolate nothing, so it is a one-line ConfigError naming the store and the fix. And one
test of a lost master key: the configured key is not the one the store's keyring was written
under (each controller then says in its own words what it will not do).
"""

from __future__ import annotations

from spoolctl.errors import ConfigError
from spoolctl.store import Store


def refuse_tenant_without_encryption(store: Store, tenant: str | None) -> None:
    """Raise ConfigError when ``tenant`` is given and ``store`` has no sealer (no master key)."""
    if tenant is not None and store.sealer is None:
        raise ConfigError("tenant= was given but the store has no encryption at rest "
                          "configured (no master key)", path=store.root,
                          fix="set SPOOLCTL_MASTER_KEY_FILE to the store's master key, "
                              "or drop tenant=")


def master_key_lost(store: Store) -> bool:
    """True when ``store`` has a keyring written under another master key than the configured
    one: nothing of the store is readable and nothing can be sealed. False without a sealer."""
    sealer = store.sealer
    if sealer is None:
        return False
    ring = sealer.keyring
    return ring.path.exists() and not ring.master_matches
