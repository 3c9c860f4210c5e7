"""MlxCacheController on the cache families beyond full attention (issue #31).

The tiny Gemma 3 (``RotatingKVCache`` sliding layers + a ``KVCache`` global layer), Jamba
(``ArraysCache`` Mamba state + ``KVCache``) and Mamba (``ArraysCache`` only) of
``spoolctl.demo.tinyfamilies``, loaded by mlx-lm with its own model code.
"""

from __future__ import annotations

import logging

import pytest

try:
    import mlx.core  # noqa: F401
except (ImportError, OSError) as exc:
    pytest.skip(f"mlx is not installed here ({exc}); pip install 'mlx-lm[cpu]'",
                allow_module_level=True)
pytest.importorskip("transformers")  # builds the models

from family_prompts import (
    DOC1,
    DOC1_NEAR,
    DOC2,
    FAMILIES,
    QUESTION,
    SEEDED,
    SYSTEM,
    check_common_prefix_rule,
    check_extension_rule,
    check_instructions_snapshot,
    cold,
    params,
    spoolctl_warnings,
)

from spoolctl.controllers import CachePrepareParams
from spoolctl.controllers.local.plan_rules import checkpoint_ladder
from spoolctl.controllers.mlx import CacheFormatError, MlxBackend, MlxCacheController
from spoolctl.store import Store

#: Default run: one family per behaviour (sliding for restores, sliding + ssm for reuse
#: rules); the rest run under ``extended``.
RESTORES = [pytest.param(f, marks=() if f == "sliding" else pytest.mark.extended)
            for f in FAMILIES]
REUSE = [pytest.param(f, marks=pytest.mark.extended if f == "hybrid" else ())
         for f in FAMILIES]


def _check_restores_equal_cold(b: MlxBackend, store_root, p: CachePrepareParams) -> None:
    """``p`` (on DOC1, already stored) restored from disk by a new controller, greedy and
    with seeded sampling (each in a new process's place: a controller of its own), gives
    the tokens of a cold run."""
    with MlxCacheController(b, store_root) as ctl:
        greedy = ctl.generate(p, QUESTION, 8)
    with MlxCacheController(b, store_root) as ctl:
        sampled = ctl.generate(p, QUESTION, 8, **SEEDED)
    assert greedy.handle.source == sampled.handle.source == "disk"
    assert greedy.tokens == cold(b, DOC1)
    assert sampled.tokens == cold(b, DOC1, **SEEDED)


@pytest.fixture(scope="module")
def backends(tmp_path_factory) -> dict[str, MlxBackend]:
    from spoolctl.demo.tinyfamilies import build_family_model

    root = tmp_path_factory.mktemp("mlx-families")
    return {f: MlxBackend(build_family_model(root / f, f), model_id=f) for f in FAMILIES}


@pytest.mark.parametrize("family", RESTORES)
def test_disk_restore_gives_the_tokens_of_a_cold_run(backends, family, store_root):
    """Stored by one controller, read from disk by fresh ones: greedy and seeded-sampling
    tokens equal a cold run."""
    b = backends[family]
    p = params(family, DOC1)
    with MlxCacheController(b, store_root) as ctl:
        assert ctl.prepare(p).source == "cold"
    _check_restores_equal_cold(b, store_root, p)


@pytest.mark.parametrize("family", REUSE)
def test_extension_is_reused_and_exact_near_misses_and_cuts_run_cold(backends, family,
                                                                      store_root, caplog):
    """The extension rule (``family_prompts.check_extension_rule``)."""
    check_extension_rule(MlxCacheController, backends[family], family, store_root, caplog)


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == "ssm" else
                                                 pytest.mark.extended) for f in FAMILIES])
def test_one_system_prompt_many_documents_extends_the_instructions_snapshot(
        backends, family, store_root):
    """One system prompt, many documents (``family_prompts.check_instructions_snapshot``)."""
    check_instructions_snapshot(MlxCacheController, backends[family], family, store_root)


@pytest.mark.parametrize("family", REUSE)
def test_a_prompt_inside_or_past_a_stored_message_restores_the_checkpoint_before_it(
        backends, family, store_root):
    """The common-prefix rule (``family_prompts.check_common_prefix_rule``)."""
    check_common_prefix_rule(MlxCacheController, backends[family], family, store_root)


