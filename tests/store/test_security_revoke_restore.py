"""A revoke survives a restore of the store (issue 47 item 4, decision 3021).

Someone who can write the store but not the key file copies the store directory before
``keys revoke`` and copies it back after: keyring.json, objects, manifests and catalog as
they were. spoolctl must still not decrypt the revoked tenant's data -- through the store,
nor through an archive exported before the revoke -- while the other tenant reads as
before. The erased keys are recorded in the key ledger outside the store.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import pytest

pytest.importorskip("cryptography")

from operator_cli import run, run_json

from spoolctl.errors import KeyUnavailableError
from spoolctl.store import Store
from spoolctl.store.sealing import COMMAND_ENV, FILE_ENV, VALUE_ENV, MasterKey

KIND, NS = "pytorch", "ns"
LEDGER_ENV = "SPOOLCTL_KEY_LEDGER"


@pytest.fixture(autouse=True)
def no_operator_key(monkeypatch):
    for name in (FILE_ENV, VALUE_ENV, COMMAND_ENV, LEDGER_ENV):
        monkeypatch.delenv(name, raising=False)


def _key_env(base: Path) -> dict[str, str]:
    keys = base / "etc"
    keys.mkdir(mode=0o700)
    path = keys / "master.key"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return {FILE_ENV: str(path)}


def _plain(tenant: str, i: int) -> bytes:
    return f"{tenant} prompt {i}: ".encode().ljust(2048, b"~")


def test_restoring_the_store_from_before_a_revoke_decrypts_nothing_of_the_tenant(
        tmp_path: Path):
    base = Path(os.path.realpath(tmp_path))
    env = _key_env(base)
    root, backup = base / "store", base / "backup"
    with Store.open(root, create=True, master_key=MasterKey.from_environment(env)) as store:
        for tenant in ("acme", "other"):
            for i in range(2):
                store.put(kind=KIND, namespace=NS, key=f"p{i}", tenant=tenant,
                          objects={"kv": _plain(tenant, i)})
    archive = base / "before.tar"
    run_json("export", "-o", str(archive), "--root", str(root), env=env)
    shutil.copytree(root, backup, symlinks=True)  # a backup of the store, no key needed

    run_json("keys", "revoke", "--tenant-env", "TENANT", "--yes", "--root", str(root),
             env={**env, "TENANT": "acme"})
    ledger = Path(env[FILE_ENV] + ".erased")
    assert ledger.exists() and not ledger.is_relative_to(root)

    shutil.rmtree(root)  # every file from before the revoke, back in place
    shutil.copytree(backup, root, symlinks=True)
    assert json.loads((root / "state" / "keyring.json").read_text()) == \
        json.loads((backup / "state" / "keyring.json").read_text())

    with Store.open(root, master_key=MasterKey.from_environment(env)) as store:
        for i in range(2):
            found = store.lookup(KIND, NS, f"p{i}", tenant="acme")
            if found is not None:  # the restored catalog still lists it: never decrypted
                with pytest.raises(KeyUnavailableError):
                    store.read(found, "kv")
            assert store.lookup(KIND, NS, f"p{i}", tenant="acme") is None
            other = store.lookup(KIND, NS, f"p{i}", tenant="other")
            assert bytes(store.read(other, "kv")) == _plain("other", i)
        ring = store.sealer.keyring
        tid = store.sealer.tenant_id("acme")
        restored = [v for t in ring.tenants() if t.tenant_id == tid for v in t.versions]
        assert restored and all(ring.data_key(tid, v) is None for v in restored)
        assert store.quarantine.items() == []  # a miss, not damage

    # An archive made before the revoke, imported into a fresh store: acme's key is refused.
    fresh = base / "fresh"
    code, out, err = run("import", str(archive), "--root", str(fresh), "--json", env=env)
    with Store.open(fresh, create=True, master_key=MasterKey.from_environment(env)) as store:
        assert all(store.lookup(KIND, NS, f"p{i}", tenant="acme") is None or
                   _unreadable(store, store.lookup(KIND, NS, f"p{i}", tenant="acme"))
                   for i in range(2)), (code, out, err)
        other = store.lookup(KIND, NS, "p0", tenant="other")
        assert other is not None and bytes(store.read(other, "kv")) == _plain("other", 0)

    # Without a ledger a revoke is refused in one line, and nothing is erased.
    value_env = {VALUE_ENV: Path(env[FILE_ENV]).read_text().strip()}
    code, _, err = run("keys", "revoke", "--tenant-env", "TENANT", "--yes", "--root",
                       str(root), env={**value_env, "TENANT": "other"})
    assert code != 0 and LEDGER_ENV in err and len(err.strip().splitlines()) == 1, err
    with Store.open(root, master_key=MasterKey.from_environment(env)) as store:
        assert bytes(store.read(store.lookup(KIND, NS, "p1", tenant="other"), "kv")) == \
            _plain("other", 1)


def _unreadable(store: Store, manifest) -> bool:
    try:
        store.read(manifest, "kv")
    except KeyUnavailableError:
        return True
    return False
