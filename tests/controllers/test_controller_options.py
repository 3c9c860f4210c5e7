"""Same options on every controller, and one table in docs/controllers.md that says so.

The table "What each controller takes and stores" is parsed here and compared with the real
constructor signatures and family lists; an option a call does not take, an mlx-lm model
directory mlx-lm cannot load and a ``CacheList`` model (Falcon-H1) are each one
``ConfigError`` line naming the argument or directory and the fix (real tiny models, real
stores).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import shutil

import pytest
from testpaths import REPO_DIR

from spoolctl.controllers import CachePrepareParams
from spoolctl.errors import ConfigError

DOC = REPO_DIR / "docs" / "controllers.md"
HEADING = "## What each controller takes and stores"
MODULES = {"PyTorchCacheController": "spoolctl.controllers.pytorch",
           "MlxCacheController": "spoolctl.controllers.mlx",
           "MlxVlmCacheController": "spoolctl.controllers.mlx.vlm",
           "GoogleGenAICacheController": "spoolctl.controllers.genai.controller"}


def _needs_mlx() -> None:
    pytest.importorskip("mlx.core", reason="mlx is not installed here; pip install 'mlx-lm[cpu]'")


def _table() -> dict[str, dict[str, list[str]]]:
    """The table's rows by controller: each cell as its list of `code` names."""
    text = DOC.read_text(encoding="utf-8")
    assert HEADING in text, f"{DOC} has no section {HEADING!r}"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    table = {}
    for line in rows:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name, options, layers, refused = (re.findall(r"`([^`]+)`", c) for c in cells)
        table[name[0]] = {"options": options, "layers": layers, "refused": refused}
    return table


def _controller(name: str) -> type:
    if name == "GoogleGenAICacheController":
        pytest.importorskip("google.genai")
    return getattr(importlib.import_module(MODULES[name]), name)


def test_the_table_lists_every_controller_and_its_constructor_options():
    table = _table()
    assert set(table) == set(MODULES)
    for name, row in table.items():
        params = [p for p in inspect.signature(_controller(name).__init__).parameters
                  if p != "self"]
        assert row["options"] == params, f"{name}: the docs table's options are not its own"


def test_the_table_lists_the_layers_each_local_controller_stores():
    from spoolctl.controllers.mlx import FAMILY_CLASSES, REFUSED_MODEL_TYPES
    from spoolctl.controllers.pytorch.layers import STORED_LAYERS

    table = _table()
    assert table["PyTorchCacheController"]["layers"] == list(STORED_LAYERS)
    assert set(table["MlxCacheController"]["layers"]) == FAMILY_CLASSES
    assert table["MlxVlmCacheController"]["layers"] == ["KVCache"]
    assert table["MlxCacheController"]["refused"] == ["CacheList", *REFUSED_MODEL_TYPES,
                                                     "PyTorchCacheController"]


def test_the_pytorch_layers_listed_are_transformers_classes():
    cache_utils = pytest.importorskip("transformers.cache_utils")
    from spoolctl.controllers.pytorch.layers import STORED_LAYERS

    assert all(hasattr(cache_utils, name) for name in STORED_LAYERS)


def test_every_refused_mlx_model_type_builds_a_cache_list():
    _needs_mlx()
    from spoolctl.controllers.mlx import REFUSED_MODEL_TYPES

    for model_type in REFUSED_MODEL_TYPES:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
        make_cache = inspect.getsource(module.Model.make_cache)
        assert "CacheList(" in make_cache, model_type


@pytest.mark.parametrize("name", list(MODULES))
def test_an_unknown_constructor_option_is_a_config_error_naming_it(name, tmp_path):
    with pytest.raises(ConfigError) as err:
        _controller(name)(tmp_path, max_tokens=8)
    text = str(err.value)
    assert f"{name}() takes no argument 'max_tokens'" in text
    assert "root" in text or "store" in text  # the accepted options are listed


def test_an_unknown_call_option_is_a_config_error_naming_it(tiny_model_dir, tmp_path):
    from spoolctl.controllers.pytorch import PyTorchCacheController

    with PyTorchCacheController(tiny_model_dir, tmp_path / "store") as ctl:
        params = CachePrepareParams(model=ctl.model_id, instructions=["Be brief."])
        with pytest.raises(ConfigError, match=r"PyTorchCacheController\.generate\(\) takes no "
                           r"argument 'max_tokens': did you mean max_new_tokens=\?"):
            ctl.generate(params, "hi", max_tokens=8)
        with pytest.raises(ConfigError, match=r"prepare\(\) takes no argument 'read_only'"):
            ctl.prepare(params, read_only=True)
        assert ctl.generate(params, "hi", max_new_tokens=2).tokens  # real options still work


def test_mlx_takes_the_deadlines(tiny_model_dir, tmp_path):
    _needs_mlx()
    from spoolctl.controllers.mlx import MlxCacheController

    with MlxCacheController(tiny_model_dir, tmp_path / "store", lookup_deadline=0.25,
                            read_deadline=2.0) as ctl:
        assert (ctl.deadlines.lookup_deadline_s, ctl.deadlines.read_deadline_s) == (0.25, 2.0)
        with pytest.raises(ConfigError, match=r"MlxCacheController\.generate"):
            ctl.generate(CachePrepareParams(instructions=["x"]), "hi", max_tokens=2)
    with pytest.raises(ConfigError, match="lookup_deadline"):
        MlxCacheController(tiny_model_dir, tmp_path / "store", lookup_deadline=-1)


def test_an_mlx_lm_load_failure_is_one_config_error_naming_the_directory(tiny_model_dir,
                                                                         tmp_path):
    _needs_mlx()
    from spoolctl.controllers.mlx import MlxCacheController

    broken = shutil.copytree(tiny_model_dir, tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    del config["rms_norm_eps"]  # mlx-lm's ModelArgs(...) raises a TypeError for it
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        MlxCacheController(broken, tmp_path / "store")
    text = str(err.value)
    assert "\n" not in text and str(broken) in text and "rms_norm_eps" in text
    assert "check config.json" in text


def test_mlx_refuses_falcon_h1_naming_the_controller_that_runs_it(tmp_path):
    _needs_mlx()
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers import FalconH1Config, FalconH1ForCausalLM

    from spoolctl.controllers.mlx import MlxCacheController
    from spoolctl.demo.tinymodel import train_tokenizer

    tok = train_tokenizer(512)
    torch.manual_seed(0)
    config = FalconH1Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, mamba_d_ssm=64,
        mamba_n_heads=2, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1, mamba_expand=1,
        mamba_chunk_size=16, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    model_dir = tmp_path / "falcon-h1"
    FalconH1ForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    with pytest.raises(ConfigError, match=r"model type 'falcon_h1' uses mlx-lm cache types "
                                          r"\['CacheList'\].*PyTorchCacheController"):
        MlxCacheController(model_dir, tmp_path / "store")


def test_async_calls_stay_coroutine_functions():
    controller = _controller("GoogleGenAICacheController")
    for name in ("aprepare", "agenerate", "arelease", "aclose"):
        assert inspect.iscoroutinefunction(getattr(controller, name)), name