def test_entry_layout_says_what_it_holds_and_another_family_never_reads_it(backends,
                                                                          store_root):
    entries = {}
    for family, b in backends.items():
        with MlxCacheController(b, store_root) as ctl:
            h = ctl.prepare(params(family, DOC1))
        with Store.open(store_root) as s:
            m = s.manifest(h.ref)
            entries[family] = (m, h.cached_tokens, s.read_all(m))
    layouts = {f: e[0].meta["layout"] for f, e in entries.items()}
    assert layouts["sliding"]["classes"] == ["RotatingKVCache"] * 3 + ["KVCache"]
    assert layouts["sliding"]["cache_layers"][0]["window"] == 16
    assert layouts["hybrid"]["classes"] == ["ArraysCache", "KVCache"] * 2
    assert layouts["ssm"]["cache_layers"][0] == {
        "class": "ArraysCache", "states": [{"shape": [3, 256], "dtype": "float32"},
                                           {"shape": [256, 8], "dtype": "float32"}]}
    assert len({b.identity()["cache_layers"] for b in backends.values()}) == 3
    for reader in FAMILIES:
        for writer, (m, tokens, objects) in entries.items():
            if reader != writer:
                with pytest.raises(CacheFormatError, match="layout"):
                    backends[reader].deserialize(objects, m.meta["layout"], tokens)


def test_a_base_that_would_need_cutting_back_is_not_even_read(backends, store_root, caplog):
    """No instructions, so no snapshot: the stored doc1 + doc2 state cannot serve doc1
    alone (a recurrent state is never cut back), but its checkpoint at the doc1 boundary
    can: the prepare restores it and computes nothing, without reading the longer entry
    (nothing to log, no load failure), and its tokens equal a cold run."""
    b = backends["ssm"]
    both = CachePrepareParams(model="ssm", data=[DOC1, DOC2])
    with MlxCacheController(b, store_root) as ctl:
        ctl.prepare(both)
    one = CachePrepareParams(model="ssm", data=[DOC1])
    with MlxCacheController(b, store_root) as ctl, caplog.at_level(logging.WARNING):
        h = ctl.prepare(one)
        assert h.source == "incremental" and h.supersedes is None
        assert h.reused_tokens == h.cached_tokens and h.computed_tokens == 0
        assert ctl.stats()["load_failures"] == 0
        ids = ctl.prompt_tokens(h, QUESTION)
        assert ctl.generate(h, QUESTION, 8).tokens == b.generate(None, 0, ids, 8)
    assert spoolctl_warnings(caplog) == []


# -- mlx-lm's quantized KV cache (kv_bits, decision 2604) ----------------------------------

#: The tiny Llama quantized from the first token (cut back exactly) and from token 20
#: (inside the instructions + document prompt, so the conversion point is crossed).
QUANTIZED = {"q4": dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0),
             "q4-from-20": dict(kv_bits=4, kv_group_size=32, quantized_kv_start=20),
             "q8": dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0)}


@pytest.fixture(scope="module")
def quantized(tiny_model_dir) -> dict[str, MlxBackend]:
    out = {name: MlxBackend(tiny_model_dir, model_id="q", **kw) for name, kw in QUANTIZED.items()}
    out["plain"] = MlxBackend(tiny_model_dir, model_id="q")
    return out


@pytest.mark.parametrize("name", ["q4", "q4-from-20"])
def test_quantized_kv_disk_restore_gives_the_tokens_of_a_cold_run(quantized, name, store_root):
    """A kv_bits cache stored by one controller and read from disk by fresh ones: greedy and
    seeded tokens equal a cold run with the same kv_bits (which differ from full precision:
    the quantization is really in use), also when the quantization starts mid-prompt."""
    b = quantized[name]
    p = params("q", DOC1)
    with MlxCacheController(b, store_root) as ctl:
        h = ctl.prepare(p)
        assert h.source == "cold" and h.cached_tokens > 20
    _check_restores_equal_cold(b, store_root, p)
    assert cold(b, DOC1) != cold(quantized["plain"], DOC1)


def test_quantized_kv_entry_says_bits_and_group_and_no_other_setting_reads_it(quantized,
                                                                           store_root):
    """The layout records bits, group size and start per layer; a model run with other
    kv_bits, another start, or unquantized never finds the entry (another namespace) and
    cannot load its bytes either (layout check)."""
    with MlxCacheController(quantized["q4"], store_root) as ctl:
        h = ctl.prepare(params("q", DOC1))
    with Store.open(store_root) as s:
        m = s.manifest(h.ref)
        objects = s.read_all(m)
    layout = m.meta["layout"]
    assert layout["kv_quantization"] == {"bits": 4, "group_size": 32, "start": 0}
    assert layout["classes"] == ["QuantizedKVCache"] * 2
    assert layout["cache_layers"][0] == {"class": "QuantizedKVCache", "kv_heads": 2,
                                         "k_head_dim": 32, "v_head_dim": 32,
                                         "dtype": "float32", "bits": 4, "group_size": 32}
    assert len({b.identity().get("cache_layers", "") + b.identity().get("kv_bits", "")
                + b.identity().get("quantized_kv_start", "")
                for b in quantized.values()}) == 4
    for other in ("q8", "q4-from-20", "plain"):
        b = quantized[other]
        with pytest.raises(CacheFormatError, match="layout"):
            b.deserialize(objects, layout, h.cached_tokens)
        with MlxCacheController(b, store_root) as ctl:
            o = ctl.prepare(params("q", DOC1))
            assert o.source == "cold" and o.reused_tokens == 0
            assert ctl.stats()["load_failures"] == 0


