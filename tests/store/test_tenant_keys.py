"""Crypto-erase and rotation of tenant keys (issue 33 item 3, decision 2800).

``spoolctl keys revoke --tenant T`` must leave nothing of T that decrypts -- not its committed
entries, not an entry a writer was killed in the middle of committing, not its quarantined
evidence, not the archive it was exported to -- while every other tenant reads on; T's
entries become misses at once (no errors, nothing quarantined) and ``clean`` reclaims them.
``keys rotate`` starts a new version while the old one still reads; ``keys retire`` erases the
old one.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("cryptography")

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from faultseam import CRASH_EXIT_CODE
from operator_cli import ENV, run, run_json

from spoolctl.errors import KeyUnavailableError, QuarantineReason
from spoolctl.store import Store
from spoolctl.store.sealing import (
    COMMAND_ENV,
    FILE_ENV,
    MAGIC,
    MAGIC2,
    MAGIC3,
    NONCE_BYTES,
    VALUE_ENV,
    MasterKey,
)

KIND, NS = "pytorch", "model-x"


def _clear(tenant: str, i: int) -> bytes:
    return f"{tenant} secret prompt #{i}: ".encode() * 50


@pytest.fixture(autouse=True)
def no_operator_key(monkeypatch):
    for name in (FILE_ENV, VALUE_ENV, COMMAND_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def key_env(tmp_path: Path) -> dict[str, str]:
    path = Path(os.path.realpath(tmp_path)) / "keys" / "master.key"
    path.parent.mkdir()
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return {FILE_ENV: str(path)}


def _master(env: dict[str, str]) -> MasterKey:
    return MasterKey.from_environment(env)


def _blobs(data: bytes) -> bool:
    return data[:4] in (MAGIC, MAGIC2, MAGIC3)


def _live_keys(root: Path, env: dict[str, str]) -> list[bytes]:
    """Every data key the store's keyring still holds, of every tenant and version."""
    with Store.open(root, master_key=_master(env), read_only=True) as store:
        ring = store.sealer.keyring
        return [k for t in ring.tenants() for v in t.versions
                if (k := ring.data_key(t.tenant_id, v)) is not None]


def _decrypts(blob: bytes, keys: list[bytes]) -> bool:
    """True if any of ``keys`` opens the sealed ``blob`` (tried with every key, not only the
    one its header names). The tag also covers where the object belongs (SPS3), unknown
    for a file found lying around: the ciphertext is deciphered without it (GCM's counter
    mode) and the key opens the blob if the result is one of the test's plaintexts."""
    hb = 28 if blob[:4] == MAGIC else 32  # SPS1, or SPS2 / SPS3 headers
    nonce = blob[hb - NONCE_BYTES:hb]
    if blob[:4] == MAGIC3:
        for key in keys:
            ctr = Cipher(algorithms.AES(key), modes.CTR(nonce + b"\0\0\0\2")).decryptor()
            if b" secret prompt #" in ctr.update(blob[hb:hb + 64]):
                return True
        return False
    for key in keys:
        try:
            AESGCM(key).decrypt(nonce, blob[hb:], blob[:hb])
            return True
        except InvalidTag:
            continue
    return False


