"""Encrypted entries in archives carry their wrapped data keys (issue 33 item 4, decisions
2812 and 2813).

An export puts the wrapped keys of the encrypted entries it holds in the archive's index
(wrapped under the master key, as the keyring holds them; never a key in clear). An import
checks that it can unwrap them with its own master key before anything is published: with
the same master key the entries read back byte for byte; with another master key or none it
refuses in one line naming the archive and the fix, and publishes nothing. A key table that
is damaged, a wrapped key moved to another tenant, or a key that clashes with another key of
the same (tenant, version) on the target are refused the same way; a tenant revoked on the
target does not come back through an import (its entries are skipped, the others imported).
"""

from __future__ import annotations

import io
import json
import os
import secrets
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("cryptography")

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from fleet_keys import keypair
from operator_cli import run, run_json, script

from spoolctl.store import Store
from spoolctl.store.sealing import COMMAND_ENV, FILE_ENV, VALUE_ENV, MasterKey

KIND, NS = "pytorch", "model-x"
TENANTS = ("acme", "globex")


@pytest.fixture(autouse=True)
def no_operator_key(monkeypatch):
    for name in (FILE_ENV, VALUE_ENV, COMMAND_ENV):
        monkeypatch.delenv(name, raising=False)


def _key_env(where: Path, name: str = "master.key") -> dict[str, str]:
    where.mkdir(exist_ok=True)
    path = where / name
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return {FILE_ENV: str(path)}


def _payload(tenant: str, i: int) -> bytes:
    return f"{tenant} prompt #{i} ".encode() * 40


@pytest.fixture
def fleet(tmp_path: Path):
    """A source store of two tenants (one rotated: two key versions) and its archive."""
    base = Path(os.path.realpath(tmp_path))
    env = _key_env(base / "keys")
    src = base / "src"
    master = MasterKey.from_environment(env)
    with Store.open(src, create=True, master_key=master) as store:
        for i in range(2):
            for tenant in TENANTS:
                store.put(kind=KIND, namespace=NS, key=f"p{i}", objects={"kv": _payload(tenant, i)},
                          tenant=tenant)
            if i == 0:
                store.sealer.keyring.rotate([store.sealer.tenant_id("acme")])
    archive = base / "a.tar"
    run_json("export", "-o", str(archive), "--root", str(src), env=env)
    return base, env, master, archive


def _read_all(root: Path, master: MasterKey | None) -> dict[tuple[str, str], bytes]:
    """Every (tenant, key) of the fleet store that reads back at ``root``."""
    out = {}
    with Store.open(root, master_key=master, read_only=True) as store:
        for tenant in TENANTS:
            for i in range(2):
                m = store.lookup(KIND, NS, f"p{i}", tenant=tenant)
                if m is not None:
                    out[(tenant, f"p{i}")] = bytes(store.read(m, "kv"))
    return out


def _entries(root: Path) -> int:
    if not (root / ".spoolctl-root").exists():
        return 0
    with Store.open(root, read_only=True, master_key=None) as store:
        return store.totals().entries


