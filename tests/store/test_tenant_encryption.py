"""Encryption at rest with per-tenant keys (issue 33, decision 2800).

What a user relies on: with a master key configured, nothing a tenant committed lies on disk
in clear; two tenants' equal prompts give unrelated names; a tampered object is corruption
(quarantined, a miss) while a missing key is only a miss; the master key comes from a file,
a variable or a command, with one clear line when it is unusable; and without a key nothing
changes. Revoke and rotation are ``test_tenant_keys.py``.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest
from page_cache import dirty_pages, skip_without_dirty_accounting

pytest.importorskip("cryptography")

from spoolctl.errors import KeyUnavailableError
from spoolctl.store import ConfigError, CorruptionError, Store
from spoolctl.store.sealing import (
    COMMAND_ENV,
    FILE_ENV,
    HEADER_BYTES,
    VALUE_ENV,
    Binding,
    MasterKey,
    overhead,
)

KIND, NS = "pytorch", "model-x"
SECRET = b"patient 4711: diagnosis hypertension; " * 64


@pytest.fixture(autouse=True)
def no_operator_key(monkeypatch):
    for name in (FILE_ENV, VALUE_ENV, COMMAND_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def master_hex() -> str:
    return secrets.token_hex(32)


@pytest.fixture
def master(master_hex: str) -> MasterKey:
    return MasterKey.from_hex(master_hex, "test")


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_entries_are_sealed_per_tenant_and_read_back(store_root: Path, master: MasterKey,
                                                      master_hex: str):
    with Store.open(store_root, create=True, master_key=master) as store:
        a = store.put(kind=KIND, namespace=NS, key="prompt", objects={"kv": SECRET},
                      tenant="alice")
        b = store.put(kind=KIND, namespace=NS, key="prompt", objects={"kv": SECRET},
                      tenant="bob")
        # Equal prompts and bytes of two tenants: unrelated entries and object names.
        assert a.entry_id != b.entry_id
        assert a.objects[0].digest != b.objects[0].digest
        assert "prompt" not in a.key and "alice" not in a.key
        assert bytes(store.read(a, "kv")) == SECRET
        buf = bytearray(len(SECRET))
        store.read(b, "kv", into=memoryview(buf))
        assert bytes(buf) == SECRET
        # Found only with the tenant that wrote it.
        assert store.lookup(KIND, NS, "prompt", tenant="alice").entry_id == a.entry_id
        assert store.lookup(KIND, NS, "prompt", tenant="carol") is None
        assert store.lookup(KIND, NS, "prompt") is None
    for path in _files(store_root):  # no clear text and no tenant name anywhere on disk
        data = path.read_bytes()
        assert SECRET[:32] not in data, path
        assert b"alice" not in data and b"bob" not in data, path
    # The same store reopened by the same key in another process reads the same bytes.
    with Store.open(store_root, master_key=MasterKey.from_hex(master_hex, "again")) as s:
        assert bytes(s.read(s.manifest(a.entry_id), "kv")) == SECRET


def test_a_tampered_object_is_quarantined_and_a_miss(store_root: Path, master: MasterKey):
    with Store.open(store_root, create=True, master_key=master) as store:
        m = store.put(kind=KIND, namespace=NS, key="k", objects={"kv": SECRET}, tenant="t")
        path = store.layout.object_path(m.objects[0].digest)
        data = bytearray(path.read_bytes())
        data[100] ^= 1
        path.chmod(0o600)
        path.write_bytes(bytes(data))
        buf = bytearray(b"x" * len(SECRET))
        with pytest.raises(CorruptionError, match="authentication"):
            store.read(m, "kv", into=memoryview(buf))
        assert bytes(buf) == bytes(len(SECRET))  # nothing unauthenticated left in the buffer
        assert [i.reason for i in store.quarantine.items()] == ["payload_digest"]
        assert store.lookup(KIND, NS, "k", tenant="t") is None


def test_another_master_key_is_a_miss_not_corruption(store_root: Path, master: MasterKey):
    with Store.open(store_root, create=True, master_key=master) as store:
        m = store.put(kind=KIND, namespace=NS, key="k", objects={"kv": SECRET}, tenant="t")
    other = MasterKey.from_hex(secrets.token_hex(32), "lost")
    with Store.open(store_root, master_key=other) as store:
        with pytest.raises(KeyUnavailableError):
            store.read(store.manifest(m.entry_id), "kv")
        assert store.quarantine.items() == []  # the entry is intact: a miss, no evidence
    with Store.open(store_root, master_key=None) as store, \
            pytest.raises(KeyUnavailableError, match="no master key"):
        store.read(store.manifest(m.entry_id), "kv")


def test_without_a_master_key_nothing_changes(store: Store):
    m = store.put(kind=KIND, namespace=NS, key="k", objects={"kv": SECRET})
    assert store.sealer is None and "sealed" not in m.index
    assert store.layout.object_path(m.objects[0].digest).read_bytes() == SECRET
    assert not (store.layout.state / "keyring.json").exists()
    with pytest.raises(ConfigError, match="no encryption configured"):
        store.put(kind=KIND, namespace=NS, key="k2", objects={"kv": SECRET}, tenant="alice")


def _key_file(tmp_path: Path, mode: int = 0o600) -> Path:
    path = Path(os.path.realpath(tmp_path)) / "keys" / "master.key"
    path.parent.mkdir(exist_ok=True)
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(mode)
    return path


def test_master_key_from_file_variable_and_command(tmp_path: Path, store_root: Path):
    path = _key_file(tmp_path)
    hexkey = path.read_text().strip()
    by_file = MasterKey.from_environment({FILE_ENV: str(path)})
    by_value = MasterKey.from_environment({VALUE_ENV: hexkey})
    by_command = MasterKey.from_environment({COMMAND_ENV: f"cat {path}"})
    assert by_file.key_id == by_value.key_id == by_command.key_id
    assert hexkey not in repr(by_file)
    assert MasterKey.from_environment({}) is None
    with pytest.raises(ConfigError, match="mode 0640"):
        MasterKey.from_file(_key_file(tmp_path, 0o640))
    with pytest.raises(ConfigError, match="only one source"):
        MasterKey.from_environment({FILE_ENV: str(path), VALUE_ENV: hexkey})
    with pytest.raises(ConfigError, match="exited with 1"):
        MasterKey.from_environment({COMMAND_ENV: "false"})
    with pytest.raises(ConfigError, match="64 hex"):
        MasterKey.from_environment({COMMAND_ENV: "echo not-a-key"})
    inside = store_root / "master.key"
    store_root.mkdir()
    inside.write_text(hexkey)
    inside.chmod(0o600)
    with pytest.raises(ConfigError, match="inside the store root"):
        Store.open(store_root, create=True, master_key=MasterKey.from_file(inside))


def test_the_environment_configures_the_store(tmp_path: Path, store_root: Path, monkeypatch):
    monkeypatch.setenv(FILE_ENV, str(_key_file(tmp_path)))
    with Store.open(store_root, create=True) as store:
        m = store.put(kind=KIND, namespace=NS, key="k", objects={"kv": SECRET})
        (default,) = store.sealer.keyring.tenants()  # the default tenant
        assert m.index["sealed"]["version"] == default.current
        assert bytes(store.read(m, "kv")) == SECRET


def test_without_cryptography_one_clear_line(monkeypatch):
    for name in [m for m in sys.modules if m == "cryptography" or m.startswith("cryptography.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "cryptography", None)
    with pytest.raises(ConfigError) as err:
        MasterKey.from_hex("00" * 32, "test")
    assert "spoolctl[crypto]" in str(err.value) and "\n" not in str(err.value)


def test_scrub_and_request_auth_need_no_key(store_root: Path, master: MasterKey,
                                             master_hex: str):
    """Scrub and request-auth check an encrypted entry against its ciphertext's digest (the
    object's name): cron needs no key, an entry is found whether or not the key is there (or
    still exists), and a flipped byte is quarantined either way (decision 2800, "Scrub")."""
    from operator_cli import run_json

    with Store.open(store_root, create=True, master_key=master) as store:
        ms = [store.put(kind=KIND, namespace=NS, key=f"k{i}", objects={"kv": SECRET + bytes([i])},
                        tenant=t) for i, t in enumerate(("alice", "alice", "bob", "bob"))]
    root = ("--root", str(store_root))
    keyed = {VALUE_ENV: master_hex,
             "SPOOLCTL_KEY_LEDGER": str(store_root.parent / "erased-keys.json")}
    for env in (None, keyed):
        doc = run_json("request-auth", ms[0].entry_id, *root, env=env)
        assert doc["result"] == "verified" and doc["proves"] == "integrity", doc
    run_json("keys", "revoke", "--tenant-env", "SPOOLCTL_TENANT", "--yes", *root,
             env={**keyed, "SPOOLCTL_TENANT": "alice"})
    doc = run_json("request-auth", ms[1].entry_id, *root, env=keyed)  # key gone, bytes intact
    assert doc["result"] == "verified", doc

    for m in (ms[2], ms[3]):  # one flipped byte in each of bob's objects
        path = next(store_root.joinpath("objects").rglob(f"{m.objects[0].digest}.obj"))
        data = bytearray(path.read_bytes())
        data[HEADER_BYTES + 5] ^= 1
        path.chmod(0o600)
        path.write_bytes(bytes(data))
    doc = run_json("request-auth", ms[2].entry_id, *root, expect=1)
    assert doc["result"] == "quarantined" and doc["reason"] == "payload_digest", doc
    doc = run_json("scrub", "--until-complete", *root, expect=1)  # no key at all
    assert [q["entry_id"] for q in doc["quarantined"]] == [ms[3].entry_id], doc
    assert doc["cycle_completed"], doc


def test_large_objects_seal_and_open_in_pieces_without_a_second_copy(store_root: Path,
                                                                     master: MasterKey):
    """An encrypted commit and read of a large object (KV staged by a worker, restored into
    host KV) never hold a second buffer of its size: the commit encrypts piece by piece as it
    writes, the read decrypts piece by piece into the caller's buffer (decision 2820). The
    bytes on disk stay the one-shot format (``Sealer.seal`` / ``unseal`` read them), and a
    flipped byte deep inside is still corruption, the caller's buffer wiped."""
    import tracemalloc

    from spoolctl.store.sealing import overhead

    size = (9 << 20) + 13  # several pieces, past the pipelined read's threshold, odd tail
    data = os.urandom(size)
    with Store.open(store_root, create=True, master_key=master) as store:
        # the tenant's key made first (a keyring reload reads into a 16 MiB buffer)
        store.put(kind=KIND, namespace=NS, key="warm", objects={"kv": b"w" * 4096}, tenant="t")
        out = memoryview(bytearray(size))
        tracemalloc.start()
        try:
            m = store.put(kind=KIND, namespace=NS, key="big", objects={"kv": data}, tenant="t")
            _, commit_peak = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            store.read(m, "kv", into=out)
            _, read_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert bytes(out) == data
        assert commit_peak < size // 4, commit_peak
        assert read_peak < size // 2, read_peak
        path = store.layout.object_path(m.objects[0].digest)
        sealed = path.read_bytes()
        assert len(sealed) == size + overhead(m.index["sealed"]["version"])
        tid, version = m.index["sealed"]["tenant"], m.index["sealed"]["version"]
        binding = Binding(m.entry_id, "kv", tid, version)
        assert bytes(store.sealer.unseal(memoryview(sealed), binding=binding)) == data
        # an object sealed in one buffer (before decision 2820) reads back the same
        key = store.sealer.keyring.data_key(tid, version)
        path.chmod(0o600)
        path.write_bytes(bytes(store.sealer.seal(binding, key, data)))
        assert bytes(store.read(m, "kv")) == data
        tampered = bytearray(path.read_bytes())
        tampered[HEADER_BYTES + (5 << 20) + 7] ^= 1
        path.write_bytes(bytes(tampered))
        out[:] = b"\xff" * size
        with pytest.raises(CorruptionError):
            store.read(m, "kv", into=out)
        assert not any(out), "unauthenticated plaintext left in the caller's buffer"
        assert store.lookup(KIND, NS, "big", tenant="t") is None


