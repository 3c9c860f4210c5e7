"""A model the application loaded itself (``MlxCacheController.from_model``): what
``mlx_lm.load`` returns, quantized by the app, ``mx.compile``-d, with a LoRA adapter (as
loaded and fused), on the tiny Llama; real mlx-lm on CPU, real stores."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from controller_backends import cold_tokens, make_mlx_adapter

pytest.importorskip("mlx.core", reason="mlx is not installed here; pip install 'mlx-lm[cpu]'")

from spoolctl.controllers import CachePrepareParams
from spoolctl.controllers.mlx import MlxBackend, MlxCacheController
from spoolctl.errors import ConfigError

SYSTEM = "You are a helpful assistant. Answer using the reference documents below."
DOC = "Manual: the pump starts when the valve is open and the tank is full. " * 4
QUESTION = "Question: when does the pump start?"
PARAMS = {"model": "tiny", "instructions": [SYSTEM], "data": [DOC]}
NEW = 8


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter mlx-lm loads: rank-4 LoRA on the q/v projections, random nonzero weights."""
    return make_mlx_adapter(tmp_path_factory.mktemp("mlx-adapter") / "A", 7)


def plain(model_dir: Path, adapter: Path | None = None):
    import mlx_lm

    return mlx_lm.load(str(model_dir))


def quantized(model_dir: Path, adapter: Path | None = None, bits: int = 4):
    """mlx-lm's own quantize path (what ``mlx_lm.convert -q`` runs), done by the app."""
    import mlx_lm
    from mlx_lm.utils import quantize_model

    model, tokenizer, config = mlx_lm.load(str(model_dir), return_config=True)
    model, _ = quantize_model(model, config, group_size=32, bits=bits)
    return model, tokenizer


def compiled(model_dir: Path, adapter: Path | None = None):
    import mlx.core as mx

    model, tokenizer = plain(model_dir)
    return mx.compile(model), tokenizer


def with_adapter(model_dir: Path, adapter: Path | None = None):
    import mlx_lm

    return mlx_lm.load(str(model_dir), adapter_path=str(adapter))


def fused(model_dir: Path, adapter: Path | None = None):
    """The adapter merged into the base weights in memory (what ``mlx_lm.fuse`` does)."""
    from mlx.utils import tree_unflatten

    model, tokenizer = with_adapter(model_dir, adapter)
    layers = [(name, m.fuse()) for name, m in model.named_modules() if hasattr(m, "fuse")]
    model.update_modules(tree_unflatten(layers))
    return model, tokenizer


def directory_tokens(model_dir: Path, adapter: Path | None) -> list[int]:
    """Greedy tokens of the directory-based controller (a prepare, then a generate)."""
    p = CachePrepareParams(**PARAMS)
    with MlxCacheController(model_dir, model_id="tiny", adapter_path=adapter) as ctl:
        ctl.prepare(p)
        return ctl.generate(p, QUESTION, NEW).tokens


@pytest.mark.parametrize("make", [plain, quantized, compiled, with_adapter, fused])
def test_a_handed_over_model_restores_from_disk_like_a_cold_run(make, tiny_model_dir,
                                                                 adapter_dir, store_root):
    """A fresh controller on the same store, given a freshly loaded (quantized, compiled,
    adapted) model, finds the first one's entry on disk and decodes what a cold run does,
    and what the directory-based controller does on the same weights."""
    p = CachePrepareParams(**PARAMS)
    with MlxCacheController.from_model(*make(tiny_model_dir, adapter_dir), store_root,
                                       model_id="tiny") as ctl:
        assert ctl.prepare(p).source == "cold"
    model, tokenizer = make(tiny_model_dir, adapter_dir)
    with MlxCacheController.from_model(model, tokenizer, store_root, model_id="tiny") as ctl:
        assert ctl.mlx.identity()["model_digest"].startswith("params:blake3:")
        want = cold_tokens(ctl.mlx, p, QUESTION, NEW)
        got = ctl.generate(p, QUESTION, NEW)
        assert got.handle.source == "disk" and got.usage.cache_read_tokens > 0
        assert got.tokens == want
        if make is compiled:
            assert ctl.mlx.model is not model and type(ctl.mlx.model).__name__ == "Model"
    if make in (plain, compiled, with_adapter):
        adapter = adapter_dir if make is with_adapter else None
        assert got.tokens == directory_tokens(tiny_model_dir, adapter)