def _crash_mid_commit(root: Path, env: dict[str, str], tenant: str) -> None:
    """A writer of ``tenant`` killed after its object was published, before its manifest."""
    code = ("from spoolctl.store import Store\n"
            f"s = Store.open({str(root)!r})\n"
            f"s.put(kind={KIND!r}, namespace={NS!r}, key='inflight', "
            f"objects={{'kv': {_clear(tenant, 99)!r}}}, tenant={tenant!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**ENV, **env,
                                            "SPOOLCTL_CRASH_AT": "object.published",
                                            "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == CRASH_EXIT_CODE, proc.stderr


def test_revoke_leaves_nothing_of_the_tenant_that_decrypts(store_root: Path, tmp_path: Path,
                                                           key_env: dict[str, str]):
    with Store.open(store_root, create=True, master_key=_master(key_env)) as store:
        acme = [store.put(kind=KIND, namespace=NS, key=f"p{i}", objects={"kv": _clear("acme", i)},
                          tenant="acme") for i in range(3)]
        other = store.put(kind=KIND, namespace=NS, key="p0", objects={"kv": _clear("other", 0)},
                          tenant="other")
        store.quarantine_entry(acme[2].entry_id, QuarantineReason.PAYLOAD_DIGEST, "evidence")
    archive = tmp_path / "acme.tar"
    run_json("export", "-o", str(archive), "--root", str(store_root), env=key_env)
    _crash_mid_commit(store_root, key_env, "acme")
    assert any(_blobs(p.read_bytes()) for p in (store_root / "objects").rglob("*.obj")
               if p.stat().st_size) and list((store_root / "tmp").iterdir())

    doc = run_json("keys", "revoke", "--tenant-env", "SPOOLCTL_TENANT", "--yes",
                   "--root", str(store_root), env={**key_env, "SPOOLCTL_TENANT": "acme"})
    (v1,) = map(int, doc["tenants"][0]["versions"])  # 63-bit: strings in JSON
    assert doc["released_entries"] == 2 and v1 == acme[0].index["sealed"]["version"]

    files = {p: p.read_bytes() for p in store_root.rglob("*") if p.is_file()}
    with tarfile.open(archive) as tar:
        files |= {Path(m.name): tar.extractfile(m).read() for m in tar if m.isfile()}
    keys = _live_keys(store_root, key_env)
    sealed = {p: b for p, b in files.items() if _blobs(b)}
    assert len(sealed) >= 6  # 4 committed (one quarantined), 1 mid-commit, the archive's
    readable = [p for p, b in sealed.items() if _decrypts(b, keys)]
    other_obj = other.objects[0].digest
    assert all(other_obj in str(p) for p in readable), readable  # only the other tenant
    assert readable, "the other tenant must still decrypt (the check can fail)"
    assert not any(_clear("acme", i)[:20] in b for b in files.values() for i in (0, 1, 2, 99))

    with Store.open(store_root, master_key=_master(key_env)) as store:
        assert store.lookup(KIND, NS, "p0", tenant="acme") is None  # a miss at once
        with pytest.raises(KeyUnavailableError):
            store.read(store.manifest(acme[0].entry_id), "kv")
        assert [i.entry_id for i in store.quarantine.items()] == [acme[2].entry_id]
        assert bytes(store.read(store.lookup(KIND, NS, "p0", tenant="other"), "kv")) == \
            _clear("other", 0)
    cleaned = run_json("clean", "--released", "--yes", "--root", str(store_root), env=key_env)
    assert cleaned["steps"]["released"]["entries"] == 2, cleaned
    assert not any(list(store_root.joinpath("objects").rglob(f"{m.objects[0].digest}.obj"))
                   for m in acme[:2])
    with Store.open(store_root, master_key=_master(key_env)) as store:  # acme may come back
        again = store.put(kind=KIND, namespace=NS, key="p0", objects={"kv": b"new"},
                          tenant="acme")
        assert again.index["sealed"]["version"] not in (v1, other.index["sealed"]["version"])
        assert bytes(store.read(again, "kv")) == b"new"


def test_rotate_keeps_old_entries_until_retired(store_root: Path, key_env: dict[str, str]):
    with Store.open(store_root, create=True, master_key=_master(key_env)) as store:
        old = store.put(kind=KIND, namespace=NS, key="a", objects={"kv": b"old"}, tenant="t")
    doc = run_json("keys", "rotate", "--tenant-env", "SPOOLCTL_TENANT", "--root", str(store_root),
                   env={**key_env, "SPOOLCTL_TENANT": "t"})
    (v2,) = map(int, doc["tenants"][0]["versions"])  # 63-bit: strings in JSON
    v1 = old.index["sealed"]["version"]
    assert v2 != v1
    with Store.open(store_root, master_key=_master(key_env)) as store:
        new = store.put(kind=KIND, namespace=NS, key="b", objects={"kv": b"new"}, tenant="t")
        assert new.index["sealed"]["version"] == v2
        assert bytes(store.read(old, "kv")) == b"old"  # still readable
    listing = run_json("keys", "ls", "--root", str(store_root), env=key_env)
    (tenant,) = listing["tenants"]
    assert [(int(v["version"]), v["entries"], v["key"]) for v in tenant["versions"]] == \
        sorted([(v1, 1, "live"), (v2, 1, "live")])
    out = json.dumps(listing) + run("keys", "ls", "--root", str(store_root), env=key_env)[1]
    secret = Path(key_env[FILE_ENV]).read_text().strip()
    keyring = json.loads((store_root / "state" / "keyring.json").read_text())
    wrapped = [w for r in keyring["tenants"].values() for w in r["keys"].values()]
    assert secret not in out and not any(w[24:56] in out for w in wrapped)  # no key material
    code, _, err = run("keys", "retire", "--tenant-env", "SPOOLCTL_TENANT", "--yes",
                       "--root", str(store_root),
                       env={VALUE_ENV: secrets.token_hex(32),  # a wrong master key
                            "SPOOLCTL_TENANT": "t"})
    assert code == 1 and "not the one this store's keyring" in err
    run_json("keys", "retire", "--tenant-env", "SPOOLCTL_TENANT", "--yes",
             "--root", str(store_root), env={**key_env, "SPOOLCTL_TENANT": "t"})
    with Store.open(store_root, master_key=_master(key_env)) as store:
        with pytest.raises(KeyUnavailableError):
            store.read(old, "kv")
        assert bytes(store.read(new, "kv")) == b"new"


def test_an_entry_whose_key_is_gone_is_released_by_its_first_read(store_root: Path,
                                                                   key_env: dict[str, str]):
    """Keys erased but the catalog not yet told (a revoke killed between its two steps, or an
    entry sealed just before the revoke and committed after): the first read releases it."""
    with Store.open(store_root, create=True, master_key=_master(key_env)) as store:
        m = store.put(kind=KIND, namespace=NS, key="a", objects={"kv": b"x" * 100}, tenant="t")
        store.sealer.keyring.revoke(store.sealer.tenant_id("t"))
        assert store.live([m.entry_id])
        with pytest.raises(KeyUnavailableError):
            store.read(m, "kv")
        assert not store.live([m.entry_id])  # out of reuse: no error storm, clean reclaims it
        assert store.quarantine.items() == []


def test_keys_refuse_a_store_without_encryption(store_root: Path):
    run("init", "--root", str(store_root))
    code, _, err = run("keys", "revoke", "--tenant-env", "SPOOLCTL_TENANT", "--yes",
                       "--root", str(store_root), env={"SPOOLCTL_TENANT": "t"})
    assert code == 2 and "no encryption configured" in err and err.count("\n") == 1
    assert run_json("keys", "ls", "--root", str(store_root))["encrypted"] is False


def test_status_and_doctor_tell_an_encrypted_store_and_a_lost_key(store_root: Path,
                                                                  key_env: dict[str, str]):
    with Store.open(store_root, create=True, master_key=_master(key_env)) as store:
        made = [store.put(kind=KIND, namespace=NS, key=f"k{i}", objects={"kv": b"x"},
                          tenant="t") for i in range(2)]
    root = ("--root", str(store_root))
    status = run_json("status", *root, env=key_env)
    version = made[0].index["sealed"]["version"]
    assert status["encryption"]["entries_by_version"] == {str(version): 2}
    assert status["encryption"]["master_key"]["matches_keyring"] is True
    checks = {c["name"]: c for c in run_json("doctor", *root, env=key_env)["checks"]}
    assert checks["encryption.master_key"]["status"] == "ok"
    secret = Path(key_env[FILE_ENV]).read_text().strip()
    assert secret not in json.dumps(status) + run("status", *root, env=key_env)[1]

    lost = {VALUE_ENV: secrets.token_hex(32)}  # the key was lost and a new one configured
    doc = run_json("doctor", *root, env=lost, expect=1)
    (check,) = [c for c in doc["checks"] if c["name"] == "encryption.master_key"]
    assert check["status"] == "fail" and "all 2 encrypted entries are misses" in check["detail"]
    assert run_json("status", *root, env=lost)["encryption"]["master_key"][
        "matches_keyring"] is False
    doc = run_json("doctor", *root, expect=1)  # no key configured at all
    assert any(c["name"] == "encryption.master_key" and "no master key" in c["detail"]
               for c in doc["checks"])


def test_a_plain_store_shows_no_encryption(store: Store):
    store.put(kind=KIND, namespace=NS, key="k", objects={"kv": b"x"})
    assert "encryption" not in run_json("status", "--root", str(store.root))
    assert not any(c["name"].startswith("encryption")
                   for c in run_json("doctor", "--root", str(store.root))["checks"])


def test_no_key_material_in_any_output_or_log(store_root: Path, tmp_path: Path, caplog,
                                              key_env: dict[str, str]):
    """Every operator output about an encrypted store -- human and --json, success and
    failure -- and every log record (at DEBUG) is free of the master key, the keys derived
    from it and every data key, as raw bytes, hex (either case) or base64."""
    master = _master(key_env)
    with Store.open(store_root, create=True, master_key=master) as store:
        for tenant in ("acme", "globex", None):
            store.put(kind=KIND, namespace=NS, key="p", objects={"kv": _clear(str(tenant), 0)},
                      tenant=tenant)
        sealer = store.sealer
        derived = [master.derive(label) for label in (b"key-wrapping", b"tenant-id")] + \
            [master.derive(b"entry-names " + t.tenant_id.encode())
             for t in sealer.keyring.tenants()]
    data_keys = _live_keys(store_root, key_env)
    assert len(data_keys) == 3
    secrets_ = [bytes.fromhex(Path(key_env[FILE_ENV]).read_text()), *derived, *data_keys]
    root = ("--root", str(store_root))
    outputs: list[str] = []
    with caplog.at_level("DEBUG"):
        by_env = ("--tenant-env", "SPOOLCTL_TENANT")
        runs = [("keys", "ls"), ("keys", "ls", "--json"), ("keys", "rotate", "--json"),
                ("keys", "rotate", *by_env, "acme"),
                ("keys", "retire", *by_env, "--yes", "acme"),
                ("keys", "revoke", *by_env, "--dry-run", "globex"),
                ("--debug", "keys", "revoke", *by_env, "--yes", "--json", "globex"),
                ("status",), ("status", "--json"), ("doctor", "--json"),
                ("export", "-o", str(tmp_path / "a.tar"), "--json")]
        for argv in runs:
            tenant = argv[-1] if by_env[0] in argv else None
            argv = argv[:-1] if tenant else argv
            code, out, err = run(*argv, *root, env={**key_env, "SPOOLCTL_TENANT": tenant or ""})
            assert code == 0, (argv, err)
            outputs += [out, err]
        wrong = {VALUE_ENV: secrets.token_hex(32)}  # failures, too
        for argv in [("keys", "rotate"), ("doctor",)]:
            code, out, err = run(*argv, *root, env=wrong)
            assert code == 1, (argv, err)
            outputs += [out, err]
        with Store.open(store_root, master_key=master) as store:  # the library's own logs
            m = store.lookup(KIND, NS, "p", tenant="acme") or store.manifest(
                store.entry_id(KIND, NS, "p", tenant="acme"))
            with pytest.raises(KeyUnavailableError) as err:
                store.read(m, "kv")
            outputs.append(f"{err.value} {err.value!r}")
    outputs += [caplog.text] + [repr(r.args) + r.getMessage() for r in caplog.records]
    assert any("tenant" in o for o in outputs)  # the outputs were really collected
    text = "\n".join(outputs)
    raw = text.encode("utf-8", "surrogateescape")
    for key in secrets_:
        forms = [key.hex(), key.hex().upper(), base64.b64encode(key).decode(),
                 base64.urlsafe_b64encode(key).decode(), base64.b64encode(key).decode()[:24],
                 repr(key)[2:-1]]  # a bytes object formatted into a message
        leaked = key in raw or any(f in text for f in forms)
        assert not leaked, f"key material found in an output (key {secrets_.index(key)})"


def test_key_versions_are_unique_per_key_and_old_keyrings_still_read(tmp_path: Path,
                                                                    key_env: dict[str, str]):
    """Decision 2812: two stores under one master key never give the same (tenant, version)
    to two different keys (versions were counters: both hosts had a version 1, so a key
    carried from one to the other would have collided). A store from before keeps its
    counters (what it seals under one now is bound, SPS3: decision 3020); its next key is a
    random id."""
    master = _master(key_env)
    base = Path(os.path.realpath(tmp_path))
    made = []
    for name in ("a", "b"):
        with Store.open(base / name, create=True, master_key=master) as store:
            m = store.put(kind=KIND, namespace=NS, key="k", objects={"kv": b"x"}, tenant="t")
            made.append((m.index["sealed"]["version"],
                         store.sealer.keyring.data_key(store.sealer.tenant_id("t"),
                                                       m.index["sealed"]["version"])))
    assert made[0][1] != made[1][1] and made[0][0] != made[1][0]
    assert all(v >= 1 << 32 for v, _ in made)

    # A keyring written before decision 2812: counters, no "current".
    old_root = base / "old"
    with Store.open(old_root, create=True, master_key=master) as store:
        tid = store.sealer.tenant_id("t")
    nonce, key = secrets.token_bytes(NONCE_BYTES), secrets.token_bytes(32)
    wrapped = AESGCM(master.derive(b"key-wrapping")).encrypt(
        nonce, key, f"spoolctl-wrap/v1 {tid} 1".encode())
    (old_root / "state" / "keyring.json").write_text(json.dumps({
        "schema": "spoolctl-keyring/v1", "master_id": master.key_id,
        "tenants": {tid: {"next": 2, "keys": {"1": nonce.hex() + wrapped.hex()}}}}))
    with Store.open(old_root, master_key=master) as store:
        legacy = store.put(kind=KIND, namespace=NS, key="old", objects={"kv": b"legacy" * 9},
                           tenant="t")
        obj = store.layout.object_path(legacy.objects[0].digest).read_bytes()
        assert legacy.index["sealed"]["version"] == 1 and obj[:4] == MAGIC3
        assert len(obj) == 54 + 48  # the SPS3 header (a u64 version) and tag
    doc = run_json("keys", "rotate", "--tenant-env", "SPOOLCTL_TENANT", "--root", str(old_root),
                   env={**key_env, "SPOOLCTL_TENANT": "t"})
    (new,) = map(int, doc["tenants"][0]["versions"])  # 63-bit: strings in JSON
    with Store.open(old_root, master_key=master) as store:
        fresh = store.put(kind=KIND, namespace=NS, key="new", objects={"kv": b"fresh" * 9},
                          tenant="t")
        assert fresh.index["sealed"]["version"] == new >= 1 << 32
        assert store.layout.object_path(fresh.objects[0].digest).read_bytes()[:4] == MAGIC3
        assert bytes(store.read(legacy, "kv")) == b"legacy" * 9
        assert bytes(store.read(fresh, "kv")) == b"fresh" * 9
    doc = run_json("keys", "retire", "--tenant-env", "SPOOLCTL_TENANT", "--yes",
                   "--root", str(old_root), env={**key_env, "SPOOLCTL_TENANT": "t"})
    assert doc["tenants"][0]["versions"] == [1] and doc["released_entries"] == 1
    listing = run_json("keys", "ls", "--root", str(old_root), env=key_env)
    assert [(int(v["version"]), v["key"]) for v in listing["tenants"][0]["versions"]] == \
        [(new, "live")]


def _marker(root: Path) -> dict:
    return json.loads((root / ".spoolctl-root").read_text())


def test_a_store_with_sps2_objects_requires_it_in_its_marker(tmp_path: Path,
                                                            key_env: dict[str, str]):
    """Decision 2831: before the first key that seals SPS2 objects (decision 2812) exists,
    the store's marker becomes ``spoolctl-root/v2`` requiring ``sealed-v2``. Every spoolctl
    before it opens only a ``spoolctl-root/v1`` marker, so a downgrade refuses the store with
    one line instead of quarantining its SPS2 objects as corrupt; this version refuses a
    feature it does not know the same way. A max-size change keeps the requirement, and a
    store whose SPS2 keys are older than this gets it at its next writable open."""
    from spoolctl.errors import RootError

    master = _master(key_env)
    root = Path(os.path.realpath(tmp_path)) / "s"
    with Store.open(root, create=True, master_key=master) as store:
        assert _marker(root)["requires"] == ["hints-log"]  # nothing sealed yet
        m = store.put(kind=KIND, namespace=NS, key="k", objects={"kv": b"x" * 99}, tenant="t")
        assert m.index["sealed"]["version"] >= 1 << 32
        doc = _marker(root)
        # what every earlier spoolctl compares (root.marker_from_json since the first commit)
        # SPS2 keys, and objects bound to their entry (SPS3, decision 3020)
        assert doc["schema"] == "spoolctl-root/v2" and \
            doc["requires"] == ["hints-log", "sealed-v2", "sealed-v3"], doc
        store.set_max_bytes(1 << 30)  # from the copy read before the key was made
        assert _marker(root)["requires"] == ["hints-log", "sealed-v2", "sealed-v3"]
        assert _marker(root)["max_bytes"] == 1 << 30
    with Store.open(root, master_key=master, max_bytes=1 << 31) as store:
        assert bytes(store.read(m, "kv")) == b"x" * 99
        assert store.marker.requires == ("hints-log", "sealed-v2", "sealed-v3")
    assert _marker(root)["requires"] == ["hints-log", "sealed-v2", "sealed-v3"]

    # A store whose SPS2 key was made before decision 2831 (a v1 marker): marked when it is
    # next opened writable; a read-only open writes nothing.
    doc = _marker(root)
    (root / ".spoolctl-root").write_text(json.dumps(
        {k: v for k, v in doc.items() if k != "requires"} | {"schema": "spoolctl-root/v1"}))
    Store.open(root, master_key=master, read_only=True).close()
    assert _marker(root)["schema"] == "spoolctl-root/v1"
    Store.open(root, master_key=master).close()
    assert _marker(root)["schema"] == "spoolctl-root/v2"

    # A feature of a newer spoolctl: refused at open, one line naming it and the fix.
    doc = _marker(root)
    (root / ".spoolctl-root").write_text(json.dumps(doc | {"requires": ["sealed-v2",
                                                                        "chunked-aead"]}))
    with pytest.raises(RootError, match="chunked-aead") as err:
        Store.open(root, master_key=master)
    assert "upgrade spoolctl" in str(err.value)
    code, _, errs = run("status", "--root", str(root), env=key_env)
    assert code != 0 and "chunked-aead" in errs and len(errs.strip().splitlines()) == 1, errs

