"""Entries carry a tag the store's writer cannot forge (issue 35 item 6, decision 2011).

The attacker here can write every file of the store but does not hold the tag key: they
replace a victim entry's object with their own bytes and write a manifest with both
digests recomputed -- exactly what ``Store.put`` would write, minus a valid tag. With a
key configured that entry is a miss and a finding (quarantined ``auth_tag``), never
returned; without one it is returned (digests alone prove integrity, not origin), which
``request-auth`` now says. The vLLM end-to-end proof is
``tests/connector/test_vllm_entry_tags.py``.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

import pytest
from transfer_support import cli, fill

from spoolctl.store import ConfigError, Store
from spoolctl.store.format.digest import hash_bytes
from spoolctl.store.format.entry_tags import KEY_ENV, KEY_FILE_ENV, TagKey
from spoolctl.store.format.manifest import Manifest, ObjectRef, encode

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

KIND, NS, KEY = "pytorch", "model-x", "victim"
GOOD = b"the victim's real KV " * 200
EVIL = b"attacker-chosen KV!! " * 200


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = Path(os.path.realpath(tmp_path)) / "keys" / "tag.key"
    path.parent.mkdir()
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(autouse=True)
def no_operator_key(monkeypatch):
    """Each test configures its own key; none leaks in from the environment."""
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    monkeypatch.delenv(KEY_ENV, raising=False)


def _replace_as_the_writer(root: Path, entry_id: str, data: bytes,
                           tag_key: TagKey | None = None) -> None:
    """What someone who can write the store (but lacks the engine's key) does: write their
    object, then a consistent manifest naming it, over the victim's (``tag_key``: theirs)."""
    with Store.open(root, tag_key=None, read_only=True) as store:
        old = store.manifest(entry_id)
        layout = store.layout
    digest = hash_bytes(data)
    obj = layout.object_path(digest)
    obj.parent.mkdir(mode=0o700, exist_ok=True)
    obj.write_bytes(data)
    forged = Manifest.new(kind=old.kind, namespace=old.namespace, key=old.key,
                          created=time.time(), objects=(ObjectRef("kv", digest, len(data)),),
                          meta=old.meta, index=old.index)
    path = layout.manifest_path(entry_id)
    tmp = path.with_suffix(".forged")
    tmp.write_bytes(encode(forged, tag_key))
    os.replace(tmp, path)


def _manifest_path(root: Path, entry_id: str) -> Path:
    with Store.open(root, tag_key=None, read_only=True) as store:
        return store.layout.manifest_path(entry_id)


def _victim(root: Path, key: TagKey | None) -> str:
    with Store.open(root, create=True, tag_key=key) as store:
        return store.put(kind=KIND, namespace=NS, key=KEY, objects={"kv": GOOD}).entry_id


def test_a_replaced_entry_with_recomputed_digests_is_a_miss_under_a_key(store_root, key_file):
    key = TagKey.from_file(key_file)
    entry_id = _victim(store_root, key)
    doc = json.loads(_manifest_path(store_root, entry_id).read_bytes())
    assert doc["tag"]["key_id"] == key.key_id and len(doc["tag"]["mac"]) == 64
    _replace_as_the_writer(store_root, entry_id, EVIL)
    with Store.open(store_root, tag_key=key) as store:
        assert store.lookup(KIND, NS, KEY) is None  # a miss, the attacker's bytes never read
        (item,) = store.quarantine_items()
        assert item.reason == "auth_tag" and item.entry_id == entry_id
        # the writer recommits: the real bytes come back tagged
        store.put(kind=KIND, namespace=NS, key=KEY, objects={"kv": GOOD})
        hit = store.lookup(KIND, NS, KEY)
        assert hit is not None and bytes(store.read(hit, "kv")) == GOOD


def test_without_a_key_the_same_forgery_is_served(store_root):
    """The gap the key closes (and why ``request-auth`` says ``verified``, not more)."""
    entry_id = _victim(store_root, None)
    _replace_as_the_writer(store_root, entry_id, EVIL)
    with Store.open(store_root) as store:
        hit = store.lookup(KIND, NS, KEY)
        assert hit is not None and bytes(store.read(hit, "kv")) == EVIL


@pytest.mark.parametrize("how", ["untagged", "other key", "bad mac"])
def test_a_tag_the_key_does_not_verify_is_a_finding(store_root, key_file, how):
    key = TagKey.from_file(key_file)
    entry_id = _victim(store_root, key)
    if how == "untagged":
        _replace_as_the_writer(store_root, entry_id, GOOD)
    elif how == "other key":
        _replace_as_the_writer(store_root, entry_id, GOOD, TagKey(secrets.token_bytes(32)))
    else:  # the real key's tag copied onto another body
        path = _manifest_path(store_root, entry_id)
        real_tag = json.loads(path.read_bytes())["tag"]
        _replace_as_the_writer(store_root, entry_id, EVIL)
        doc = json.loads(path.read_bytes())
        doc["tag"] = real_tag
        path.write_bytes(json.dumps(doc).encode())
    with Store.open(store_root, tag_key=key) as store:
        assert store.lookup(KIND, NS, KEY) is None
        assert [i.reason for i in store.quarantine_items()] == ["auth_tag"]


def test_request_auth_and_scrub_say_what_they_prove(store_root, key_file):
    (entry_id,) = fill(store_root, 1, shared=False)  # written without a key
    plain = cli("request-auth", entry_id, "--root", str(store_root), "--json")
    doc = json.loads(plain.stdout)
    assert plain.returncode == 0 and doc["result"] == "verified"
    assert doc["proves"] == "integrity" and "not authenticated" in doc["detail"]
    human = cli("scrub", "--root", str(store_root))
    assert human.returncode == 0 and b"verified (digests)" in human.stdout

    keyed = {KEY_FILE_ENV: str(key_file)}
    refused = cli("request-auth", entry_id, "--root", str(store_root), "--json", env=keyed)
    doc = json.loads(refused.stdout)
    assert refused.returncode == 1 and doc["result"] == "quarantined"
    assert doc["reason"] == "auth_tag" and "no authentication tag" in doc["detail"]

    key = TagKey.from_file(key_file)
    tagged = _victim(store_root, key)
    ok = cli("request-auth", tagged, "--root", str(store_root), "--json", env=keyed)
    doc = json.loads(ok.stdout)
    assert ok.returncode == 0 and doc["result"] == "authenticated" and doc["proves"] == "origin"
    assert key.key_id in doc["detail"]
    scrub = json.loads(cli("scrub", "--root", str(store_root), "--json", env=keyed).stdout)
    assert scrub["proves"] == "origin"


def test_export_carries_tags_and_import_refuses_or_retags(tmp_path, key_file):
    base = Path(os.path.realpath(tmp_path))
    a, b, c, archive = base / "a", base / "b", base / "c", base / "a.tar"
    keyed = {KEY_FILE_ENV: str(key_file)}
    key = TagKey.from_file(key_file)
    tagged = _victim(a, key)
    (untagged,) = fill(a, 1, shared=False)  # an entry from before the key
    assert cli("export", "--root", str(a), "-o", str(archive)).returncode == 0

    proc = cli("import", "--root", str(b), str(archive), "--json", env=keyed)
    doc = json.loads(proc.stdout)
    assert proc.returncode == 1 and (doc["imported"], doc["skipped_unauthenticated"]) == (1, 1)
    with Store.open(b, tag_key=key) as store:
        assert [r.entry_id for r in store.entries()] == [tagged]  # its tag travelled
        assert store.lookup(KIND, NS, KEY) is not None

    lone = cli("import", "--root", str(c), str(archive), "--retag")
    assert lone.returncode == 2 and b"--retag needs a tag key" in lone.stderr
    proc = cli("import", "--root", str(c), str(archive), "--retag", "--json", env=keyed)
    assert proc.returncode == 0 and json.loads(proc.stdout)["imported"] == 2
    with Store.open(c, tag_key=key) as store:
        assert {r.entry_id for r in store.entries()} == {tagged, untagged}
        assert store.verify(untagged).tag is not None  # the operator vouched: tagged here


def test_key_sources_and_their_refusals(tmp_path, store_root, key_file, monkeypatch):
    base = Path(os.path.realpath(tmp_path))
    assert TagKey.from_file(key_file).key_id == TagKey.from_file(key_file).key_id
    assert key_file.read_text().strip() not in repr(TagKey.from_file(key_file))
    monkeypatch.setenv(KEY_FILE_ENV, str(key_file))
    with Store.open(store_root, create=True) as store:  # the default: the operator's env
        assert store.tag_key is not None
    monkeypatch.setenv(KEY_ENV, "ab" * 32)
    with pytest.raises(ConfigError, match="both"):
        TagKey.from_environment()
    monkeypatch.delenv(KEY_FILE_ENV)
    assert TagKey.from_environment().source == KEY_ENV

    def refused(path: Path, words: str) -> None:
        with pytest.raises(ConfigError, match=words) as info:
            TagKey.from_file(path)
        assert "\n" not in str(info.value) and str(path) in str(info.value)

    key_file.chmod(0o644)
    refused(key_file, "others can read it")
    key_file.chmod(0o620)
    refused(key_file, "group can write it")
    key_file.chmod(0o640)
    TagKey.from_file(key_file)  # group-readable: the operator's group may read it
    link = base / "keys" / "link.key"
    link.symlink_to(key_file)
    refused(link, "symlink")
    short = base / "keys" / "short.key"
    short.write_text("abc")
    short.chmod(0o600)
    refused(short, "64 hex")
    inside = store_root / "state" / "tag.key"
    inside.write_text(secrets.token_hex(32))
    inside.chmod(0o600)
    with pytest.raises(ConfigError, match="inside the store root"):
        Store.open(store_root, tag_key=TagKey.from_file(inside))


def test_untagged_manifests_still_decode_and_tagged_ones_open_without_a_key(store_root,
                                                                            key_file):
    """The tag is an optional envelope field: old stores read as before; a keyed store
    opened without the key reads its entries (digests only)."""
    (old,) = fill(store_root, 1, shared=False)
    key = TagKey.from_file(key_file)
    tagged = _victim(store_root, key)
    with Store.open(store_root, tag_key=None) as store:
        assert store.manifest(old).tag is None
        assert store.verify(tagged).tag["key_id"] == key.key_id


def test_controllers_and_the_connector_get_the_key_the_same_way(store_root, key_file,
                                                                 monkeypatch):
    from spoolctl.connector.deployment.settings import parse_settings
    from spoolctl.controllers.local.engine import _open_store

    key_id = TagKey.from_file(key_file).key_id
    monkeypatch.setenv(KEY_FILE_ENV, str(key_file))
    for read_only in (False, True):  # what PyTorch/MLX controllers open for a root
        with _open_store(store_root, max_bytes=None, read_only=read_only) as store:
            assert store.tag_key is not None and store.tag_key.key_id == key_id
    explicit = parse_settings({"spoolctl_root": "/srv/spool",
                               "spoolctl_tag_key_file": str(key_file)}, block_size=32)
    assert explicit.tag_key().key_id == key_id
    monkeypatch.delenv(KEY_FILE_ENV)
    assert parse_settings({"spoolctl_root": "/srv/spool"}, block_size=32).tag_key() is None
    with pytest.raises(ConfigError, match="absolute"):
        parse_settings({"spoolctl_root": "/srv/spool", "spoolctl_tag_key_file": "tag.key"},
                       block_size=32)


def test_a_request_queue_from_before_verified_is_upgraded_in_place(store):
    """Queues created by earlier versions allow only authenticated/absent/quarantined: the
    first open rebuilds the table (rows kept) so a worker can answer ``verified``."""
    import sqlite3

    from spoolctl.store.maintain.auth_requests import AUTH_DB, AuthQueue, process_pending

    (entry_id,) = [store.put(kind=KIND, namespace=NS, key=KEY, objects={"kv": GOOD}).entry_id]
    path = store.layout.state / AUTH_DB
    old = sqlite3.connect(path)
    # verbatim what spoolctl created before 'verified' (the schema check compares the text)
    old.executescript("""
CREATE TABLE IF NOT EXISTS requests(
    request_id INTEGER PRIMARY KEY AUTOINCREMENT,
    entry_id TEXT NOT NULL,
    created REAL NOT NULL,
    requester_pid INTEGER NOT NULL,
    result TEXT CHECK (result IS NULL OR result IN ('authenticated', 'absent', 'quarantined')),
    reason TEXT,
    detail TEXT,
    answered REAL,
    answered_by INTEGER
);
CREATE INDEX IF NOT EXISTS requests_pending ON requests(result, request_id);
""")
    old.execute("INSERT INTO requests(entry_id, created, requester_pid) VALUES (?, 1.0, 1)",
                (entry_id,))
    old.commit()
    old.close()
    assert process_pending(store) == 1
    with AuthQueue.of(store) as queue:
        got = queue.receipt(1)
    assert got is not None and got.result == "verified" and got.proves == "integrity"