def test_quantized_compiled_and_adapted_models_are_named_by_their_own_weights(
        tiny_model_dir, adapter_dir):
    """Compiling keeps the module's identity; quantizing, another bit width, one packed
    integer, the scales, and fusing each change it; a loaded adapter is keyed by its
    content, not in the base digest."""
    import mlx.core as mx

    def digest(model, tokenizer) -> str:
        return MlxBackend.from_loaded(model, tokenizer).identity()["model_digest"]

    base = digest(*plain(tiny_model_dir))
    assert digest(*compiled(tiny_model_dir)) == base
    adapted = MlxBackend.from_loaded(*with_adapter(tiny_model_dir, adapter_dir))
    assert adapted.identity()["model_digest"] == base  # the base weights, untouched
    assert "adapters" in adapted.model_state()
    assert digest(*fused(tiny_model_dir, adapter_dir)) != base
    quant_model, tokenizer = quantized(tiny_model_dir)
    quant = digest(quant_model, tokenizer)
    assert quant != base
    assert digest(*quantized(tiny_model_dir)) == quant  # a fresh load, quantized the same way
    assert digest(*quantized(tiny_model_dir, bits=8)) not in (quant, base)
    proj = quant_model.model.layers[0].mlp.down_proj
    ints = proj.weight  # packed 4-bit integers in uint32 words
    proj.weight = mx.concatenate([ints.reshape(-1)[:1] ^ 1, ints.reshape(-1)[1:]]
                                 ).reshape(ints.shape)
    assert digest(quant_model, tokenizer) not in (quant, base)
    proj.weight = ints
    proj.scales = proj.scales * 1.5
    assert digest(quant_model, tokenizer) not in (quant, base)


def test_a_model_with_other_weights_never_hits_the_first_ones_entries(tiny_model_dir,
                                                                       store_root):
    p = CachePrepareParams(**PARAMS)
    with MlxCacheController.from_model(*plain(tiny_model_dir), store_root,
                                       model_id="tiny") as ctl:
        ctl.prepare(p)
    with MlxCacheController.from_model(*plain(tiny_model_dir), store_root,
                                       model_id="tiny") as ctl:
        assert ctl.prepare(p).source == "disk"  # control: the same weights do hit
    model, tokenizer = plain(tiny_model_dir)
    proj = model.model.layers[0].mlp.up_proj
    proj.weight = proj.weight + 0.5
    with MlxCacheController.from_model(model, tokenizer, store_root, model_id="tiny") as ctl:
        assert ctl.prepare(p).source == "cold"


def test_a_stated_identity_is_used_and_a_lie_about_the_architecture_refused(
        tiny_model_dir, store_root):
    p = CachePrepareParams(**PARAMS)
    model, tokenizer = plain(tiny_model_dir)
    with MlxCacheController.from_model(model, tokenizer, store_root, model_id="tiny",
                                       identity="tiny-app@1") as ctl:
        assert ctl.mlx.identity()["model_digest"] == "stated:tiny-app@1"
        assert ctl.prepare(p).source == "cold"
    with MlxCacheController.from_model(*plain(tiny_model_dir), store_root,
                                       model_id="tiny", identity="tiny-app@1") as ctl:
        assert ctl.prepare(p).source == "disk"
    # the same name on a model of another architecture: more layers, or quantized
    deeper = type(model)(dataclasses.replace(model.args, num_hidden_layers=3))
    for other in (deeper, quantized(tiny_model_dir)[0]):
        with pytest.raises(ConfigError) as info:
            MlxCacheController.from_model(other, tokenizer, store_root, model_id="tiny",
                                          identity="tiny-app@1")
        said = str(info.value)
        assert "identity 'tiny-app@1' was stated for a model of another architecture" in said
        assert "\n" not in said and "state a new identity" in said
    # control: a new name on that architecture is taken, and never reads tiny-app@1's entries
    with MlxCacheController.from_model(deeper, tokenizer, store_root, model_id="tiny",
                                       identity="tiny-deeper@1") as ctl:
        assert ctl.prepare(p).source == "cold"


def test_what_is_not_a_model_or_an_identity_is_one_config_error(tiny_model_dir, adapter_dir):
    model, tokenizer = plain(tiny_model_dir)
    with pytest.raises(ConfigError, match="not an mlx-lm model: a object"):
        MlxBackend.from_loaded(object(), tokenizer)
    with pytest.raises(ConfigError, match="not a tokenizer"):
        MlxBackend.from_loaded(model, object())
    with pytest.raises(ConfigError, match="identity must be a non-empty string"):
        MlxBackend.from_loaded(model, tokenizer, identity=" ")
    with pytest.raises(ConfigError, match="adapter_path cannot apply to a model already"):
        MlxCacheController.from_model(model, tokenizer, adapter_path=adapter_dir)
    with pytest.raises(ConfigError, match="kv_bits must be one of"):
        MlxCacheController.from_model(model, tokenizer, kv_bits=7)


