"""Near misses on every cache family: a prompt that extends a stored prefix (by a message,
or inside one: the instructions snapshot is the base) gives the greedy tokens of a cold run,
by the cheaper of two paths the handle names -- the stored state extended in chunks
(``incremental``), or, for a model whose multi-token forward cannot continue a state
(transformers' Mamba), the whole prefix recomputed in one forward (``cold``) instead of
one forward per new token.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from controller_backends import cold_tokens
from family_prompts import DOC1, DOC1_NEAR, DOC2, FAMILIES, QUESTION, SYSTEM, cold, params

from spoolctl.controllers import CachePrepareParams
from spoolctl.controllers.pytorch import PyTorchBackend, PyTorchCacheController

#: How each framework's controller continues a near miss, per family.
PATHS = {"pytorch": {"sliding": "incremental", "hybrid": "incremental", "ssm": "cold"},
         "mlx": {"sliding": "incremental", "hybrid": "incremental", "ssm": "incremental"}}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    from spoolctl.demo.tinyfamilies import build_family_model

    root = tmp_path_factory.mktemp("nearmiss-families")
    return {f: build_family_model(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def torch_backends(family_dirs) -> dict[str, PyTorchBackend]:
    return {f: PyTorchBackend(d, model_id=f) for f, d in family_dirs.items()}


def _mlx_backends(family_dirs):
    pytest.importorskip("mlx.core", reason="mlx is not installed here; pip install 'mlx-lm[cpu]'")
    from spoolctl.controllers.mlx import MlxBackend, MlxCacheController

    return MlxCacheController, {f: MlxBackend(d, model_id=f) for f, d in family_dirs.items()}


def _check_near_misses(make, b, family: str, root, path: str) -> None:
    """DOC1 stored; DOC1 + DOC2 (one more message) and DOC1_NEAR (a change inside the
    message: the instructions snapshot is the base) each take ``path`` and give the tokens
    of a cold run; the handle counts the tokens honestly."""
    with make(b, root) as ctl:
        base = ctl.prepare(params(family, DOC1))
        head = len(ctl.prefix_tokens(CachePrepareParams(model=family, instructions=[SYSTEM])))
    assert base.source == "cold" and head > 0
    for data, held in (((DOC1, DOC2), base.cached_tokens), ((DOC1_NEAR,), head)):
        with make(b, root) as ctl:  # fresh memory: the base comes from disk
            h = ctl.prepare(params(family, *data))
            assert h.source == path, h
            if path == "cold":
                assert (h.reused_tokens, h.computed_tokens) == (0, h.cached_tokens)
            else:
                assert (h.reused_tokens, h.computed_tokens) == (held, h.cached_tokens - held)
            assert ctl.generate(h, QUESTION, 8).tokens == cold(b, *data)


@pytest.mark.parametrize("family", FAMILIES)
def test_pytorch_near_miss_gives_cold_tokens_by_the_cheaper_path(torch_backends, family,
                                                                 store_root):
    _check_near_misses(PyTorchCacheController, torch_backends[family], family, store_root,
                       PATHS["pytorch"][family])


@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_near_miss_gives_cold_tokens_by_the_cheaper_path(family_dirs, family, store_root):
    controller, backends = _mlx_backends(family_dirs)
    _check_near_misses(controller, backends[family], family, store_root,
                       PATHS["mlx"][family])


@pytest.mark.parametrize("instructions", [[], [SYSTEM]], ids=["plain", "snapshot"])
def test_a_token_by_token_model_recomputes_a_near_miss_in_one_forward(torch_backends,
                                                                     store_root, instructions):
    """The Mamba continues a state one token per forward: extending the stored DOC1 state
    (or the stored instructions snapshot) by the rest would run one model forward per new
    token; the prepare runs exactly one forward (the whole prefix, cold), reads no base,
    and says so; its tokens equal a cold run."""
    b = torch_backends["ssm"]
    assert b.extends_by_token
    p = CachePrepareParams(model="ssm", instructions=instructions, data=[DOC1])
    q = CachePrepareParams(model="ssm", instructions=instructions, data=[DOC1, DOC2])
    with PyTorchCacheController(b, store_root) as ctl:
        held = ctl.prepare(p).cached_tokens
    calls: list[int] = []
    hook = b.model.register_forward_hook(lambda m, args, kw, out: calls.append(1),
                                         with_kwargs=True)
    try:
        with PyTorchCacheController(b, store_root) as ctl:
            h = ctl.prepare(q)
            forwards = len(calls)
            out = ctl.generate(h, QUESTION, 8)
            stats = ctl.stats()
    finally:
        hook.remove()
    assert h.cached_tokens - held > 1
    assert forwards == 1
    assert (h.source, h.reused_tokens, h.computed_tokens) == ("cold", 0, h.cached_tokens)
    assert out.usage.cache_disk_tokens == out.usage.cache_memory_tokens == 0
    assert stats["cold_prefills"] == 1 and stats["incremental_prefills"] == 0
    assert out.tokens == cold_tokens(b, q, QUESTION, 8)


def test_the_cost_rule_extends_a_few_tokens_and_recomputes_many(torch_backends):
    """A model continued one token per forward extends a stored state by a token or two
    (fewer forwards than a cold prefill's cost) and recomputes anything longer; a model
    that resumes in chunks always extends."""
    ssm = torch_backends["ssm"]
    assert not ssm.recompute_cheaper(4096, 1)
    assert ssm.recompute_cheaper(100, 50) and ssm.recompute_cheaper(4096, 20)
    assert ssm.forward_passes(100, 50) == 50 and ssm.forward_passes(0, 150) == 1
    for family in ("sliding", "hybrid"):
        b = torch_backends[family]
        assert not b.extends_by_token
        assert not b.recompute_cheaper(10, 5000) and not b.recompute_cheaper(100, 50)
        assert b.forward_passes(100, 1025) == -(-1025 // b.prefill_chunk)
