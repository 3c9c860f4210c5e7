"""Sealed objects are bound to their place (issue 47 item 2, decision 3020).

A store's writer (no key) moves one sealed object to another place: over another entry's
object of the same size, or by rewriting a manifest (digests recomputed, no tag key) to name
another object. Across entries of one tenant, across tenants, and across roles within an
entry (key vs value tensors; the sealed token meta vs the KV), the moved object must fail to
open, be quarantined, and the request be a miss that recomputes -- through the store API and
through a real PyTorch controller, whose greedy tokens then equal a cold run. Entries sealed
by an older spoolctl (SPS2: the tag covered only the header) are refused as a miss with a
reason and written again at their next commit, never opened.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import blake3
import pytest

pytest.importorskip("cryptography")

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from spoolctl.errors import CorruptionError, KeyUnavailableError
from spoolctl.store import Store
from spoolctl.store.format.manifest import canonical_json
from spoolctl.store.sealing import (
    COMMAND_ENV,
    FILE_ENV,
    MAGIC2,
    MAGIC3,
    NONCE_BYTES,
    VALUE_ENV,
    MasterKey,
)

KIND, NS = "pytorch", "tiny-ns"


@pytest.fixture(autouse=True)
def no_operator_key(monkeypatch):
    for name in (FILE_ENV, VALUE_ENV, COMMAND_ENV):
        monkeypatch.delenv(name, raising=False)


def _object_file(store: Store, manifest, name: str) -> Path:
    return store.layout.object_path(manifest.object(name).digest)


def _point(root: Path, entry_id: str, name: str, digest: str, size: int) -> None:
    """Rewrite an entry's manifest so that object ``name`` is ``digest`` (``size`` bytes),
    with its envelope digest recomputed: what a writer without a tag key can do."""
    path = root / "manifests" / entry_id[:2] / f"{entry_id}.json"
    doc = json.loads(path.read_text())
    for ref in doc["body"]["objects"]:
        if ref["name"] == name:
            ref["digest"], ref["size"] = digest, size
    doc["digest"] = blake3.blake3(canonical_json(doc["body"])).hexdigest()
    tmp = path.with_suffix(".forged")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _move(store: Store, src, src_name: str, dst, dst_name: str, how: str) -> None:
    """Put object ``src_name`` of ``src`` in the place of ``dst_name`` of ``dst``: its bytes
    copied over the file (``copy``, same size) or the manifest pointed at it (``point``)."""
    ref = src.object(src_name)
    if how == "copy":
        target = _object_file(store, dst, dst_name)
        assert target.stat().st_size == ref.size
        target.write_bytes(_object_file(store, src, src_name).read_bytes())
    else:
        _point(store.root, dst.entry_id, dst_name, ref.digest, ref.size)


def _payload(tenant: str, key: str, role: str) -> bytes:
    return f"{tenant}/{key}/{role}:".encode().ljust(4096, b"#")


SWAPS = {
    # (source tenant, source key, source role) -> (victim tenant, victim key, victim role)
    "across-entries": (("alice", "p2", "v"), ("alice", "p1", "v")),
    "across-tenants": (("alice", "p1", "v"), ("bob", "p1", "v")),
    "key-vs-value": (("alice", "p1", "k"), ("alice", "p1", "v")),
    "meta-vs-kv": (("alice", "p1", "kv"), ("alice", "p1", "prefix")),
}


@pytest.mark.parametrize("how", ["copy", "point"])
@pytest.mark.parametrize("swap", sorted(SWAPS))
def test_a_moved_sealed_object_fails_to_open_and_is_a_miss(store_root: Path, swap: str,
                                                           how: str):
    master = MasterKey.from_hex(secrets.token_hex(32), "test")
    (src_t, src_k, src_role), (dst_t, dst_k, dst_role) = SWAPS[swap]
    roles = ("prefix", "kv") if "kv" in (src_role, dst_role) else ("k", "v")
    with Store.open(store_root, create=True, master_key=master) as store:
        made = {(t, k): store.put(kind=KIND, namespace=NS, key=k, tenant=t,
                                  objects={r: _payload(t, k, r) for r in roles})
                for t in ("alice", "bob") for k in ("p1", "p2")}
        assert all(_object_file(store, m, r).read_bytes()[:4] == MAGIC3
                   for m in made.values() for r in roles)
        src, victim = made[(src_t, src_k)], made[(dst_t, dst_k)]
        _move(store, src, src_role, victim, dst_role, how)

        found = store.lookup(KIND, NS, dst_k, tenant=dst_t)
        assert found is not None and found.entry_id == victim.entry_id
        with pytest.raises(CorruptionError):
            store.read(found, dst_role)
        assert victim.entry_id in [i.entry_id for i in store.quarantine.items()]
        assert store.lookup(KIND, NS, dst_k, tenant=dst_t) is None  # a miss from now on

        # the request recomputes: committed again, it reads back its own bytes
        again = store.put(kind=KIND, namespace=NS, key=dst_k, tenant=dst_t,
                          objects={r: _payload(dst_t, dst_k, r) for r in roles})
        assert bytes(store.read(again, dst_role)) == _payload(dst_t, dst_k, dst_role)


def test_a_manifest_naming_another_tenant_is_refused(store_root: Path):
    """A writer who rewrites bob's manifest to say it is sealed under alice's key (and names
    alice's object) gets nothing: the tenant comes from the entry bob asked for."""
    master = MasterKey.from_hex(secrets.token_hex(32), "test")
    with Store.open(store_root, create=True, master_key=master) as store:
        alice = store.put(kind=KIND, namespace=NS, key="p", tenant="alice",
                          objects={"kv": _payload("alice", "p", "kv")})
        bob = store.put(kind=KIND, namespace=NS, key="p", tenant="bob",
                        objects={"kv": _payload("bob", "p", "kv")})
        path = store_root / "manifests" / bob.entry_id[:2] / f"{bob.entry_id}.json"
        doc = json.loads(path.read_text())
        doc["body"]["index"]["sealed"] = dict(alice.index["sealed"])
        doc["body"]["objects"] = [dict(o) for o in json.loads(
            (store_root / "manifests" / alice.entry_id[:2] /
             f"{alice.entry_id}.json").read_text())["body"]["objects"]]
        doc["digest"] = blake3.blake3(canonical_json(doc["body"])).hexdigest()
        path.write_text(json.dumps(doc))
        found = store.lookup(KIND, NS, "p", tenant="bob")
        assert found is not None
        with pytest.raises(CorruptionError):
            store.read(found, "kv")
        assert store.lookup(KIND, NS, "p", tenant="bob") is None


def _legacy(store: Store, manifest, payload: bytes) -> None:
    """Rewrite ``manifest``'s one object the way spoolctl sealed it before objects were bound
    (an SPS2 header, the tag over the header only) and its sealed fact without ``bound``."""
    tid, version = manifest.index["sealed"]["tenant"], manifest.index["sealed"]["version"]
    key = store.sealer.keyring.data_key(tid, version)
    nonce = secrets.token_bytes(NONCE_BYTES)
    header = MAGIC2 + bytes.fromhex(tid) + version.to_bytes(8, "big") + nonce
    blob = header + AESGCM(key).encrypt(nonce, payload, header)
    digest = blake3.blake3(blob).hexdigest()
    path = store.layout.object_path(digest)
    path.write_bytes(blob)
    path.chmod(0o600)
    name = manifest.objects[0].name
    _point(store.root, manifest.entry_id, name, digest, len(blob))
    mpath = store.layout.manifest_path(manifest.entry_id)
    doc = json.loads(mpath.read_text())
    doc["body"]["index"]["sealed"] = {"tenant": tid, "version": version}
    doc["digest"] = blake3.blake3(canonical_json(doc["body"])).hexdigest()
    mpath.write_text(json.dumps(doc))


def test_an_entry_sealed_by_an_older_spoolctl_is_a_miss_then_rewritten(store_root: Path):
    """Decision 3020: SPS2 objects bind nothing but their header, so they are never opened:
    a miss with a reason (not corruption, nothing quarantined), the entry released; its next
    commit writes it again, bound."""
    master = MasterKey.from_hex(secrets.token_hex(32), "test")
    with Store.open(store_root, create=True, master_key=master) as store:
        m = store.put(kind=KIND, namespace=NS, key="old", tenant="alice",
                      objects={"kv": b"fresh" * 50})
        _legacy(store, m, b"legacy" * 50)
    with Store.open(store_root, master_key=master) as store:
        found = store.lookup(KIND, NS, "old", tenant="alice")
        assert found is not None and "bound" not in found.index["sealed"]
        with pytest.raises(KeyUnavailableError, match="older spoolctl"):
            store.read(found, "kv")
        assert store.quarantine.items() == [] and not store.live([m.entry_id])
        again = store.put(kind=KIND, namespace=NS, key="old", tenant="alice",
                          objects={"kv": b"again" * 50})
        assert again.index["sealed"]["bound"] is True
        assert bytes(store.read(store.lookup(KIND, NS, "old", tenant="alice"), "kv")) == \
            b"again" * 50


# -- through a real PyTorch controller ------------------------------------------------------

SYSTEM = "You are a helpful assistant. Answer using the reference documents below."
DOCS = {"p1": "Ward 7 note: patient 4711, hypertension, started on amlodipine. " * 3,
        "p2": "Ward 8 note: patient 4712, hypotension, started on amlodipina. " * 3}
QUESTION = "Question: what was the patient started on?"


def test_moved_objects_through_the_pytorch_controller_run_cold(tiny_model_dir: Path,
                                                                tmp_path: Path, monkeypatch):
    pytest.importorskip("transformers")
    from controller_backends import cold_tokens

    from spoolctl.controllers import CachePrepareParams, Element
    from spoolctl.controllers.local.tenancy import PREFIX_OBJECT
    from spoolctl.controllers.pytorch import KV_OBJECT, PyTorchBackend, PyTorchCacheController

    monkeypatch.setenv(VALUE_ENV, secrets.token_hex(32))
    backend = PyTorchBackend(tiny_model_dir, model_id="tiny")
    params = {k: CachePrepareParams(model=None, instructions=[Element(SYSTEM, role="system")],
                                    data=[Element(d, role="user")]) for k, d in DOCS.items()}
    want = {k: cold_tokens(backend, p, QUESTION, 4) for k, p in params.items()}
    base = Path(os.path.realpath(tmp_path))
    pristine = base / "pristine"
    refs = {}
    for tenant, key in (("alice", "p1"), ("alice", "p2"), ("bob", "p1")):
        with PyTorchCacheController(backend, pristine, tenant=tenant) as ctl:
            out = ctl.generate(params[key], QUESTION, 4)
            assert out.handle.source in ("cold", "incremental") and out.tokens == want[key]
            refs[(tenant, key)] = out.handle.ref
    with Store.open(pristine, read_only=True, master_key=None) as store:
        mans = {k: store.manifest(ref) for k, ref in refs.items()}
    # equal shapes: a moved KV would load without complaint if it opened
    assert mans[("alice", "p1")].object(KV_OBJECT).size == \
        mans[("alice", "p2")].object(KV_OBJECT).size == mans[("bob", "p1")].object(KV_OBJECT).size

    cases = [  # (source, its role) -> (victim, its role), how
        ((("alice", "p1"), KV_OBJECT), (("bob", "p1"), KV_OBJECT), "copy"),
        ((("alice", "p2"), KV_OBJECT), (("alice", "p1"), KV_OBJECT), "copy"),
        ((("alice", "p2"), PREFIX_OBJECT), (("alice", "p1"), PREFIX_OBJECT), "point"),
        ((("alice", "p1"), KV_OBJECT), (("alice", "p1"), PREFIX_OBJECT), "point"),
        ((("alice", "p1"), PREFIX_OBJECT), (("alice", "p1"), KV_OBJECT), "point"),
    ]
    for n, ((src, src_role), (victim, dst_role), how) in enumerate(cases):
        root = base / f"case{n}"
        shutil.copytree(pristine, root, symlinks=True)
        with Store.open(root, master_key=MasterKey.from_environment()) as store:
            _move(store, mans[src], src_role, mans[victim], dst_role, how)
        tenant, key = victim
        with PyTorchCacheController(backend, root, tenant=tenant) as ctl:
            got = ctl.generate(params[key], QUESTION, 4)
            quarantined = [i.entry_id for i in ctl.store.quarantine.items()]
        # recomputed: cold, or on another (healthy) entry of the tenant as a base
        assert got.handle.source in ("cold", "incremental"), (n, got.handle.source)
        assert got.tokens == want[key], n
        assert refs[victim] in quarantined, (n, quarantined)