def test_the_source_directory_names_the_model_by_default(tiny_model_dir):
    """``mlx_lm.load`` records where the tokenizer came from: that is the default
    ``model_id``, and params may name the model by that directory."""
    with MlxCacheController.from_model(*plain(tiny_model_dir)) as ctl:
        assert ctl.mlx.model_id == str(tiny_model_dir)
        h = ctl.prepare(CachePrepareParams(**{**PARAMS, "model": str(tiny_model_dir)}))
        assert h.source == "cold"


def test_a_plain_transformers_tokenizer_is_wrapped_as_mlx_lm_does(tiny_model_dir):
    from transformers import AutoTokenizer

    model, wrapper = plain(tiny_model_dir)
    backend = MlxBackend.from_loaded(model, AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    reference = MlxBackend.from_loaded(model, wrapper)
    assert backend.tokenize_segments([SYSTEM, DOC]) == reference.tokenize_segments([SYSTEM, DOC])
    assert backend.eos_ids == reference.eos_ids and backend.model_id == str(tiny_model_dir)


def test_a_weight_edited_after_the_hand_over_bypasses_with_one_warning(
        tiny_model_dir, store_root, caplog):
    """The handed-over model is watched like a loaded one: a replaced weight is no silent
    reuse of the entries made with the old weights."""
    caplog.set_level(logging.DEBUG, logger="spoolctl.controllers")
    p = CachePrepareParams(**PARAMS)
    model, tokenizer = plain(tiny_model_dir)
    with MlxCacheController.from_model(model, tokenizer, store_root, model_id="tiny") as ctl:
        assert ctl.prepare(p).source == "cold"
        assert ctl.prepare(p).source == "memory"  # control: untouched, it hits
        stored = ctl.store.entries()
        proj = model.model.layers[0].self_attn.o_proj
        proj.weight = proj.weight + 1e-3
        edited_cold = cold_tokens(ctl.mlx, p, QUESTION, NEW)
        for _ in range(2):
            assert ctl.prepare(p).ref is None
            result = ctl.generate(p, QUESTION, NEW)
            assert result.tokens == edited_cold and result.usage.cache_read_tokens == 0
        assert ctl.stats()["bypassed"] == 4 and ctl.store.entries() == stored
    said = [r for r in caplog.records if "cannot identify" in r.getMessage()]
    assert [r.levelno for r in said].count(logging.WARNING) == 1


def test_from_model_takes_every_constructor_option_but_the_loading_one(tiny_model_dir):
    """What docs/controllers.md says under the options table: every option of the
    constructor but ``adapter_path`` (which loads) passes through ``from_model``."""
    import inspect

    signature = inspect.signature(MlxCacheController.__init__).parameters
    options = {name: p.default for name, p in signature.items()
               if name not in ("self", "model", "root", "adapter_path")}
    with MlxCacheController.from_model(*plain(tiny_model_dir), **options) as ctl:
        assert ctl.prepare(CachePrepareParams(**{**PARAMS, "model": None})).source == "cold"


def test_a_second_controller_on_the_same_model_does_not_hash_it_again(tiny_model_dir,
                                                                      monkeypatch):
    """The digest is kept per model object while it holds the same arrays; a replaced
    array is hashed again."""
    from spoolctl.controllers.mlx import appmodel
    from spoolctl.store import Hasher

    fed: list[int] = []

    class Counting(Hasher):
        def update(self, data) -> None:
            fed.append(len(data))
            super().update(data)

    monkeypatch.setattr(appmodel, "Hasher", Counting)
    model, tokenizer = plain(tiny_model_dir)
    first = MlxBackend.from_loaded(model, tokenizer).identity()["model_digest"]
    hashed = len(fed)
    assert hashed > 0
    with MlxCacheController.from_model(model, tokenizer) as ctl:
        assert ctl.mlx.identity()["model_digest"] == first and len(fed) == hashed
    proj = model.model.layers[1].mlp.gate_proj
    proj.weight = proj.weight * 2
    assert MlxBackend.from_loaded(model, tokenizer).identity()["model_digest"] != first
    assert len(fed) > hashed
