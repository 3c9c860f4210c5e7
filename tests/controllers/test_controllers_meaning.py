"""What a local cache entry means (issue 29), for both local controllers, with real
transformers + torch and real mlx-lm on the locally built tiny Llama.

* Supersession: only an entry the new one strictly extends is superseded, and only once
  no live handle holds it; siblings under one system message coexist (decision 2100).
* Drift: a chat template that renders today's date moves the prefix the next day; that is
  a miss with its own counter, never a quarantine (decision 2101).
"""

from __future__ import annotations

import datetime as dt
import gc
import shutil
from pathlib import Path

import pytest
from controller_backends import make_backend

pytest.importorskip("transformers")

from spoolctl.controllers import CachePrepareParams, Element, LocalCacheController
from spoolctl.demo.tinymodel import CHAT_TEMPLATE
from spoolctl.store import Store

SYSTEM = "You are a helpful assistant. Answer using the reference documents below."
DOCS = [
    "Manual, part one: the pump starts when the valve is open and the tank is full. " * 3,
    "Manual, part two: never run the pump dry; check the seal every month. " * 3,
    "Manual, part three: the quick brown fox jumps over the lazy dog near the tank. " * 3,
]
QUESTION = "Question: when does the pump start?"
NEW = 8


@pytest.fixture(scope="module", params=["pytorch", "mlx"])
def backend(request, tiny_model_dir: Path):
    return make_backend(request.param, tiny_model_dir)


#: The Llama-3.1 pattern: the system header carries today's date from ``strftime_now``.
DATED_TEMPLATE = "{%- set date_string = strftime_now('%d %b %Y') %}" + CHAT_TEMPLATE.replace(
    "'<|im_start|>' + message.role + '\\n' + message.content",
    "'<|im_start|>' + message.role + '\\n' + ('Today Date: ' + date_string + '\\n' "
    "if message.role == 'system' else '') + message.content")


@pytest.fixture(scope="module", params=["pytorch", "mlx"])
def dated_backend(request, tiny_chat_model_dir: Path, tmp_path_factory):
    assert DATED_TEMPLATE != "{%- set date_string = strftime_now('%d %b %Y') %}" + CHAT_TEMPLATE
    model = tmp_path_factory.mktemp("models") / "dated"
    shutil.copytree(tiny_chat_model_dir, model)
    (model / "chat_template.jinja").write_text(DATED_TEMPLATE)
    return make_backend(request.param, model)