def _index(archive: bytes) -> tuple[int, dict]:
    """Offset and document of the archive's index member."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        first = tar.next()
        assert first is not None and first.name == "spoolctl-archive.json"
        return first.offset_data, json.loads(archive[first.offset_data:
                                                     first.offset_data + first.size])


def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(data))))


def test_same_master_key_reads_the_imported_entries_other_or_none_is_refused(fleet,
                                                                             monkeypatch):
    base, env, master, archive = fleet
    want = {(t, f"p{i}"): _payload(t, i) for t in TENANTS for i in range(2)}
    _, index = _index(archive.read_bytes())
    table = index["stores"][0]["keys"]
    assert table["master_id"] == master.key_id and len(table["keys"]) == 3  # acme twice
    assert all(len(k["wrapped"]) == 120 for k in table["keys"])
    text = archive.read_bytes().decode("latin-1")  # no data key in clear, in any form
    assert not any(k.hex() in text or k.decode("latin-1") in text
                   for k in _live_data_keys(base / "src", master))

    # Another master key, or none: one line naming the archive and the fix; nothing published.
    for name, other in (("none", {}), ("other", _key_env(base / "keys", "other.key"))):
        target = base / f"t-{name}"
        code, _, err = run("import", str(archive), "--root", str(target), env=other)
        assert code == 2 and err.count("\n") == 1 and str(archive) in err, (name, err)
        assert "master key" in err and FILE_ENV in err, err
        assert _entries(target) == 0, name

    # The same master key: every entry reads back, byte for byte.
    good = base / "good"
    doc = run_json("import", str(archive), "--root", str(good), env=env)
    assert (doc["imported"], doc["skipped_key"], doc["stores"][0]["keys_added"]) == (4, 0, 3)
    assert _read_all(good, master) == want
    status = run_json("status", "--root", str(good), env=env)
    imported = status["encryption"]["imported_keys"]
    assert sorted(len(v) for v in imported.values()) == [1, 2]
    assert status["encryption"]["unreadable_entries"] == 0
    listing = run_json("keys", "ls", "--root", str(good), env=env)
    assert {v["origin"] for t in listing["tenants"] for v in t["versions"]} == {"imported"}
    checks = {c["name"]: c for c in run_json("doctor", "--root", str(good), env=env)["checks"]}
    assert "imported from archives" in checks["encryption.master_key"]["detail"]
    # New commits of an imported tenant use a key made here, not the imported one.
    with Store.open(good, master_key=master) as store:
        fresh = store.put(kind=KIND, namespace=NS, key="new", objects={"kv": b"n"},
                          tenant="acme")
        assert fresh.index["sealed"]["version"] not in \
            [k["version"] for k in table["keys"]]

    # A peer's root imported directly: its keyring's wrapped keys come along the same way.
    peer = base / "peer"
    doc = run_json("import", str(base / "src"), "--root", str(peer), env=env)
    assert doc["imported"] == 4 and _read_all(peer, master) == want

    # A signed stream (`export -o - --sign-key | import - --require-signed`).
    (base / "keys").mkdir(exist_ok=True)
    private, public, _ = keypair(base / "keys", "fleet")
    proc = script("export", "-o", "-", "--root", str(base / "src"), "--sign-key",
                  str(private), env=env, text=False)
    assert proc.returncode == 0, proc.stderr
    for name, the_env in (("stream-other", {}), ("stream", env)):
        target = base / name
        _stdin(monkeypatch, proc.stdout)
        code, _, err = run("import", "-", "--root", str(target), "--require-signed",
                           "--verify-key", str(public), env=the_env)
        if name == "stream":
            assert code == 0 and _read_all(target, master) == want, err
        else:
            assert code == 2 and err.count("\n") == 1 and "master key" in err, err
            assert _entries(target) == 0


def _live_data_keys(root: Path, master: MasterKey) -> list[bytes]:
    with Store.open(root, master_key=master, read_only=True) as store:
        ring = store.sealer.keyring
        return [ring.data_key(t.tenant_id, v) for t in ring.tenants() for v in t.versions]


def test_hostile_key_tables_are_refused_and_a_revoked_tenant_stays_revoked(fleet):
    base, env, master, archive = fleet
    data = archive.read_bytes()
    offset, index = _index(data)
    keys = index["stores"][0]["keys"]["keys"]
    acme = keys[0]  # two keys of two tenants (which is which does not matter)
    globex = next(k for k in keys if k["tenant"] != acme["tenant"])

    def edit(old: str, new: str) -> bytes:
        assert len(old) == len(new) and data.count(old.encode()) == 1
        return data.replace(old.encode(), new.encode())

    a, g = acme["wrapped"], globex["wrapped"]
    swapped = data.replace(a.encode(), b"@" * 120).replace(g.encode(), a.encode()) \
        .replace(b"@" * 120, g.encode())
    cases = {
        # a wrapped key moved to another tenant: it does not unwrap for that tenant
        "swapped": (swapped, "does not unwrap"),
        # a key table cut short inside a wrapped key
        "truncated": (edit(a, a[:100] + " " * 20), "malformed table of wrapped keys"),
    }
    for name, (bad, why) in cases.items():
        assert bad != data and len(bad) == len(data) and bad[:offset] == data[:offset]
        path = base / f"{name}.tar"
        path.write_bytes(bad)
        target = base / f"t-{name}"
        code, _, err = run("import", str(path), "--root", str(target), env=env)
        assert code == 1 and why in err and err.count("\n") == 1, (name, err)
        assert _entries(target) == 0, name

    # An archive without a key table (as written before decision 2813): its encrypted
    # entries are not published, since no key here opens them (they were misses before).
    legacy = base / "legacy.tar"
    legacy.write_bytes(edit('"keys": {', '"kexs": {'))
    doc = run_json("import", str(legacy), "--root", str(base / "t-legacy"), env=env)
    assert (doc["imported"], doc["skipped_key"]) == (0, 4), doc
    assert _entries(base / "t-legacy") == 0

    # A clash: the target holds another key under the same (tenant, version).
    clash = base / "clash"
    with Store.open(clash, create=True, master_key=master) as store:
        store.put(kind=KIND, namespace=NS, key="mine", objects={"kv": b"m"}, tenant="globex")
    ring = json.loads((clash / "state" / "keyring.json").read_text())
    rec = ring["tenants"].setdefault(globex["tenant"], {"keys": {}})
    nonce, forged = secrets.token_bytes(12), secrets.token_bytes(32)
    rec["keys"][str(globex["version"])] = nonce.hex() + AESGCM(
        master.derive(b"key-wrapping")).encrypt(
        nonce, forged, f"spoolctl-wrap/v1 {globex['tenant']} {globex['version']}".encode()).hex()
    (clash / "state" / "keyring.json").write_text(json.dumps(ring))
    code, _, err = run("import", str(archive), "--root", str(clash), env=env)
    assert code == 1 and "is not the key this store holds" in err and err.count("\n") == 1
    assert _entries(clash) == 1  # its own entry only

    # A tenant revoked on the target: its keys are not taken back, its entries skipped,
    # the other tenant's imported and readable.
    revoked = base / "revoked"
    run_json("import", str(archive), "--root", str(revoked), env=env)
    run_json("keys", "revoke", "--tenant-env", "SPOOLCTL_TENANT", "--yes", "--root", str(revoked),
             env={**env, "SPOOLCTL_TENANT": "acme"})
    # Crypto-erased entries do not travel: an export leaves them out (and carries no key).
    out = run_json("export", "-o", str(base / "after-revoke.tar"), "--root", str(revoked),
                   env=env)
    assert (out["entries"], out["left_out"]["key_erased"]) == (2, 2), out
    _, after = _index((base / "after-revoke.tar").read_bytes())
    assert len(after["stores"][0]["keys"]["keys"]) == 1  # globex's only
    run_json("clean", "--released", "--yes", "--root", str(revoked), env=env)
    doc = run_json("import", str(archive), "--root", str(revoked), env=env)
    assert (doc["imported"], doc["skipped_key"]) == (0, 2), doc
    assert doc["stores"][0]["keys_refused"] == 2
    got = _read_all(revoked, master)
    assert set(got) == {("globex", "p0"), ("globex", "p1")}
    listing = run_json("keys", "ls", "--root", str(revoked), env=env)
    (acme_row,) = [t for t in listing["tenants"] if t["revoked"]]
    assert acme_row["versions"] == [] and acme_row["current"] is None
