"""A model the application loaded itself (``PyTorchCacheController.from_model``): plain,
dynamically quantized and ``torch.compile``-d, on the tiny Llama."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from controller_backends import cold_tokens

pytest.importorskip("transformers")

from spoolctl.controllers import CachePrepareParams
from spoolctl.controllers.pytorch import PyTorchCacheController
from spoolctl.errors import ConfigError

SYSTEM = "You are a helpful assistant. Answer using the reference documents below."
DOC = "Manual: the pump starts when the valve is open and the tank is full. " * 4
QUESTION = "Question: when does the pump start?"
PARAMS = {"model": "tiny", "instructions": [SYSTEM], "data": [DOC]}


def load(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(str(model_dir)),
            AutoTokenizer.from_pretrained(str(model_dir)))


def quantized(model_dir: Path):
    import torch

    model, tokenizer = load(model_dir)
    with warnings.catch_warnings():  # torch.ao's deprecation notices
        warnings.simplefilter("ignore")
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear},
                                                       dtype=torch.qint8)
    return model, tokenizer


def compiled(model_dir: Path):
    import torch

    model, tokenizer = load(model_dir)
    # the eager backend: inductor needs a C++ toolchain and ~30 s per shape on a CPU host
    return torch.compile(model, backend="eager"), tokenizer


def plain(model_dir: Path):
    return load(model_dir)


@pytest.mark.parametrize("make", [plain, quantized, compiled])
def test_a_handed_over_model_restores_from_disk_like_a_cold_run(make, tiny_model_dir,
                                                                 store_root):
    """A fresh controller on the same store, given a freshly loaded (and quantized /
    compiled) model, finds the first one's entry on disk and decodes what a cold run does."""
    p = CachePrepareParams(**PARAMS)
    with PyTorchCacheController.from_model(*make(tiny_model_dir), store_root,
                                           model_id="tiny") as ctl:
        assert ctl.prepare(p).source == "cold"
    model, tokenizer = make(tiny_model_dir)
    with PyTorchCacheController.from_model(model, tokenizer, store_root,
                                           model_id="tiny") as ctl:
        assert ctl.backend.identity()["revision"].startswith("params:blake3:")
        want = cold_tokens(ctl.backend, p, QUESTION, 8)
        got = ctl.generate(p, QUESTION, 8)
        assert got.handle.source == "disk"
        assert got.tokens == want
        if make is compiled:
            assert ctl.backend.run is model and ctl.backend.model is model._orig_mod


def test_quantized_and_compiled_models_are_named_by_their_own_tensors(tiny_model_dir):
    """A compiled model has the identity of the module it wraps; quantizing changes it."""
    import torch

    from spoolctl.controllers.pytorch import PyTorchBackend

    base = PyTorchBackend.from_loaded(*plain(tiny_model_dir))
    comp = PyTorchBackend.from_loaded(*compiled(tiny_model_dir))
    quant = PyTorchBackend.from_loaded(*quantized(tiny_model_dir))
    assert base.identity()["revision"] == comp.identity()["revision"]
    assert quant.identity()["revision"] != base.identity()["revision"]
    # a weight that differs only inside the quantized integers changes the digest, also of
    # a model object already digested once
    other, tokenizer = quantized(tiny_model_dir)
    before = PyTorchBackend.from_loaded(other, tokenizer).identity()["revision"]
    assert before == quant.identity()["revision"]
    layer = other.model.layers[0].mlp.down_proj
    w, b = layer._packed_params._weight_bias()
    ints = w.int_repr().clone()
    ints.view(-1)[0] = ints.view(-1)[0] + 1 if ints.view(-1)[0] < 100 else ints.view(-1)[0] - 1
    changed = torch._make_per_tensor_quantized_tensor(ints, w.q_scale(), w.q_zero_point())
    layer.set_weight_bias(changed, b)
    assert PyTorchBackend.from_loaded(other, tokenizer).identity()["revision"] \
        != quant.identity()["revision"]


def test_a_model_with_other_weights_never_hits_the_first_ones_entries(tiny_model_dir,
                                                                       store_root):
    import torch

    p = CachePrepareParams(**PARAMS)
    with PyTorchCacheController.from_model(*plain(tiny_model_dir), store_root,
                                           model_id="tiny") as ctl:
        ctl.prepare(p)
    model, tokenizer = plain(tiny_model_dir)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 0.5
    with PyTorchCacheController.from_model(model, tokenizer, store_root,
                                           model_id="tiny") as ctl:
        assert ctl.prepare(p).source == "cold"


def test_a_stated_identity_is_used_and_a_lie_about_the_architecture_refused(
        tiny_model_dir, store_root):
    from transformers import AutoModelForCausalLM

    p = CachePrepareParams(**PARAMS)
    model, tokenizer = plain(tiny_model_dir)
    with PyTorchCacheController.from_model(model, tokenizer, store_root, model_id="tiny",
                                           identity="tiny-app@1") as ctl:
        assert ctl.backend.identity()["revision"] == "stated:tiny-app@1"
        ctl.prepare(p)
    with PyTorchCacheController.from_model(*plain(tiny_model_dir), store_root,
                                           model_id="tiny", identity="tiny-app@1") as ctl:
        assert ctl.prepare(p).source == "disk"
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.num_hidden_layers += 1
    other = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match="stated for a model of another architecture"):
        PyTorchCacheController.from_model(other, tokenizer, store_root, model_id="tiny",
                                          identity="tiny-app@1")


def test_what_is_not_a_model_or_an_identity_is_one_config_error(tiny_model_dir):
    from spoolctl.controllers.pytorch import PyTorchBackend

    model, tokenizer = plain(tiny_model_dir)
    with pytest.raises(ConfigError, match="not a transformers causal LM"):
        PyTorchBackend.from_loaded(object(), tokenizer)
    with pytest.raises(ConfigError, match="identity must be a non-empty string"):
        PyTorchBackend.from_loaded(model, tokenizer, identity=" ")
    with pytest.raises(ConfigError, match="dtype cannot apply to a model already loaded"):
        PyTorchCacheController.from_model(model, tokenizer, dtype="float16")


def test_a_weight_edited_after_the_hand_over_bypasses_the_cache(tiny_model_dir, store_root):
    """The handed-over model is watched like a loaded one: an in-place edit is no silent
    reuse of the entries made with the old weights."""
    import torch

    p = CachePrepareParams(**PARAMS)
    model, tokenizer = plain(tiny_model_dir)
    with PyTorchCacheController.from_model(model, tokenizer, store_root,
                                           model_id="tiny") as ctl:
        ctl.prepare(p)
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight[0, 0] += 0.5
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert ctl.prepare(p).source != "memory"
        assert ctl.stats()["bypassed"] >= 1
