"""Hostile KV payloads (hypothesis): safetensors headers with absurd shapes, offsets and
dtypes, JSON with NaN / huge numbers / deep nesting, truncated and padded bodies, fed to the
PyTorch and MLX backends' ``deserialize``. Each is rejected cleanly (ValueError or
SpoolError: the controller's miss-and-quarantine path), never a crash, never a huge
allocation; and a hostile payload that passes the store's digest check (someone with write
access to the store) still only gives a cold run with correct tokens."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spoolctl.store import SpoolError, Store

pytest.importorskip("transformers")

SETTINGS = settings(max_examples=80, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
TOKENS = 5

HUGE = st.sampled_from([2**31, 2**32 + 1, 2**62, 2**63 - 1, 2**64, 10**30, -1, -(2**63)])
JSONISH = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), HUGE,
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=5),
                            st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=12)
SHAPE = st.one_of(st.lists(st.one_of(st.integers(0, 64), HUGE), max_size=6), JSONISH)
OFFSETS = st.one_of(st.lists(st.one_of(st.integers(-10, 10**6), HUGE), min_size=0, max_size=3),
                    JSONISH)
DTYPE = st.one_of(st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "U8", "BOOL", "F8_E4M3",
                                   ""]), JSONISH)
MUTATION = st.tuples(st.integers(0, 10**6), st.sampled_from(["shape", "data_offsets", "dtype",
                                                              "delete", "extra"]),
                     st.one_of(SHAPE, OFFSETS, DTYPE))
RAW_HEADERS = [
    b"[" * 200_000 + b"]" * 200_000,           # deep nesting: RecursionError in json
    b'{"a": ' * 50_000 + b"1" + b"}" * 50_000,
    b'{"k0": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}',
    b'{"k0": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}}',
    b'{"k0": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}',
    b'{"k0": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}',
    b'{"k0": {"dtype": {"a": 1}, "shape": [1], "data_offsets": [0, 4]}}',
    b'{"k0": []}', b"[]", b"null", b"\xff\xfe\x00", b"{}", b'{"__metadata__": 5}',
]


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(header: Any, body: bytes) -> bytes:
    raw = json.dumps(header, allow_nan=True).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def mutate(header: dict[str, Any], mutation: tuple[int, str, Any]) -> dict[str, Any]:
    index, field, value = mutation
    names = sorted(k for k in header if k != "__metadata__")
    out = json.loads(json.dumps(header))
    name = names[index % len(names)]
    if field == "delete":
        del out[name]
    elif field == "extra":
        out[f"x{index}"] = {"dtype": "F32", "shape": value, "data_offsets": [0, 4]}
    else:
        out[name][field] = value
    return out


class Harness:
    """One backend and one valid serialized cache to mutate."""

    def __init__(self, backend: Any, object_name: str):
        self.backend = backend
        tokens = backend.tokenize_segments(["A short cached prefix for hostile tests."])[0]
        cache = backend.prefill(backend.new_cache(), tokens[:TOKENS])
        objects, self.layout = backend.serialize(cache, TOKENS)
        self.name = object_name
        self.valid = objects[object_name]

    def load(self, data: bytes) -> Any:
        return self.backend.deserialize({self.name: memoryview(data)}, dict(self.layout),
                                        TOKENS)

    def assert_rejected_or_equal(self, data: bytes) -> None:
        try:
            cache = self.load(data)
        except (ValueError, SpoolError):
            return  # the clean rejection (CacheFormatError is a ValueError)
        # Accepted: only possible if the mutation changed nothing that matters, so the
        # cache must serialize back to exactly the valid payload.
        assert self.backend.serialize(cache, TOKENS)[0][self.name] == self.valid


@pytest.fixture(scope="module")
def torch_harness(tiny_model_dir: Path) -> Harness:
    from spoolctl.controllers.pytorch import KV_OBJECT, PyTorchBackend

    return Harness(PyTorchBackend(tiny_model_dir), KV_OBJECT)


@pytest.fixture(scope="module")
def mlx_harness(tiny_model_dir: Path) -> Harness:
    if importlib.util.find_spec("mlx_lm") is None:
        pytest.skip("mlx-lm is not installed (pip install 'mlx-lm[cpu]')")
    from spoolctl.controllers.mlx import OBJECT_NAME, MlxBackend

    try:
        return Harness(MlxBackend(tiny_model_dir), OBJECT_NAME)
    except SpoolError as exc:
        pytest.skip(f"mlx-lm unusable here: {exc}")


@pytest.fixture(params=["torch", "mlx"])
def harness(request) -> Harness:
    return request.getfixturevalue(f"{request.param}_harness")


def test_valid_payload_round_trips(harness: Harness) -> None:
    assert harness.load(harness.valid) is not None  # the baseline the mutations start from


@SETTINGS
@given(mutation=MUTATION)
def test_mutated_header_fields_are_rejected(harness: Harness, mutation) -> None:
    header, body = split(harness.valid)
    data = join(mutate(header, mutation), body)
    harness.assert_rejected_or_equal(data)


@pytest.mark.parametrize("raw", RAW_HEADERS, ids=range(len(RAW_HEADERS)))
def test_hostile_raw_headers_are_rejected(harness: Harness, raw: bytes) -> None:
    _, body = split(harness.valid)
    with pytest.raises((ValueError, SpoolError)):
        harness.load(struct.pack("<Q", len(raw)) + raw + body)


@SETTINGS
@given(length=st.one_of(HUGE, st.integers(0, 10**7)), cut=st.integers(0, 10**6),
       pad=st.binary(max_size=64))
def test_bad_header_lengths_and_bodies(harness: Harness, length: int, cut: int,
                                       pad: bytes) -> None:
    valid = harness.valid
    for data in (struct.pack("<Q", length % 2**64) + valid[8:],
                 valid[:cut % len(valid)], valid + pad, valid[:8]):
        if data == valid:
            continue
        try:
            harness.load(data)
        except (ValueError, SpoolError):
            continue
        # A shortened header length can still parse (only padding spaces cut off), but the
        # tensors would be read from shifted bytes; trailing bytes are as suspect.
        pytest.fail(f"a damaged payload was accepted ({len(data)} of {len(valid)} bytes)")


@pytest.mark.parametrize("delta", [-8, -7, -6, -5, -4, -3, -2, -1, 1, 2, 3, 8])
def test_header_length_off_by_a_few_bytes_is_rejected(harness: Harness, delta: int) -> None:
    """safetensors pads headers with spaces: a length that cuts some off still parses as
    JSON, and the tensors would then be read from bytes shifted by ``delta``."""
    valid = harness.valid
    n = int.from_bytes(valid[:8], "little")
    with pytest.raises((ValueError, SpoolError)):
        harness.load(struct.pack("<Q", n + delta) + valid[8:])


def test_hostile_payload_with_a_valid_digest_is_a_cold_run(torch_harness: Harness,
                                                           store_root: Path) -> None:
    """Someone who can write the store commits an entry whose bytes pass the digest check
    but describe absurd tensors: prepare quarantines it and runs cold, same tokens."""
    from spoolctl.controllers import CachePrepareParams
    from spoolctl.controllers.pytorch import PyTorchCacheController

    params = CachePrepareParams(instructions=["Be brief."],
                                data=["The valve opens at noon. " * 4])
    backend = torch_harness.backend
    with PyTorchCacheController(backend, None) as ctl:
        cold = ctl.generate(params, "When does it open?", 6).tokens
    with PyTorchCacheController(backend, str(store_root)) as ctl:
        assert ctl.prepare(params).source == "cold"
    with Store.open(store_root) as store:
        (row,) = store.entries()
        good = store.manifest(row.entry_id)
        header, body = split(bytes(store.read(good, torch_harness.name)))
        name = sorted(k for k in header if k != "__metadata__")[0]
        header[name]["shape"] = [2**40, 2**40]
        store.release(row.entry_id)
        store.clean_released()
        store.put(kind=row.kind, namespace=row.namespace, key=row.key,
                  objects={torch_harness.name: join(header, body)}, meta=dict(good.meta),
                  index=row.index)
    with PyTorchCacheController(backend, str(store_root)) as ctl:
        handle = ctl.prepare(params)
        assert handle.source == "cold"
        assert ctl.generate(params, "When does it open?", 6).tokens == cold
    with Store.open(store_root) as store:
        assert [i.reason for i in store.quarantine_items()] == ["manifest_validation"]
