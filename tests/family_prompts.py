"""Shared prompts and helpers of the cache-family tests (tests/test_pytorch_families.py,
tests/test_mlx_families.py): one system prompt, documents, their near misses, and a cold
run of a backend to compare tokens with."""

from __future__ import annotations

import logging
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
