"""What a local cache entry means (issue 29), for both local controllers, with real
transformers + torch and real mlx-lm on the locally built tiny Llama.

* Supersession: only an entry the new one strictly extends is superseded, and only once
  no live handle holds it; siblings under one system message coexist (decision 2100).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from spoolctl.controllers import CachePrepareParams, Element, LocalCacheController
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
    if request.param == "pytorch":
        from spoolctl.controllers.pytorch import PyTorchBackend

        return PyTorchBackend(tiny_model_dir)
    pytest.importorskip("mlx.core", reason="mlx-lm is not installed here")
    from spoolctl.controllers.mlx import MlxBackend

    return MlxBackend(tiny_model_dir)


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
