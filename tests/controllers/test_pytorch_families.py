"""PyTorchCacheController on the cache families beyond full attention (issue #31).

One tiny model per family, built from transformers' own config classes
(``spoolctl.demo.tinyfamilies``): Gemma 3 (sliding window + global layers), Jamba (Mamba +
attention), Mamba (recurrent state only). Real model code, real store, real files.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("transformers")

from family_prompts import (
    DOC1,
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
from spoolctl.controllers.pytorch import PyTorchBackend, PyTorchCacheController
from spoolctl.store import Store

#: Default run: the sliding family (cheapest); the state-space ones run under ``extended``
#: (their reference PyTorch scans make each run tens of seconds on 2 cores).
BY_FAMILY = [pytest.param(f, marks=() if f == "sliding" else pytest.mark.extended)
             for f in FAMILIES]


@pytest.fixture(scope="module")
def backends(tmp_path_factory) -> dict[str, PyTorchBackend]:
    from spoolctl.demo.tinyfamilies import build_family_model

    root = tmp_path_factory.mktemp("families")
    return {f: PyTorchBackend(build_family_model(root / f, f), model_id=f) for f in FAMILIES}


@pytest.mark.parametrize("family", BY_FAMILY)
def test_disk_restore_gives_the_tokens_of_a_cold_run(backends, family, store_root):
    """Stored by one controller, read from disk by a fresh one (no memory): greedy and
    seeded-sampling tokens equal a cold run of the same model."""
    b = backends[family]
    p = params(family, DOC1)
    with PyTorchCacheController(b, store_root) as ctl:
        assert ctl.prepare(p).source == "cold"
    with PyTorchCacheController(b, store_root) as ctl:
        greedy = ctl.generate(p, QUESTION, 8)
        sampled = ctl.generate(p, QUESTION, 8, **SEEDED)
    assert greedy.handle.source == "disk" and greedy.usage.cache_read_tokens > 0
    assert greedy.tokens == cold(b, DOC1)
    assert sampled.tokens == cold(b, DOC1, **SEEDED)


# the engine's rule; tests/controllers/test_mlx_families.py covers it by default
@pytest.mark.extended
@pytest.mark.parametrize("family", FAMILIES)
def test_extension_is_reused_and_exact_near_misses_and_cuts_run_cold(backends, family,
                                                                      store_root, caplog):
    """The extension rule (``family_prompts.check_extension_rule``)."""
    check_extension_rule(PyTorchCacheController, backends[family], family, store_root, caplog)


# the engine rule; tests/controllers/test_mlx_families.py covers it by default
@pytest.mark.extended
@pytest.mark.parametrize("family", FAMILIES)
def test_one_system_prompt_many_documents_extends_the_instructions_snapshot(
        backends, family, store_root):
    """One system prompt, many documents (``family_prompts.check_instructions_snapshot``)."""
    check_instructions_snapshot(PyTorchCacheController, backends[family], family, store_root)


@pytest.mark.parametrize("family", BY_FAMILY)
def test_a_prompt_inside_or_past_a_stored_message_restores_the_checkpoint_before_it(
        backends, family, store_root):
    """The common-prefix rule (``family_prompts.check_common_prefix_rule``): a prompt that
    stops inside a stored document, and one that extends it inside its message, restore
    the nearest stored state at or before the ids they share, not a cold run."""
    check_common_prefix_rule(PyTorchCacheController, backends[family], family, store_root)


@pytest.mark.parametrize("family", FAMILIES)
def test_trim_refuses_to_cut_a_state_back(backends, family):
    b = backends[family]
    ids = b.tokenize_segments([SYSTEM + " " + DOC1])[0]
    cache = b.prefill(b.new_cache(), ids)
    assert not b.trimmable
    with pytest.raises(ValueError, match="cannot be cut back"):
        b.trim(cache, len(ids) - 5)


def test_entry_layout_says_what_it_holds_and_another_family_never_reads_it(backends,
                                                                          store_root):
    """The manifest layout names every layer's kind, window and state shapes; the identity
    (and so the namespace) differs per family; a payload of one family handed to another
    model's loader is refused before a tensor reaches it."""
    kinds = {}
    entries = {}
    for family, b in backends.items():
        with PyTorchCacheController(b, store_root) as ctl:
            h = ctl.prepare(params(family, DOC1))
        with Store.open(store_root) as s:
            m = s.manifest(h.ref)
            entries[family] = (m, s.read_all(m))
        layout = m.meta["layout"]
        assert layout["cache"] == "hf-layers/v1"
        kinds[family] = [d["kind"] for d in layout["layers"]]
    assert kinds == {"sliding": ["sliding", "sliding", "sliding", "full"],
                     "hybrid": ["state", "full", "state", "full"],
                     "ssm": ["state", "state"]}
    sliding = entries["sliding"][0].meta["layout"]["layers"][0]
    assert sliding["window"] == 16 and sliding["kv_heads"] == 2 and sliding["head_dim"] == 32
    state = entries["ssm"][0].meta["layout"]["layers"][0]
    assert state["conv"] == [{"shape": [256, 4], "dtype": "float32"}]
    assert state["recurrent"] == [{"shape": [256, 8], "dtype": "float32"}]
    assert len({b.identity()["kv_layout"] for b in backends.values()}) == 3
    for reader in FAMILIES:
        for writer, (m, objects) in entries.items():
            if reader == writer:
                continue
            with pytest.raises(ValueError, match="layout"):
                backends[reader].deserialize(objects, m.meta["layout"], len(m.meta["tokens"])
                                             if isinstance(m.meta.get("tokens"), list)
                                             else 10)


