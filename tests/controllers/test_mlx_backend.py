"""MlxBackend against real mlx-lm on CPU with the locally generated tiny Llama.

Skipped (with the reason) only where ``import mlx.core`` fails.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import mlx.core as mx
except ImportError as exc:  # pragma: no cover - only where mlx cannot be installed
    pytest.skip(f"mlx is not installed here ({exc}); pip install 'mlx-lm[cpu]'",
                allow_module_level=True)

import numpy as np

from spoolctl.controllers.mlx import CacheFormatError, MlxBackend, cache_format
from spoolctl.errors import ConfigError

SEGMENTS = [
    "system: You are a helpful assistant. Answer using the documents below.\n",
    "user: The spool store keeps prompt caches on local disk with integrity.\n",
    "user: Crash safety means an entry is complete or absent after a power cut.\n",
    "user: What happens to a corrupt byte?\n",
]
NEW = 24


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> MlxBackend:
    return MlxBackend(tiny_model_dir)


@pytest.fixture(scope="module")
def prompt(backend: MlxBackend) -> list[int]:
    return [t for seg in backend.tokenize_segments(SEGMENTS) for t in seg]


@pytest.fixture(scope="module")
def cold(backend: MlxBackend, prompt: list[int]) -> list[int]:
    out = backend.generate(None, 0, prompt, NEW)
    assert len(out) == NEW
    return out


def _kv(cache) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.array(c.keys[..., :c.offset, :]), np.array(c.values[..., :c.offset, :]))
            for c in cache]


def test_identity_names_model_format_and_versions(backend: MlxBackend) -> None:
    ident = backend.identity()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in ident.items())
    assert ident["framework"] == "mlx-lm"
    assert ident["cache_format"] == cache_format(ident["mlx_lm_version"])
    assert ident["dtype"] == "float32" and ident["device"] in {"cpu", "gpu"}
    assert len(ident["model_digest"]) == 64
    assert backend.kind == "mlx"


def test_identity_changes_with_the_weights(backend: MlxBackend, tiny_model_dir: Path,
                                           tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    assert MlxBackend(copy).identity()["model_digest"] == backend.identity()["model_digest"]
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # flip one bit of the last weight
    weights.write_bytes(bytes(data))
    assert MlxBackend(copy).identity()["model_digest"] != backend.identity()["model_digest"]


def test_segments_concatenate_to_one_prompt(backend: MlxBackend, prompt: list[int]) -> None:
    segs = backend.tokenize_segments(SEGMENTS)
    assert len(segs) == len(SEGMENTS) and all(segs)
    assert [t for s in segs for t in s] == prompt
    assert backend.tokenize_segments([]) == []


def test_cached_prefix_gives_cold_tokens(backend: MlxBackend, prompt: list[int],
                                         cold: list[int]) -> None:
    prefix = len(prompt) - 9
    cache = backend.prefill(None, prompt[:prefix])
    assert backend.size(cache) == prefix
    assert backend.generate(cache, prefix, prompt, NEW) == cold


def test_cache_covering_whole_prompt_gives_cold_tokens(backend: MlxBackend, prompt: list[int],
                                                       cold: list[int]) -> None:
    # mlx-lm rejects an empty prompt; the backend must re-feed the last token itself.
    cache = backend.prefill(None, prompt)
    assert backend.generate(cache, len(prompt), prompt, NEW) == cold
    assert backend.size(cache) == len(prompt)


def test_operations_never_modify_their_input(backend: MlxBackend, prompt: list[int]) -> None:
    cache = backend.prefill(None, prompt[:20])
    before = _kv(cache)
    backend.prefill(cache, prompt[20:])
    backend.trim(cache, 5)
    backend.generate(cache, 20, prompt, 4)
    backend.serialize(cache, 20)
    assert backend.size(cache) == 20
    for (k0, v0), (k1, v1) in zip(before, _kv(cache), strict=True):
        assert np.array_equal(k0, k1) and np.array_equal(v0, v1)


def test_incremental_prefill_equals_cold_prefill(backend: MlxBackend, prompt: list[int],
                                                 cold: list[int]) -> None:
    full = backend.prefill(None, prompt)
    base = backend.prefill(None, [*prompt[:30], 7, 8, 9])  # diverges after 30 tokens
    inc = backend.prefill(backend.trim(base, 30), prompt[30:])
    assert backend.size(inc) == len(prompt)
    for (k0, v0), (k1, v1) in zip(_kv(full), _kv(inc), strict=True):
        np.testing.assert_allclose(k0, k1, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(v0, v1, rtol=1e-5, atol=1e-5)
    assert backend.generate(inc, len(prompt), prompt, NEW) == cold


def test_trim_bounds(backend: MlxBackend, prompt: list[int]) -> None:
    cache = backend.prefill(None, prompt[:10])
    assert backend.size(backend.trim(cache, 0)) == 0
    assert backend.size(backend.trim(cache, 10)) == 10
    with pytest.raises(ValueError):
        backend.trim(cache, 11)
    with pytest.raises(ValueError):
        backend.generate(cache, 11, prompt, 2)


def test_serialize_round_trip_gives_cold_tokens(backend: MlxBackend, prompt: list[int],
                                                cold: list[int]) -> None:
    cache = backend.prefill(None, prompt)
    objects, layout = backend.serialize(cache, len(prompt))
    json.dumps(layout)  # layout meta goes into the manifest: plain JSON
    assert layout["format"] == backend.format and layout["token_count"] == len(prompt)
    loaded = backend.deserialize({k: memoryview(v) for k, v in objects.items()}, layout,
                                 len(prompt))
    for (k0, v0), (k1, v1) in zip(_kv(cache), _kv(loaded), strict=True):
        assert np.array_equal(k0, k1) and np.array_equal(v0, v1)
    assert backend.generate(loaded, len(prompt), prompt, NEW) == cold
    # A loaded cache keeps growing normally (mlx-lm reallocates past the stored end).
    more = backend.prefill(loaded, [5, 6, 7])
    assert backend.size(more) == len(prompt) + 3


def test_serialized_file_is_mlx_lm_format_with_only_used_tokens(
        backend: MlxBackend, prompt: list[int], tmp_path: Path) -> None:
    from mlx_lm.models.cache import load_prompt_cache

    n = 17
    cache = backend.prefill(None, prompt[:n])
    assert cache[0].keys.shape[2] == 256  # mlx-lm preallocates a 256-token step
    objects, _ = backend.serialize(cache, n)
    kv_bytes = backend.num_layers * 2 * backend.kv_heads * backend.k_head_dim * 4 * n
    assert kv_bytes < len(objects["kv"]) < kv_bytes + 4096
    path = tmp_path / "exported.safetensors"
    path.write_bytes(objects["kv"])
    loaded, meta = load_prompt_cache(str(path), return_metadata=True)  # mlx-lm's own loader
    assert meta["spoolctl_format"] == backend.format
    assert [c.offset for c in loaded] == [n] * backend.num_layers
    assert np.array_equal(np.array(loaded[0].keys), np.array(cache[0].keys[..., :n, :]))


def test_serialize_stores_a_prefix_of_a_longer_cache(backend: MlxBackend,
                                                     prompt: list[int]) -> None:
    cache = backend.prefill(None, prompt)
    objects, layout = backend.serialize(cache, 12)
    loaded = backend.deserialize(objects, layout, 12)
    assert backend.size(loaded) == 12
    assert np.array_equal(_kv(loaded)[1][0], _kv(cache)[1][0][..., :12, :])
    with pytest.raises(ValueError):
        backend.serialize(cache, len(prompt) + 1)


@pytest.fixture(scope="module")
def stored(backend: MlxBackend, prompt: list[int]) -> tuple[bytes, dict]:
    objects, layout = backend.serialize(backend.prefill(None, prompt[:16]), 16)
    return objects["kv"], layout


def test_other_cache_format_version_is_rejected(backend: MlxBackend, stored) -> None:
    data, layout = stored
    old = {**layout, "format": "mlx-lm-prompt-cache/0.31", "mlx_lm_version": "0.31.1"}
    with pytest.raises(CacheFormatError, match=r"0\.31"):
        backend.deserialize({"kv": data}, old, 16)
    # The local engine quarantines entries whose backend raises ValueError.
    assert issubclass(CacheFormatError, ValueError)


@pytest.mark.parametrize("change", [
    {"token_count": 15}, {"layers": 3}, {"kv_heads": 4}, {"dtype": "float16"},
    {"classes": ["RotatingKVCache", "KVCache"]}, {"object": "other"},
])
def test_layout_mismatch_is_rejected(backend: MlxBackend, stored, change) -> None:
    data, layout = stored
    with pytest.raises(CacheFormatError):
        backend.deserialize({"kv": data}, {**layout, **change}, 16)


def test_token_count_disagreeing_with_the_file_is_rejected(backend: MlxBackend, stored) -> None:
    data, layout = stored
    with pytest.raises(CacheFormatError):
        backend.deserialize({"kv": data}, {**layout, "token_count": 15}, 15)


def _rewrite_header(data: bytes, edit) -> bytes:
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + size:]


def test_malformed_files_are_rejected_not_crashing(backend: MlxBackend, stored) -> None:
    data, layout = stored

    def other_class(h):
        h["__metadata__"]["1.0"] = "RotatingKVCache"

    def bad_offsets(h):
        first = next(k for k in h if k != "__metadata__")
        h[first]["data_offsets"] = [0, 1 << 40]

    def foreign_marker(h):
        h["__metadata__"]["0.spoolctl_format"] = "mlx-lm-prompt-cache/0.31"

    for bad in (data[:7], data[:100], b"\xff" * 64, data[:-8],
                _rewrite_header(data, other_class), _rewrite_header(data, bad_offsets),
                _rewrite_header(data, foreign_marker)):
        with pytest.raises(CacheFormatError):
            backend.deserialize({"kv": bad}, layout, 16)
    with pytest.raises(CacheFormatError):
        backend.deserialize({"kv": data, "extra": b""}, layout, 16)


def test_whole_buffer_file_from_plain_mlx_lm_is_rejected(backend: MlxBackend,
                                                         prompt: list[int]) -> None:
    # A file saved by mlx-lm directly holds the 256-token buffer, not token_count rows.
    import io

    from mlx_lm.models.cache import save_prompt_cache

    cache = backend.prefill(None, prompt[:16])
    buf = io.BytesIO()
    save_prompt_cache(buf, cache, {"spoolctl_format": backend.format})
    _, layout = backend.serialize(cache, 16)
    with pytest.raises(CacheFormatError):
        backend.deserialize({"kv": buf.getvalue()}, layout, 16)


def test_bad_model_paths_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        MlxBackend(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="cannot load"):
        MlxBackend(tmp_path / "empty")


def test_importing_the_module_does_not_import_mlx() -> None:
    code = ("import sys, spoolctl.controllers.mlx, spoolctl.store; "
            "assert 'mlx' not in sys.modules and 'mlx_lm' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith('mlx'))")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_mlx_is_real_here() -> None:
    # Guard against the suite silently running on something that is not mlx.
    assert mx.array([1, 2, 3]).sum().item() == 6
