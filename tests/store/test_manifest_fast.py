"""The msgspec fast path of manifest decoding (decision 2900): what spoolctl writes takes it,
and on anything else it gives exactly the reference decoder's verdict.

A catalog rebuild decodes every manifest of the store; its speed depends on the fast path
being taken for the manifests spoolctl itself writes (the first tests). Its safety depends
on the fast path never accepting what the reference decoder (stdlib json, canonical JSON
re-encoded in Python) rejects, nor reading a manifest differently: the differential tests
decode each document twice, with the fast path and with it turned off, and compare.
"""

from __future__ import annotations

import json
import random

import pytest

from spoolctl.store import (
    ManifestError,
    Store,
)
from spoolctl.store.format import manifest_fast
from spoolctl.store.format.digest import hash_bytes
from spoolctl.store.format.entry_tags import TagKey
from spoolctl.store.format.manifest import (
    SCHEMA,
    Manifest,
    ObjectRef,
    canonical_json,
    decode,
    encode,
)

pytest.importorskip("msgspec")  # a base dependency; an environment without it decodes slowly

DIGEST = "ab" * 32


def _manifest(**kw) -> Manifest:
    args = dict(kind="vllm", namespace="llama-3/rev:abc", key="chunk-7", created=1796158565.0863817,
                objects=(ObjectRef("kv", DIGEST, 1 << 20), ObjectRef("k.v-2", "cd" * 32, 0)),
                meta={"layout": {"blocks": [0, 1, 2], "dtype": "float32"}, "tokens": 256,
                      "text": 'quote " backslash \\ newline \n tab \t bell \x07 tilde ~',
                      "ratio": 0.25, "neg": -3, "flag": True, "none": None, "empty": {}},
                index={"hashes": ["e" * 64], "offset": 12.5}, supersedes="f" * 64)
    args.update(kw)
    return Manifest.new(**args)


def _same_verdict(data: bytes, monkeypatch: pytest.MonkeyPatch) -> Manifest | str:
    """Decode ``data`` with the fast path and without; assert both give the same manifest
    (body, digest, tag) or the same error line. Returns the manifest or the error."""
    def both() -> Manifest | str:
        try:
            m = decode(data)
        except ManifestError as exc:
            return str(exc)
        return m

    fast = both()
    with monkeypatch.context() as m:
        m.setattr(manifest_fast, "parse", lambda data, schema: None)
        slow = both()
    if isinstance(slow, Manifest):
        assert isinstance(fast, Manifest), (data, fast)
        assert (fast, fast.digest, fast.tag) == (slow, slow.digest, slow.tag)
        assert fast.body() == slow.body() and encode(fast) == encode(slow)
    else:
        assert fast == slow, data
    return slow


def _forge(body: dict, *, raw_body: bytes | None = None, extra: bytes = b"") -> bytes:
    """An envelope whose digest matches ``raw_body`` (the body's bytes as written), so only
    the canonical-form rule can tell it from a good one."""
    text = raw_body if raw_body is not None else canonical_json(body)
    return (b'{"body":' + text + b',"digest":"' + hash_bytes(text).encode()
            + b'","schema":"' + SCHEMA.encode() + b'"' + extra + b"}")


def test_what_spoolctl_writes_takes_the_fast_path() -> None:
    key = TagKey(bytes(range(32)))
    for m in (_manifest(), _manifest(meta={}, index={}, supersedes=None, created=0),
              _manifest(objects=(), created=1e-4), _manifest(created=9999999999999998.0)):
        for data in (encode(m), encode(m, key)):
            env = manifest_fast.parse(data, SCHEMA)
            assert env is not None, data
            assert decode(data, expected_entry_id=m.entry_id) == m


def test_a_committed_entry_takes_the_fast_path(store: Store) -> None:
    m = store.put(kind="pytorch", namespace="tiny", key="prompt-1", objects={"kv": b"x" * 100},
                  meta={"tokens": [1, 2, 3], "dtype": "float32"}, index={"h": "a" * 64})
    data = store.layout.manifest_path(m.entry_id).read_bytes()
    assert manifest_fast.parse(data, SCHEMA) is not None
    assert decode(data, expected_entry_id=m.entry_id) == m