@pytest.fixture
def today(monkeypatch):
    """The clock chat templates read (transformers' ``strftime_now``), set by the test."""
    from transformers.utils import chat_template_utils

    day = {"now": dt.datetime(2026, 12, 1, 9, 0)}

    class Clock(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return day["now"]

    monkeypatch.setattr(chat_template_utils, "datetime", Clock)
    return day


def params(*data: str, **kw) -> CachePrepareParams:
    return CachePrepareParams(instructions=[Element(SYSTEM, role="system")],
                              data=[Element(d, role="user") for d in data], **kw)


def cold(ctl: LocalCacheController, p: CachePrepareParams, prompt: str = QUESTION) -> list[int]:
    return ctl.backend.generate(None, 0, ctl.prompt_tokens(p, prompt), NEW)


def retained(root: Path) -> set[str]:
    with Store.open(root) as s:
        return {r.entry_id for r in s.entries() if r.hint == "retain"}


# -- item 2: one prefix no longer replaces its siblings -----------------------------------


def test_siblings_under_one_system_message_all_survive_a_restart(backend, store_root):
    """Three documents under one system prompt: each is built from the shared system
    prefix of another, none replaces another; after a restart all three are disk hits."""
    with LocalCacheController(backend, store_root) as ctl:
        handles = [ctl.prepare(params(d)) for d in DOCS]
        assert [h.source for h in handles] == ["cold", "incremental", "incremental"]
        assert all(h.supersedes is None for h in handles)
        assert 0 < handles[1].reused_tokens < handles[0].cached_tokens  # the system message
    assert retained(store_root) == {h.ref for h in handles}
    with LocalCacheController(backend, store_root) as ctl:  # the next process
        for d, h in zip(DOCS, handles, strict=True):
            again = ctl.prepare(params(d))
            assert (again.source, again.ref, again.written_tokens) == ("disk", h.ref, 0)
            r = ctl.generate(again, QUESTION, NEW)
            assert r.usage.cache_disk_tokens == h.cached_tokens
            assert r.tokens == cold(ctl, params(d))


def test_a_held_base_serves_its_holder_until_released_then_is_superseded(backend, store_root):
    """A longer conversation that strictly extends a base supersedes it, but a request
    still holding the base keeps reading it; the base is released once nobody holds it."""
    base_p, long_p = params(DOCS[0]), params(DOCS[0], DOCS[1])
    with LocalCacheController(backend, store_root, memory_entries=1) as ctl:
        held = ctl.prepare(base_p)
        ctl.generate(held, QUESTION, NEW)  # reports the cold prepare's own work
        longer = ctl.prepare(long_p)
        assert longer.source == "incremental" and longer.supersedes == held.ref
        assert longer.reused_tokens == held.cached_tokens
        assert ctl.store.row(held.ref).hint == "retain"  # held: not released yet
        r = ctl.generate(held, QUESTION, NEW)  # memory holds only `longer`: read from disk
        assert r.usage.cache_disk_tokens == held.cached_tokens > 0
        assert r.tokens == cold(ctl, base_p)
        ref = held.ref
        del held, r
        gc.collect()
        ctl.prepare(long_p)  # any later call settles what nobody holds any more
        assert ctl.store.row(ref).hint == "release"
    assert retained(store_root) == {longer.ref}
    with Store.open(store_root) as s:
        assert s.row(ref) is None  # close deleted the superseded base


# -- item 4: normal prompt drift is a miss of its own kind, not damage ---------------------


def test_a_template_that_renders_the_date_moves_the_prefix_without_quarantine(
        dated_backend, store_root, today):
    p = params(DOCS[0])
    with LocalCacheController(dated_backend, store_root) as ctl:
        monday = ctl.prepare(p)
        assert monday.source == "cold"
        assert "01 Dec 2026" in ctl.backend.decode(ctl.prefix_tokens(p))
    today["now"] = dt.datetime(2026, 12, 2, 9, 0)  # the next morning
    with LocalCacheController(dated_backend, store_root) as ctl:
        tuesday = ctl.prepare(p)
        assert ctl.store.quarantine_items() == []  # nothing damaged, no operator alarm
        assert tuesday.ref != monday.ref and tuesday.source in ("cold", "incremental")
        assert "02 Dec 2026" in ctl.backend.decode(ctl.prefix_tokens(p))
        assert ctl.stats()["prefix_moved"] == 1 and ctl.stats()["load_failures"] == 0
        r = ctl.generate(tuesday, QUESTION, NEW)
        assert r.tokens == cold(ctl, p)
    with LocalCacheController(dated_backend, store_root) as ctl:  # later that day
        again = ctl.prepare(p)
        assert (again.source, again.ref) == ("disk", tuesday.ref)
        assert ctl.stats()["prefix_moved"] == 0
        assert ctl.store.quarantine_items() == []


# -- item 6: an import cannot quietly poison a shared store --------------------------------


def test_an_import_of_another_token_anywhere_is_refused_by_default(backend, store_root):
    """The cache of "Valve 3 is shut." offered as the cache of "Valve 4 is shut." (same
    length, one token apart, at a position four sampled checks do not look at)."""
    from spoolctl.store import ConfigError

    true_p, claimed_p = params("Valve 3 is shut."), params("Valve 4 is shut.")
    with LocalCacheController(backend, store_root) as ctl:
        true_ids, claimed = ctl.prefix_tokens(true_p), ctl.prefix_tokens(claimed_p)
        assert len(true_ids) == len(claimed)
        changed = [i for i, (a, b) in enumerate(zip(true_ids, claimed, strict=True)) if a != b]
        n = len(claimed)
        assert changed and not set(changed) & {0, n // 3, (2 * n) // 3, n - 1}
        poisoned = ctl.backend.prefill(ctl.backend.new_cache(), true_ids)
        with pytest.raises(ConfigError, match=f"position {changed[0]} of the cache"):
            ctl.import_cache(claimed_p, poisoned)
        assert ctl.store.entries() == []  # nothing written
        # The explicit opt-out is the old sampling, which a token change elsewhere passes.
        assert ctl.import_cache(claimed_p, poisoned, check="sample").source == "import"
        with pytest.raises(ConfigError, match="check must be one of full, sample"):
            ctl.import_cache(claimed_p, poisoned, check="none")
    fresh = store_root.parent / "fresh"
    with LocalCacheController(backend, fresh) as ctl:  # a true cache passes the full check
        own = ctl.backend.prefill(ctl.backend.new_cache(), claimed)
        h = ctl.import_cache(claimed_p, own)
        assert h.source == "import" and h.written_tokens == n
        assert ctl.generate(h, QUESTION, NEW).tokens == cold(ctl, claimed_p)


# -- item 1 (controllers): the weights bind the entry --------------------------------------


def replace_weights(model_dir: Path) -> None:
    """A new fine-tune deployed in place: same files, same config, other weights."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name in tensors:
        if name.endswith(("k_proj.weight", "v_proj.weight", "lm_head.weight")):
            tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("framework", ["pytorch", "mlx"])
def test_weights_replaced_at_the_same_path_are_a_cold_correct_prepare(
        framework, tiny_model_dir, tmp_path, store_root):
    model = tmp_path / "deployed"
    shutil.copytree(tiny_model_dir, model)
    p = params(DOCS[0])
    with LocalCacheController(make_backend(framework, model), store_root) as ctl:
        old = ctl.prepare(p)
        old_tokens = ctl.generate(old, QUESTION, NEW).tokens
    with LocalCacheController(make_backend(framework, model), store_root) as ctl:  # unchanged
        assert ctl.prepare(p).source == "disk"
    replace_weights(model)
    with LocalCacheController(make_backend(framework, model), store_root) as ctl:
        new = ctl.prepare(p)
        assert new.source == "cold" and new.ref != old.ref and new.reused_tokens == 0
        r = ctl.generate(new, QUESTION, NEW)
        assert r.tokens == cold(ctl, p) != old_tokens


# -- item 7: names and defaults that mislead -----------------------------------------------


@pytest.fixture(scope="module")
def torch_backend(tiny_model_dir):
    return make_backend("pytorch", tiny_model_dir)


def test_a_revision_name_never_turns_change_detection_off(tiny_model_dir, tmp_path,
                                                          store_root):
    from spoolctl.controllers.pytorch import PyTorchBackend

    model = tmp_path / "deployed"
    shutil.copytree(tiny_model_dir, model)
    p = params(DOCS[0])
    before = PyTorchBackend(model, revision="main")
    assert before.identity()["revision"].startswith("blake3:")
    assert before.identity()["revision_name"] == "main"
    with LocalCacheController(before, store_root) as ctl:
        old = ctl.prepare(p)
    replace_weights(model)
    with LocalCacheController(PyTorchBackend(model, revision="main"), store_root) as ctl:
        new = ctl.prepare(p)
        assert new.source == "cold" and new.ref != old.ref
        assert ctl.generate(new, QUESTION, NEW).tokens == cold(ctl, p)
    # Skipping the hash is an explicit, differently named promise.
    trusted = PyTorchBackend(model, trusted_revision="ft-2026-12-01")
    assert trusted.identity()["revision"] == "trusted:ft-2026-12-01"


def test_the_dtype_follows_the_checkpoint_like_transformers(tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spoolctl.controllers.pytorch import PyTorchBackend

    model = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(torch.bfloat16).save_pretrained(model)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(model)
    reference = AutoModelForCausalLM.from_pretrained(model)
    backend = PyTorchBackend(model)
    assert backend.dtype == next(reference.parameters()).dtype == torch.bfloat16
    assert PyTorchBackend(model, dtype="float32").dtype == torch.float32


def _rng_state(framework: str):
    if framework == "pytorch":
        import torch

        return torch.get_rng_state().tolist()
    import mlx.core as mx

    return [s.tolist() for s in mx.random.state]


def test_seeded_sampling_uses_a_generator_of_its_own(backend, store_root):
    """seed=0 in two threads at once gives what seed=0 gives serially, and never touches
    the framework's global generator."""
    import threading

    framework = "pytorch" if backend.kind == "pytorch" else "mlx"
    p = params(DOCS[0])
    sample = {"temperature": 5.0, "seed": 0}
    with LocalCacheController(backend, store_root) as ctl:
        h = ctl.prepare(p)
        before = _rng_state(framework)
        serial = ctl.generate(h, QUESTION, 16, **sample).tokens
        assert _rng_state(framework) == before
        assert ctl.generate(h, QUESTION, 16, **sample).tokens == serial
        assert ctl.generate(h, QUESTION, 16, temperature=5.0, seed=1).tokens != serial
        out: list[list[int]] = []
        barrier = threading.Barrier(2)

        def run() -> None:
            barrier.wait()
            out.append(ctl.generate(h, QUESTION, 16, **sample).tokens)

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert out == [serial, serial]


def test_a_store_a_controller_creates_is_bounded_and_its_limit_has_one_owner(
        torch_backend, store_root):
    from spoolctl.controllers.local.engine import default_max_bytes
    from spoolctl.store import ConfigError

    with LocalCacheController(torch_backend, store_root) as ctl:
        assert ctl.store.max_bytes == default_max_bytes(store_root) is not None
        limit = ctl.store.max_bytes
    with pytest.raises(ConfigError, match="size limit") as err:
        LocalCacheController(torch_backend, store_root, max_bytes=limit // 2)
    assert str(store_root) in str(err.value) and "spoolctl init" in str(err.value)
    with Store.open(store_root) as s:
        assert s.max_bytes == limit  # nothing rewritten
    with LocalCacheController(torch_backend, store_root, max_bytes=limit) as ctl:
        assert ctl.store.max_bytes == limit
    for bad in (0, -5, True, "1GiB"):  # refused before a directory or marker exists
        with pytest.raises(ConfigError, match="max_bytes must be a positive number"):
            LocalCacheController(torch_backend, store_root.parent / "bad", max_bytes=bad)
        assert not (store_root.parent / "bad").exists()
    other = store_root.parent / "explicit"
    with LocalCacheController(torch_backend, other, max_bytes=64 << 20) as ctl:
        assert ctl.store.max_bytes == 64 << 20
    with LocalCacheController(torch_backend, other) as ctl:  # a worker leaving it out
        assert ctl.store.max_bytes == 64 << 20
