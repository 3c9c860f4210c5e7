"""Pure format logic: manifest encode/decode, entry ids, sizes (hostile input included)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spoolctl.store import ConfigError, InvalidIdError, ManifestError, entry_id_for
from spoolctl.store.format.digest import hash_bytes
from spoolctl.store.format.manifest import Manifest, ObjectRef, canonical_json, decode, encode
from spoolctl.store.format.sizes import format_size, parse_duration, parse_rate, parse_size

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)


def _manifest(**kw) -> Manifest:
    args = dict(kind="vllm", namespace="ns", key="k", created=1.5,
                objects=(ObjectRef("kv", "a" * 64, 10),), meta={"x": [1, 2]}, index={"i": 1})
    args.update(kw)
    return Manifest.new(**args)


def test_round_trip() -> None:
    m = _manifest()
    assert decode(encode(m), expected_entry_id=m.entry_id) == m


def test_entry_id_is_stable_and_separates_fields() -> None:
    assert entry_id_for("vllm", "ns", "k") == entry_id_for("vllm", "ns", "k")
    assert entry_id_for("vllm", "ns", "k") != entry_id_for("mlx", "ns", "k")
    assert entry_id_for("vllm", "a", "bc") != entry_id_for("vllm", "ab", "c")


def test_body_tampering_breaks_the_envelope_digest() -> None:
    doc = json.loads(encode(_manifest()))
    doc["body"]["meta"]["x"] = [1, 3]
    with pytest.raises(ManifestError, match="digest"):
        decode(json.dumps(doc).encode())


def test_envelope_with_recomputed_digest_but_foreign_id_is_rejected() -> None:
    doc = json.loads(encode(_manifest()))
    doc["body"]["key"] = "other"
    doc["digest"] = hash_bytes(canonical_json(doc["body"]))
    with pytest.raises(ManifestError, match="entry_id"):
        decode(json.dumps(doc).encode())


@pytest.mark.parametrize("text", [
    b"", b"{", b"[]", b'{"schema":"spoolctl-manifest/v1"}', b"\xff\xfe",
    b'{"schema":"spoolctl-manifest/v1","digest":"x","body":{"a":NaN}}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"schema":"spoolctl-manifest/v1","digest":"x","body":' + b"9" * 5000 + b"}",
])
def test_hostile_documents_raise_manifest_error(text: bytes) -> None:
    with pytest.raises(ManifestError):
        decode(text)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000))
def test_random_bytes_never_escape_as_other_errors(data: bytes) -> None:
    with pytest.raises(ManifestError):
        decode(data)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c,
                                                                        max_size=4),
                    max_leaves=30))
def test_mutated_bodies_fail_cleanly(value) -> None:
    doc = json.loads(encode(_manifest()))
    doc["body"]["meta"] = value
    doc["digest"] = hash_bytes(canonical_json(doc["body"]))
    raw = json.dumps(doc).encode()
    try:
        m = decode(raw)
    except ManifestError:
        return
    assert m.meta == value


def test_objects_validation() -> None:
    for bad in [dict(objects=(ObjectRef("kv", "a" * 64, 1), ObjectRef("kv", "b" * 64, 1)))]:
        with pytest.raises(ValueError):
            _manifest(**bad)
    with pytest.raises(InvalidIdError):
        ObjectRef("../kv", "a" * 64, 1)
    with pytest.raises(ValueError):
        ObjectRef("kv", "A" * 64, 1)
    with pytest.raises(ValueError):
        ObjectRef("kv", "a" * 64, -1)


@pytest.mark.parametrize(("text", "value"), [
    ("200GiB", 200 << 30), ("64MiB", 64 << 20), ("1.5KiB", 1536), ("1048576", 1 << 20),
    ("10GB", 10 * 10**9), ("2tib", 2 << 40), (4096, 4096),
])
def test_parse_size(text, value) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-5", "0", "12XB", "1e9", "GiB", "5 G i B"])
def test_bad_sizes_are_clear_errors(text) -> None:
    with pytest.raises(ConfigError, match="invalid size"):
        parse_size(text)


def test_rates_durations_and_rendering() -> None:
    assert parse_rate("64MiB/s") == 64 << 20
    assert parse_duration("7d") == 7 * 86400 and parse_duration("90") == 90
    with pytest.raises(ConfigError):
        parse_duration("soon")
    assert format_size(1536) == "1.5 KiB" and format_size(10) == "10 B"