@pytest.mark.parametrize("raw", [
    # The same values written by another encoder: valid digest, not the canonical form.
    b"1e16", b"1e-05", b"0.00001", b"1E+16", b"1.5e300", b"100000.0E0",
])
def test_non_canonical_floats_get_the_reference_verdict(raw: bytes,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    body = _manifest().body()
    for where in ("meta", "index", "created"):
        text = canonical_json(body).replace(b'"empty":{}', b'"empty":{},"f":' + raw) \
            if where == "meta" else canonical_json(body).replace(
                b'"offset":12.5', b'"offset":' + raw) if where == "index" else \
            canonical_json(body).replace(b'"created":1796158565.0863817', b'"created":' + raw)
        assert raw in text
        _same_verdict(_forge(body, raw_body=text), monkeypatch)


@pytest.mark.parametrize("change", [
    {"meta": {"s": "caf\u00e9"}}, {"meta": {"s": "del \x7f"}}, {"meta": {"s": "\ud800"}},
    {"meta": {"big": 1 << 70}}, {"meta": {"neg_big": -(1 << 64)}}, {"meta": {"f": 1e300}},
    {"meta": {"f": 1e-300}}, {"meta": {"f": -0.0}}, {"created": 5}, {"created": True},
    {"created": "5"}, {"created": 1e20}, {"supersedes": 5}, {"supersedes": "A" * 64},
    {"kind": "other"}, {"namespace": "has space"}, {"key": ""}, {"entry_id": "0" * 64},
    {"objects": [{"name": "kv", "digest": DIGEST, "size": True}]},
    {"objects": [{"name": "kv", "digest": DIGEST, "size": -1}]},
    {"objects": [{"name": "kv", "digest": DIGEST, "size": 1, "x": 1}]},
    {"objects": [{"name": "kv", "digest": DIGEST, "size": 1}] * 2},
    {"objects": {"name": "kv"}}, {"meta": []}, {"index": None},
    {"meta": {"deep": json.loads("[" * 40 + "]" * 40)}}, {"extra": 1},
])
def test_odd_bodies_get_the_reference_verdict(change: dict,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    body = _manifest().body()
    body.update(change)
    try:
        raw = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                         allow_nan=False).encode("utf-8", "surrogatepass")
    except (ValueError, TypeError):
        raw = canonical_json(body)
    for text in {canonical_json(body), raw}:  # the canonical form and a raw UTF-8 writer's
        _same_verdict(_forge(body, raw_body=text), monkeypatch)


@pytest.mark.parametrize("extra", [
    b',"tag":{"alg":"blake3-keyed","key_id":"k","mac":"m"}', b',"tag":{"alg":1}',
    b',"tag":null', b',"tag":{"alg":"a","key_id":"k","mac":"m","x":"y"}', b',"other":1',
    b',"tag":{"alg":"a","key_id":"k","mac":1e16}',
])
def test_odd_envelopes_get_the_reference_verdict(extra: bytes,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _same_verdict(_forge(_manifest().body(), extra=extra), monkeypatch)
    doc = json.loads(encode(_manifest()))
    for bad in ({**doc, "schema": "spoolctl-manifest/v2"}, {**doc, "digest": "0" * 64},
                {**doc, "digest": 5}, {k: v for k, v in doc.items() if k != "digest"}):
        _same_verdict(json.dumps(bad).encode(), monkeypatch)


def test_mutated_manifests_get_the_reference_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(2900)
    good = encode(_manifest(), TagKey(bytes(32)))
    for _ in range(400):
        data = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        _same_verdict(bytes(data), monkeypatch)


def test_the_file_name_still_binds_the_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _manifest()
    with pytest.raises(ManifestError, match="does not match the file name"):
        decode(encode(m), expected_entry_id="0" * 64)


def test_entry_ids_and_part_digests_are_unchanged() -> None:
    """The cheaper construction (one buffer for small parts) names every entry as before:
    these values come from the streaming version; a change would orphan every store."""
    from spoolctl.store import entry_id_for
    from spoolctl.store.format.digest import hash_parts

    assert entry_id_for("vllm", "llama-3/rev:abc", "chunk-7") == \
        "67b49529e068ceb96331a0fa1c93d663310e70826815ebd165f876aeeb62b8b4"
    assert hash_parts(b"x" * 20000, b"y") == \
        "11402ea1ee27e9987138aa707b6930465e63a95959fa93058510877d666731ba"  # streamed
    assert hash_parts() == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