@pytest.mark.parametrize("name", ["q4", "q4-from-20"])
def test_quantized_kv_near_miss_reuses_only_the_exact_prefix(quantized, name, store_root):
    """A near miss inside the document reuses no more than the shared tokens: quantized from
    the first token, the doc1 entry is cut back (mlx-lm's ``QuantizedKVCache`` is
    trimmable, per token) at the first differing id; quantized from token 20, no cut is
    trusted, so the first prefill also stored the instructions snapshot and checkpoints, and
    the nearest one before the shared ids is reused. Tokens equal a cold run with the same
    kv_bits either way."""
    b = quantized[name]
    with MlxCacheController(b, store_root) as ctl:
        ctl.prepare(params("q", DOC1))
        head = len(ctl.prefix_tokens(CachePrepareParams(model="q", instructions=[SYSTEM])))
        shared = [x == y for x, y in zip(ctl.prefix_tokens(params("q", DOC1)),
                                         ctl.prefix_tokens(params("q", DOC1_NEAR)), strict=False)]
        common = shared.index(False) if False in shared else len(shared)
        stored = len(ctl.prefix_tokens(params("q", DOC1)))
    assert b.trimmable is (name == "q4")
    # A cache that cannot be cut back also stored the instructions' state (decision 2602)
    # and the doubling checkpoints inside the document.
    assert len(list((store_root / "manifests").rglob("*.json"))) == \
        (1 if name == "q4" else 2 + len(checkpoint_ladder(stored)))
    with MlxCacheController(b, store_root) as ctl:
        h = ctl.prepare(params("q", DOC1_NEAR))
        assert h.source == "incremental"
        assert head <= h.reused_tokens <= common
        assert h.reused_tokens == common or name != "q4"
        assert ctl.generate(h, QUESTION, 8).tokens == cold(b, DOC1_NEAR)


def test_quantized_kv_import_is_checked_against_a_recomputation(quantized, store_root):
    """A quantized cache (converted mid-prefix) is imported after its dequantized K/V are
    compared with a recomputation; one changed token is refused."""
    from spoolctl.errors import ConfigError

    b = quantized["q4-from-20"]
    p = params("q", DOC1)
    with MlxCacheController(b, store_root) as ctl:
        ids = ctl.prefix_tokens(p)
        with pytest.raises(ConfigError, match="does not match the tokens recomputed"):
            ctl.import_cache(p, b.prefill(None, [*ids[:-3], ids[-3] ^ 1, *ids[-2:]]))
        assert ctl.import_cache(p, b.prefill(None, ids)).source == "import"


# -- import_cache / import_prompt_cache of these families ------------------------------------

def test_import_of_a_sliding_window_cache_is_checked_and_restores_exactly(backends,
                                                                         store_root):
    """A cache the user prefilled with mlx-lm itself (one forward of the whole prefix, past
    the window) is imported after the recomputation check, and a fresh controller's tokens
    from it equal a cold run; a cache of other tokens (one changed) is refused with one
    line and nothing is stored."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from spoolctl.errors import ConfigError

    b = backends["sliding"]
    p = params("sliding", DOC1)
    with MlxCacheController(b, store_root) as ctl:
        ids = ctl.prefix_tokens(p)
        assert len(ids) > 16  # the window has rolled

        def prefilled(tokens: list[int]) -> list:
            cache = make_prompt_cache(b.model)
            b.model(mx.array([tokens]), cache=cache)
            return cache

        with pytest.raises(ConfigError, match="does not hold these tokens") as err:
            ctl.import_cache(p, prefilled([*ids[:-3], ids[-3] ^ 1, *ids[-2:]]))
        assert "\n" not in str(err.value)
        assert not list((store_root / "manifests").rglob("*.json"))
        h = ctl.import_cache(p, prefilled(ids))
        assert h.source == "import" and h.cached_tokens == len(ids)
    with MlxCacheController(b, store_root) as ctl:
        out = ctl.generate(p, QUESTION, 8)
    assert out.handle.source == "disk" and out.tokens == cold(b, DOC1)


def test_export_and_import_prompt_cache_of_a_state_space_model(backends, store_root,
                                                                tmp_path):
    """A Mamba state keeps no token count: the exported file records the tokens, so
    ``import_prompt_cache`` of it into another store works and restores exactly."""
    b = backends["ssm"]
    p = params("ssm", DOC1)
    path = tmp_path / "mamba.safetensors"
    with MlxCacheController(b, store_root) as ctl:
        ctl.export_prompt_cache(p, path)
    with MlxCacheController(b, tmp_path / "other") as ctl:
        h = ctl.import_prompt_cache(p, path)
        assert h.source == "import"
    with MlxCacheController(b, tmp_path / "other") as ctl:
        out = ctl.generate(p, QUESTION, 8)
    assert out.handle.source == "disk" and out.tokens == cold(b, DOC1)
