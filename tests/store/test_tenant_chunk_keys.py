"""Entries a caller named for a tenant (``TenantId``, ``TenantNames.chunk_key``: the vLLM
connector's chunk keys, decision 2801) on an encrypted store.

What a user relies on: such an entry is sealed for the tenant its key names and found with
that tenant only; a key named for another tenant is refused; a sealed object reads back as
its plaintext size; and a tenant that was revoked and stores the same chunk again gets a new
entry under its new key version, never the erased one revived (every restore of it would fail).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

pytest.importorskip("cryptography")

from spoolctl.store import (
    ConfigError,
    MasterKey,
    Store,
    TenantId,
    TenantNames,
    plain_size,
    revoke_tenant,
)
from spoolctl.store.sealing import COMMAND_ENV, FILE_ENV, VALUE_ENV


@pytest.fixture(autouse=True)
def no_operator_key(monkeypatch):
    for name in (FILE_ENV, VALUE_ENV, COMMAND_ENV):
        monkeypatch.delenv(name, raising=False)


def test_a_revoked_tenant_storing_the_same_chunk_again_gets_a_new_entry(tmp_path: Path):
    """The entry id of a chunk does not change with the key version (the naming key is the
    tenant's, decision 2800): after a revoke the same chunk committed again must be written
    under the new version, not the erased entry revived (every later restore would fail)."""
    master = MasterKey.from_hex(secrets.token_hex(32), "test",
                                ledger=Path(os.path.realpath(tmp_path)) / "erased-keys.json")
    key = TenantNames(master).chunk_key("alice", "a" * 64)
    root = Path(os.path.realpath(tmp_path)) / "s"
    with Store.open(root, create=True, master_key=master) as store:
        first = store.put(kind="vllm", namespace="ns", key=key, objects={"kv": b"one" * 99},
                          tenant=TenantId.of(key))
        revoke_tenant(store, "alice")
        again = store.put(kind="vllm", namespace="ns", key=key, objects={"kv": b"two" * 99},
                          tenant=TenantId.of(key))
        assert plain_size(first, "kv") == 3 * 99 < first.object("kv").size
        bobs = TenantNames(master).chunk_key("bob", "a" * 64)  # the same chunk, for bob
        assert bobs != key and store.lookup("vllm", "ns", bobs, tenant=TenantId.of(bobs)) is None
        assert again.entry_id == first.entry_id
        assert again.index["sealed"]["version"] != first.index["sealed"]["version"]
        found = store.lookup("vllm", "ns", key, tenant=TenantId.of(key))
        assert found is not None and bytes(store.read(found, "kv")) == b"two" * 99
        with pytest.raises(ConfigError):  # a key named for another tenant is refused
            store.put(kind="vllm", namespace="ns", key=key, objects={"kv": b"x"},
                      tenant=TenantId(TenantNames(master).tenant_id("bob")))
