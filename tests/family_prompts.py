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
from spoolctl.controllers.local.plan_rules import checkpoint_ladder

FAMILIES = ("sliding", "hybrid", "ssm")
SYSTEM = "You are a helpful assistant. Answer using the reference documents below."
DOC1 = "Manual, part one: the pump starts when the valve is open and the tank is full. " * 2
DOC1_NEAR = DOC1[:-6] + "empty. "  # differs in the last words only
SYSTEM_NEAR = SYSTEM[:-6] + "above."
DOC2 = "Manual, part two: never run the pump dry; check the seal every month."
QUESTION = "Question: when does the pump start?"
SEEDED = {"temperature": 0.9, "top_k": 40, "seed": 7}
MORE = "Then it runs until the tank is low."  # appended inside a document's own message
#: A document past the first doubling checkpoint (256 ids with the instructions).
LONG = DOC1 * 4


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


def shared_ids(a: list[int], b: list[int]) -> int:
    """Leading token ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def expected_reuse(b: Any, stored: list[int], head: int, shared: int) -> int:
    """What a prompt sharing ``shared`` leading ids with the stored instructions + one
    document (``stored``, instructions ``head`` ids long) reuses: all of them where the cache
    can be cut back; else the nearest stored state at or before them -- the instructions
    snapshot (also the start of the last segment), the doubling checkpoints (not for a
    model that continues one id per forward) or the whole entry."""
    if getattr(b, "trimmable", True):
        return shared
    points = {head, len(stored)}
    if not getattr(b, "extends_by_token", False):
        points |= set(checkpoint_ladder(len(stored)))
    return max((p for p in points if p <= shared), default=0)


def check_common_prefix_rule(make: Callable[[Any, Path], Any], b: Any, model: str,
                             root: Path) -> None:
    """Instructions + LONG stored; then (a) a prompt that stops inside LONG and (b) one that
    extends LONG inside its own message, each against a fresh store holding only that entry
    and read by a fresh controller (bases from disk): it reuses ``expected_reuse`` ids (the
    handle and the usage say so), computes only the rest, never supersedes the base, and
    its greedy tokens equal a cold run."""
    for case, data in enumerate((LONG[: len(LONG) * 9 // 10], LONG + MORE)):
        store = root.with_name(f"{root.name}-{case}")
        with make(b, store) as ctl:
            stored = ctl.prefix_tokens(params(model, LONG))
            head = len(ctl.prefix_tokens(CachePrepareParams(model=model, instructions=[SYSTEM])))
            ctl.prepare(params(model, LONG))
        with make(b, store) as ctl:
            ours = ctl.prefix_tokens(params(model, data))
            shared = shared_ids(stored, ours)
            assert head < shared < len(stored)
            if not getattr(b, "trimmable", True):  # past the first doubling checkpoint
                assert checkpoint_ladder(len(stored))[0] < shared
            want = expected_reuse(b, stored, head, shared)
            h = ctl.prepare(params(model, data))
            assert h.supersedes is None
            assert_near_miss(b, h, want)  # or recomputed, where that is cheaper
            r = ctl.generate(h, QUESTION, 8)
            assert r.usage.cache_read_tokens == h.reused_tokens
            assert r.tokens == cold(b, data)


def spoolctl_warnings(caplog: Any) -> list[str]:
    """Warnings (and worse) spoolctl logged during the test."""
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("spoolctl")]


def check_extension_rule(make: Callable[[Any, Path], Any], b: Any, family: str, root: Path,
                         caplog: Any) -> None:
    """A stored state is only ever extended, never cut back: instructions + doc1 grows to
    + doc2 from the doc1 entry; a near miss inside doc1, or a prompt that stops inside it,
    reuses exactly the nearest stored state before the ids it shares (a checkpoint, or the
    instructions snapshot) and no more; a near miss inside the instructions runs cold.
    Tokens equal a cold run each time, and no base that would need cutting back is even
    read (no warning)."""
    with make(b, root) as ctl:
        base = ctl.prepare(params(family, DOC1))
        stored = ctl.prefix_tokens(params(family, DOC1))
        head = len(ctl.prefix_tokens(CachePrepareParams(model=family, instructions=[SYSTEM])))
    with make(b, root) as ctl:
        ext = ctl.prepare(params(family, DOC1, DOC2))
        assert_near_miss(b, ext, base.cached_tokens)
        assert ctl.generate(ext, QUESTION, 8).tokens == cold(b, DOC1, DOC2)
    half = DOC1[: len(DOC1) // 2]
    with make(b, root) as ctl, caplog.at_level(logging.WARNING):
        for data in (DOC1_NEAR, half):
            want = expected_reuse(b, stored, head,
                                  shared_ids(stored, ctl.prefix_tokens(params(family, data))))
            h = ctl.prepare(params(family, data))
            assert want >= head > 0
            assert_near_miss(b, h, want)
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
    document extends it or a later checkpoint it shares (and never supersedes it), tokens
    equal a cold run."""
    with make(b, root) as ctl:
        first = ctl.prepare(params(family, DOC1))
        stored = ctl.prefix_tokens(params(family, DOC1))
        head = len(ctl.prefix_tokens(CachePrepareParams(model=family, instructions=[SYSTEM])))
    assert first.source == "cold"
    for doc in (DOC2, DOC1_NEAR):
        with make(b, root) as ctl:  # fresh memory: the snapshot comes from disk
            want = expected_reuse(b, stored, head,
                                  shared_ids(stored, ctl.prefix_tokens(params(family, doc))))
            h = ctl.prepare(params(family, doc))
            assert want >= head > 0
            assert_near_miss(b, h, want)
            assert h.supersedes is None
            assert ctl.generate(h, QUESTION, 8).tokens == cold(b, doc)
