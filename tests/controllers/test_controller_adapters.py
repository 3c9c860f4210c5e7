"""LoRA adapters on a controller's model: every prepare keys on what the model is right then.

An app loads PEFT adapters into ``ctl.backend.model`` (transformers' ``load_adapter`` /
``set_adapter``, or ``peft.PeftModel`` around it) and switches between them; each state
gets its own entries, so the tokens always equal a cold run of that state -- across a
restart too -- and a change the controller cannot name (a weight edited in memory) runs
without the cache, with one warning. Real transformers + peft on the locally built tiny
Llama; adapters made here with peft (random, nonzero LoRA weights).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from controller_backends import make_mlx_adapter

from spoolctl.controllers import CachePrepareParams
from spoolctl.controllers.pytorch import PyTorchBackend, PyTorchCacheController

SYSTEM = "You are a helpful assistant. Answer using the reference documents below."
DOC = "Manual, part one: the pump starts when the valve is open and the tank is full. " * 4
QUESTION = "Question: when does the pump start?"
P = CachePrepareParams(model="tiny", instructions=[SYSTEM], data=[DOC])
NEW = 8
BASE = None


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two LoRA adapters of the tiny model (q/v projections, rank 4, random weights)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for name, seed in (("A", 1), ("B", 2)):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
        path = tmp_path_factory.mktemp("adapters") / name
        peft_model.save_pretrained(path)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, adapters: dict[str, Path]) -> dict[str | None, list[int]]:
    """Cold greedy tokens of the query for the base model and for each adapter, each on a
    freshly loaded model with no cache at all."""
    out: dict[str | None, list[int]] = {}
    for state in (BASE, "A", "B"):
        backend = PyTorchBackend(tiny_model_dir, model_id="tiny")
        if state is not None:
            backend.model.load_adapter(str(adapters[state]), adapter_name=state)
        with PyTorchCacheController(backend) as ctl:
            ids = ctl.prompt_tokens(P, QUESTION)
        out[state] = backend.generate(None, 0, ids, NEW)
    assert len({tuple(v) for v in out.values()}) == 3, "the adapters must change the tokens"
    return out


def _run(ctl: PyTorchCacheController) -> tuple[str, str | None, list[int]]:
    handle = ctl.prepare(P)
    return handle.source, handle.ref, ctl.generate(handle, QUESTION, NEW).tokens


def test_switching_adapters_keys_each_state_and_survives_a_restart(
        tiny_model_dir, adapters, reference, tmp_path):
    root = tmp_path / "store"
    with PyTorchCacheController(PyTorchBackend(tiny_model_dir, model_id="tiny"), root) as ctl:
        model = ctl.backend.model
        runs = {}
        source, ref, tokens = _run(ctl)  # base
        assert (source, tokens) == ("cold", reference[BASE])
        runs[BASE] = ref
        model.load_adapter(str(adapters["A"]), adapter_name="A")  # loading activates it
        source, ref, tokens = _run(ctl)
        assert (source, tokens) == ("cold", reference["A"]), "adapter A got the base's cache"
        runs["A"] = ref
        model.load_adapter(str(adapters["B"]), adapter_name="B")
        source, ref, tokens = _run(ctl)
        assert (source, tokens) == ("cold", reference["B"])
        runs["B"] = ref
        model.set_adapter("A")  # back: A's own entry, from memory
        assert _run(ctl) == ("memory", runs["A"], reference["A"])
        model.disable_adapters()  # and the base's
        assert _run(ctl) == ("memory", runs[BASE], reference[BASE])
        assert len(set(runs.values())) == 3
        # A handle prepared in one state and used in another runs cold, never the cache.
        handle = ctl.prepare(P)
        model.enable_adapters()
        model.set_adapter("B")
        result = ctl.generate(handle, QUESTION, NEW)
        assert result.tokens == reference["B"] and result.usage.cache_read_tokens == 0
        assert ctl.stats()["bypassed"] == 0

    # A restart: a new process state, the adapters loaded through peft.PeftModel this time.
    from peft import PeftModel

    with PyTorchCacheController(PyTorchBackend(tiny_model_dir, model_id="tiny"), root) as ctl:
        assert _run(ctl) == ("disk", runs[BASE], reference[BASE])
        wrapped = PeftModel.from_pretrained(ctl.backend.model, str(adapters["B"]),
                                            adapter_name="B")
        ctl.backend.model = wrapped  # the app generates through its wrapper: identified too
        assert _run(ctl) == ("disk", runs["B"], reference["B"])
        wrapped.load_adapter(str(adapters["A"]), adapter_name="A")
        wrapped.set_adapter("A")
        assert _run(ctl) == ("disk", runs["A"], reference["A"])


def test_adapter_scaling_is_part_of_the_state(tiny_model_dir, adapters, tmp_path):
    from peft.tuners.lora import LoraLayer

    with PyTorchCacheController(PyTorchBackend(tiny_model_dir, model_id="tiny"),
                                tmp_path / "store") as ctl:
        ctl.backend.model.load_adapter(str(adapters["A"]), adapter_name="A")
        full = ctl.prepare(P).ref
        for module in ctl.backend.model.modules():
            if isinstance(module, LoraLayer):
                module.set_scale("A", 0.5)
        half = ctl.prepare(P)
        assert half.source == "cold" and half.ref != full


def test_a_weight_edited_in_memory_bypasses_the_cache_with_one_warning(
        tiny_model_dir, tmp_path, caplog):
    import torch

    caplog.set_level(logging.DEBUG, logger="spoolctl.controllers")
    with PyTorchCacheController(PyTorchBackend(tiny_model_dir, model_id="tiny"),
                                tmp_path / "store") as ctl:
        assert ctl.prepare(P).source == "cold"
        stored = ctl.store.entries()
        with torch.no_grad():
            ctl.backend.model.model.layers[0].self_attn.q_proj.weight.add_(1e-3)
        ids = ctl.prompt_tokens(P, QUESTION)
        edited_cold = ctl.backend.generate(None, 0, ids, NEW)
        for _ in range(2):
            handle = ctl.prepare(P)
            assert handle.ref is None and handle.cached_tokens == 0
            result = ctl.generate(P, QUESTION, NEW)
            assert result.tokens == edited_cold and result.usage.cache_read_tokens == 0
        assert ctl.stats()["bypassed"] == 4  # two prepares, two generates
        assert ctl.store.entries() == stored  # nothing written
    said = [r for r in caplog.records if "cannot identify" in r.getMessage()]
    assert [r.levelno for r in said].count(logging.WARNING) == 1


# -- mlx-lm --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlx_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("mlx.core", reason="mlx is not installed here; pip install "
                                           "'mlx-lm[cpu]'")
    root = tmp_path_factory.mktemp("mlx-adapters")
    return {"A": make_mlx_adapter(root / "A", 1), "B": make_mlx_adapter(root / "B", 2)}


def _mlx_reference(tiny_model_dir: Path, adapter: Path | None) -> list[int]:
    from spoolctl.controllers.mlx import MlxBackend, MlxCacheController

    backend = MlxBackend(tiny_model_dir, model_id="tiny", adapter_path=adapter)
    with MlxCacheController(backend) as ctl:
        ids = ctl.prompt_tokens(P, QUESTION)
    return backend.generate(None, 0, ids, NEW)


def test_mlx_adapters_key_each_state_and_survive_a_restart(tiny_model_dir, mlx_adapters,
                                                            tmp_path):
    from mlx_lm.tuner.utils import load_adapters, remove_lora_layers

    from spoolctl.controllers.mlx import MlxBackend, MlxCacheController

    ref = {state: _mlx_reference(tiny_model_dir, mlx_adapters.get(state))
           for state in (BASE, "A", "B")}
    assert len({tuple(v) for v in ref.values()}) == 3, "the adapters must change the tokens"
    root = tmp_path / "store"
    with MlxCacheController(MlxBackend(tiny_model_dir, model_id="tiny"), root) as ctl:
        model = ctl.mlx.model
        runs = {}
        source, runs[BASE], tokens = _run(ctl)
        assert (source, tokens) == ("cold", ref[BASE])
        load_adapters(model, str(mlx_adapters["A"]))
        source, runs["A"], tokens = _run(ctl)
        assert (source, tokens) == ("cold", ref["A"]), "adapter A got the base's cache"
        model.load_weights(str(mlx_adapters["B"] / "adapters.safetensors"), strict=False)
        source, runs["B"], tokens = _run(ctl)
        assert (source, tokens) == ("cold", ref["B"])
        model.load_weights(str(mlx_adapters["A"] / "adapters.safetensors"), strict=False)
        assert _run(ctl) == ("memory", runs["A"], ref["A"])  # same content: A's own entry
        remove_lora_layers(model)
        assert _run(ctl) == ("memory", runs[BASE], ref[BASE])
        assert len(set(runs.values())) == 3 and ctl.stats()["bypassed"] == 0
    # A restart: the adapter loaded by mlx_lm.load(..., adapter_path=) this time.
    for state in ("A", "B", BASE):
        with MlxCacheController(tiny_model_dir, root, model_id="tiny",
                                adapter_path=mlx_adapters.get(state)) as ctl:
            assert _run(ctl) == ("disk", runs[state], ref[state])


def test_mlx_a_weight_replaced_in_memory_bypasses_with_one_warning(tiny_model_dir, tmp_path,
                                                                   mlx_adapters, caplog):
    from spoolctl.controllers.mlx import MlxBackend, MlxCacheController

    caplog.set_level(logging.DEBUG, logger="spoolctl.controllers")
    backend = MlxBackend(tiny_model_dir, model_id="tiny", adapter_path=mlx_adapters["A"])
    with MlxCacheController(backend, tmp_path / "store") as ctl:
        assert ctl.prepare(P).source == "cold"
        stored = ctl.store.entries()
        proj = ctl.mlx.model.model.layers[0].self_attn.o_proj
        proj.weight = proj.weight + 1e-3
        ids = ctl.prompt_tokens(P, QUESTION)
        edited_cold = backend.generate(None, 0, ids, NEW)
        for _ in range(2):
            assert ctl.prepare(P).ref is None
            result = ctl.generate(P, QUESTION, NEW)
            assert result.tokens == edited_cold and result.usage.cache_read_tokens == 0
        assert ctl.stats()["bypassed"] == 4 and ctl.store.entries() == stored
    said = [r for r in caplog.records if "cannot identify" in r.getMessage()]
    assert [r.levelno for r in said].count(logging.WARNING) == 1