def test_an_encrypted_commit_starts_write_back_of_each_piece_before_its_fsync(
        store_root: Path, master: MasterKey):
    """The encrypted commit writes each sealed piece at once and starts its write-back
    (``sync_file_range``) while the next piece is encrypted, so the disk works during the
    encryption and the final fsync has little left (decision 2830). Seen from the page
    cache: when the last piece is written, before the fsync, almost nothing of the object
    is still dirty (without early write-back all of it is)."""
    from spoolctl.store.disk.fsio import create_tmp, write_tmp_flushing

    size = 4 << 20
    pages = size // os.sysconf("SC_PAGE_SIZE")
    with Store.open(store_root, create=True, master_key=master) as store:
        tmp_dir = store.layout.tmp
        skip_without_dirty_accounting(tmp_dir, size)
        tid = store.sealer.tenant_id("t")
        version, key = store.sealer.keyring.current(tid)
        tmp = create_tmp(tmp_dir)
        seen: list[int | None] = []
        flushing = write_tmp_flushing(
            tmp_dir, store.sealer.seal_stream(Binding("ab" * 32, "kv", tid, version), key,
                                    os.urandom(size)),
            into=tmp, on_written=lambda: seen.append(dirty_pages(tmp.fd, size)))
        flushing.flushed.result()
        os.unlink(flushing.path)
        assert flushing.size == size + overhead(version)
    assert seen and seen[0] is not None and seen[0] <= pages // 4, (seen, pages)
