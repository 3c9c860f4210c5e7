"""Shared prompts and helpers of the cache-family tests
(tests/controllers/test_pytorch_families.py, tests/controllers/test_mlx_families.py): one system
prompt, documents, their near misses, a cold run of a backend to compare tokens with, and the
checks both frameworks' controllers must pass (``check_*``: ``make(backend, root)`` builds the
framework's controller)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spoolctl.controllers import CachePrepareParams, render_segments

FAMILIES = ("sliding", "hybrid", "ssm")
SYSTEM = "You are a helpful assistant. Answer using the reference documents below."
DOC1 = "Manual, part one: the pump starts when the valve is open and the tank is full. " * 2
DOC1_NEAR = DOC1[:-6] + "empty. "  # differs in the last words only
SYSTEM_NEAR = SYSTEM[:-6] + "above."
DOC2 = "Manual, part two: never run the pump dry; check the seal every month."
QUESTION = "Question: when does the pump start?"
SEEDED = {"temperature": 0.9, "top_k": 40, "seed": 7}


def params(model: str, *data: str) -> CachePrepareParams:
    return CachePrepareParams(model=model, instructions=[SYSTEM], data=list(data))


def cold(backend: Any, *data: str, system: str = SYSTEM, **sampling: Any) -> list[int]:
    """Eight tokens of a cold run of ``backend`` (no cache at all) on ``system`` + ``data``
    + QUESTION; ``sampling``: ``Decoding`` fields (greedy without them)."""
    from spoolctl.controllers.local.decoding import Decoding

    p = CachePrepareParams(model="m", instructions=[system], data=list(data))
    ids = [t for s in backend.tokenize_segments([*render_segments(p), QUESTION]) for t in s]
    return backend.generate(None, 0, ids, 8, Decoding(**sampling)) if sampling \
        else backend.generate(None, 0, ids, 8)


def spoolctl_warnings(caplog: Any) -> list[str]:
    """Warnings (and worse) spoolctl logged during the test."""
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("spoolctl")]


def check_extension_rule(make: Callable[[Any, Path], Any], b: Any, family: str, root: Path,
                         caplog: Any) -> None:
    """A stored state is only ever extended, never cut back: instructions + doc1 grows to
    + doc2 from the doc1 entry; a near miss inside doc1, or a prompt that stops inside it,
    reuses exactly the instructions snapshot (decision 2602) and no more; a near miss inside
    the instructions runs cold. Tokens equal a cold run each time, and no base that would
    need cutting back is even read (no warning)."""
    with make(b, root) as ctl:
        base = ctl.prepare(params(family, DOC1))
        head = len(ctl.prefix_tokens(CachePrepareParams(model=family, instructions=[SYSTEM])))
    with make(b, root) as ctl:
        ext = ctl.prepare(params(family, DOC1, DOC2))
        assert_near_miss(b, ext, base.cached_tokens)
        assert ctl.generate(ext, QUESTION, 8).tokens == cold(b, DOC1, DOC2)
    half = DOC1[: len(DOC1) // 2]
    with make(b, root) as ctl, caplog.at_level(logging.WARNING):
        for data in (DOC1_NEAR, half):
            h = ctl.prepare(params(family, data))
            assert head > 0
            assert_near_miss(b, h, head)
            assert ctl.generate(h, QUESTION, 8).tokens == cold(b, data)
        near = ctl.prepare(CachePrepareParams(model=family, instructions=[SYSTEM_NEAR],
                                              data=[DOC1]))
        assert near.source == "cold" and near.reused_tokens == 0
        assert ctl.generate(near, QUESTION, 8).tokens == cold(b, DOC1, system=SYSTEM_NEAR)
    assert spoolctl_warnings(caplog) == []


def recomputes(b: Any, held: int, new: int) -> bool:
    """Whether backend ``b`` estimates a cold prefill cheaper than extending ``held`` tokens
    by ``new`` (a model continued one token per forward)."""
    rule = getattr(b, "recompute_cheaper", None)
    return bool(rule(held, new)) if callable(rule) else False


def assert_near_miss(b: Any, h: Any, held: int) -> None:
    """Handle ``h`` of a prompt that extends a stored ``held``-token state: it extended that
    state, or (where the backend says so) recomputed the whole prefix cold."""
    if recomputes(b, held, h.cached_tokens - held):
        assert (h.source, h.reused_tokens, h.computed_tokens) == \
            ("cold", 0, h.cached_tokens), h
    else:
        assert (h.source, h.reused_tokens, h.computed_tokens) == \
            ("incremental", held, h.cached_tokens - held), h


def check_instructions_snapshot(make: Callable[[Any, Path], Any], b: Any, family: str,
                                root: Path) -> None:
    """The app shape "one system prompt, many documents" hits for caches that cannot be
    cut back: the first cold prefill also stores the instructions' state, every later
    document extends it (and never supersedes it), tokens equal a cold run."""
    with make(b, root) as ctl:
        first = ctl.prepare(params(family, DOC1))
        head = len(ctl.prefix_tokens(CachePrepareParams(model=family, instructions=[SYSTEM])))
    assert first.source == "cold"
    for doc in (DOC2, DOC1_NEAR):
        with make(b, root) as ctl:  # fresh memory: the snapshot comes from disk
            h = ctl.prepare(params(family, doc))
            assert head > 0
            assert_near_miss(b, h, head)
            assert h.supersedes is None
            assert ctl.generate(h, QUESTION, 8).tokens == cold(b, doc)
