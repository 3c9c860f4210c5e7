"""The local controllers behave like their framework: ``generate`` with no decoding settings
decodes as ``model.generate`` with no arguments (the model's ``generation_config``), a store
that refuses every commit says so once per controller, and the package ships ``py.typed``.
Real transformers on the locally built tiny Llama."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from testpaths import REPO_DIR

from spoolctl.controllers import CachePrepareParams
from spoolctl.controllers.pytorch import PyTorchBackend, PyTorchCacheController

SYSTEM = "You are a helpful assistant. Answer using the reference documents below."
DOC = "Manual, part one: the pump starts when the valve is open and the tank is full. " * 4
QUESTION = "Question: when does the pump start?"
P = {"model": "tiny", "instructions": [SYSTEM], "data": [DOC]}
NEW = 10


def _with_generation_config(src: Path, dst: Path, **settings) -> Path:
    """A copy of the tiny model whose saved ``generation_config.json`` has ``settings``."""
    from transformers import GenerationConfig

    shutil.copytree(src, dst)
    config = GenerationConfig.from_pretrained(dst)
    config.update(**settings)
    config.save_pretrained(dst)
    return dst


def _reference(backend: PyTorchBackend, ids: list[int], seed: int, **kwargs) -> list[int]:
    """``model.generate`` on the whole prompt, as a user would call it."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        out = backend.model.generate(torch.tensor([ids]), max_new_tokens=NEW,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     **kwargs)
    return out[0, len(ids):].tolist()


def _ours(ctl: PyTorchCacheController, seed: int, **kwargs) -> list[int]:
    import torch

    torch.manual_seed(seed)
    return ctl.generate(CachePrepareParams(**P), QUESTION, NEW, **kwargs).tokens


def test_generate_samples_like_the_models_generation_config(tiny_model_dir, tmp_path):
    """A model saved to sample (temperature, top-k, top-p, repetition penalty): with no
    settings, the controller's tokens are model.generate's, cold and from the cache."""
    model = _with_generation_config(tiny_model_dir, tmp_path / "sampling", do_sample=True,
                                    temperature=1.3, top_k=40, top_p=0.97,
                                    repetition_penalty=1.3)
    backend = PyTorchBackend(model, model_id="tiny")
    with PyTorchCacheController(backend, tmp_path / "store") as ctl:
        ids = ctl.prompt_tokens(CachePrepareParams(**P), QUESTION)
        for seed in (0, 1):
            want = _reference(backend, ids, seed)
            assert want != _reference(backend, ids, seed, do_sample=False)  # it does sample
            assert _ours(ctl, seed) == want  # cold, then from the prepared cache
            assert _ours(ctl, seed) == want
        # An explicit setting overrides the model's: temperature=0 is greedy.
        assert _ours(ctl, 5, temperature=0) == _reference(backend, ids, 5, do_sample=False)


def test_generate_greedy_with_the_models_repetition_penalty(tiny_model_dir, tmp_path):
    model = _with_generation_config(tiny_model_dir, tmp_path / "penalty", do_sample=False,
                                    repetition_penalty=1.3)
    backend = PyTorchBackend(model, model_id="tiny")
    with PyTorchCacheController(backend, tmp_path / "store") as ctl:
        ids = ctl.prompt_tokens(CachePrepareParams(**P), QUESTION)
        want = _reference(backend, ids, 0)
        assert want != _reference(backend, ids, 0, repetition_penalty=1.0)  # it matters
        assert _ours(ctl, 0) == want and _ours(ctl, 0) == want


def test_top_p_without_sampling_is_refused_on_a_greedy_model(tiny_model_dir, tmp_path):
    from spoolctl.errors import ConfigError

    with PyTorchCacheController(PyTorchBackend(tiny_model_dir, model_id="tiny"),
                                tmp_path / "store") as ctl, \
            pytest.raises(ConfigError, match="no effect with greedy"):
        ctl.generate(CachePrepareParams(**P), QUESTION, 2, top_p=0.9)


def test_cache_not_persisted_is_said_once_per_controller(tiny_model_dir, tmp_path, caplog):
    backend = PyTorchBackend(tiny_model_dir, model_id="tiny")
    caplog.set_level(logging.DEBUG, logger="spoolctl.controllers")
    with PyTorchCacheController(backend, tmp_path / "store", max_bytes=64 << 10) as ctl:
        for i in range(3):  # each too big for the store: three failed commits
            h = ctl.prepare(CachePrepareParams(**{**P, "data": [f"{DOC} {i}"]}))
            assert h.source == "cold"
        assert ctl.stats()["commit_failures"] == 3
    said = [r for r in caplog.records if "not persisted" in r.getMessage()]
    assert len(said) == 3
    assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG, logging.DEBUG]


def test_the_package_ships_py_typed():
    import importlib.resources

    assert importlib.resources.files("spoolctl").joinpath("py.typed").is_file()
    project = (REPO_DIR / "pyproject.toml").read_text()
    assert '[tool.setuptools.package-data]\nspoolctl = ["py.typed"]' in project