def test_import_of_a_sliding_window_cache_is_checked_and_restores_exactly(backends,
                                                                         store_root):
    """``import_cache`` of a family cache: the user's own prefill (past the window) is
    checked against a recomputation of every state and stored; a fresh controller's tokens
    from it equal a cold run. A cache of other tokens (one changed) is refused with one
    line and nothing is stored."""
    from spoolctl.errors import ConfigError

    b = backends["sliding"]
    p = params("sliding", DOC1)
    with PyTorchCacheController(b, store_root) as ctl:
        ids = ctl.prefix_tokens(p)
        assert len(ids) > 16  # the window has rolled
        other = b.prefill(b.new_cache(), [*ids[:-3], ids[-3] ^ 1, *ids[-2:]])
        with pytest.raises(ConfigError, match="does not hold these tokens") as err:
            ctl.import_cache(p, other)
        assert "\n" not in str(err.value)
        assert not list((store_root / "manifests").rglob("*.json"))
        h = ctl.import_cache(p, b.prefill(b.new_cache(), ids))
        assert h.source == "import" and h.cached_tokens == len(ids)
    with PyTorchCacheController(b, store_root) as ctl:
        out = ctl.generate(p, QUESTION, 8)
    assert out.handle.source == "disk" and out.tokens == cold(b, DOC1)


def test_a_mamba_of_other_state_shapes_at_the_same_path_runs_cold(backends, tmp_path,
                                                                   store_root, caplog):
    """The Mamba at a path is replaced by one with another state size and conv kernel: the
    new model never reads the old entry (it runs cold and correct, nothing logged), and
    its loader refuses the old bytes with one line -- under the old layout, and under a
    manifest that claims the new layout (the per-tensor state-shape check)."""
    import shutil

    from spoolctl.demo.tinyfamilies import build_family_model

    path = tmp_path / "mamba"
    shutil.copytree(backends["ssm"].model_path, path)
    old = PyTorchBackend(path, model_id="m")
    p = CachePrepareParams(model="m", data=[DOC2])  # no instructions: no snapshot
    with PyTorchCacheController(old, store_root) as ctl:
        h = ctl.prepare(p)
    with Store.open(store_root) as s:
        m = s.manifest(h.ref)
        objects = s.read_all(m)
    new = PyTorchBackend(build_family_model(path, "ssm", overrides={"state_size": 4,
                                                                    "conv_kernel": 3}),
                         model_id="m")
    assert new.identity()["kv_layout"] != old.identity()["kv_layout"]
    with PyTorchCacheController(new, store_root) as ctl, caplog.at_level(logging.WARNING):
        o = ctl.prepare(p)
        assert o.source == "cold" and o.reused_tokens == 0
        assert ctl.stats()["load_failures"] == 0
        ids = ctl.prompt_tokens(o, QUESTION)
        assert ctl.generate(o, QUESTION, 4).tokens == new.generate(None, 0, ids, 4)
    assert spoolctl_warnings(caplog) == []
    with pytest.raises(ValueError, match="stored layout") as err:
        new.deserialize(objects, m.meta["layout"], h.cached_tokens)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"stored tensor c0_0 \(1, 256, 4\)") as err:
        new.deserialize(objects, new.layout(), h.cached_tokens)
    assert "\n" not in str(err.value)
