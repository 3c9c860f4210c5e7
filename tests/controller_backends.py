"""The local controllers' backends of a locally generated model, by framework name, for the
tests that run the same check on PyTorch and MLX; a backend wrapper that counts prefills, and
the cold-run reference every controller test compares tokens with."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

FRAMEWORKS = ["pytorch", "mlx"]


def make_backend(name: str, model_dir: Path):
    """A ``PyTorchBackend`` or ``MlxBackend`` of ``model_dir``; MLX is skipped with the reason
    where mlx-lm is not installed."""
    if name == "pytorch":
        from spoolctl.controllers.pytorch import PyTorchBackend

        return PyTorchBackend(model_dir)
    pytest.importorskip("mlx.core", reason="mlx is not installed here; pip install 'mlx-lm[cpu]'")
    from spoolctl.controllers.mlx import MlxBackend

    return MlxBackend(model_dir)


class Counting:
    """Counts (and optionally slows) real prefills of a backend; everything else delegates."""

    def __init__(self, backend, delay: float = 0.0):
        self._b = backend
        self.delay = delay
        self.prefills: list[int] = []
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._b, name)

    @property
    def kind(self) -> str:
        return self._b.kind

    def prefill(self, cache, tokens):
        with self._lock:
            self.prefills.append(len(tokens))
        time.sleep(self.delay)
        return self._b.prefill(cache, tokens)


def prompt_ids(backend, params, prompt: str) -> list[int]:
    """The token ids of ``params`` rendered whole (volatile parts too) followed by ``prompt``."""
    from spoolctl.controllers import render_segments

    return [t for s in backend.tokenize_segments([*render_segments(params), prompt]) for t in s]


def cold_tokens(backend, params, prompt: str, n: int) -> list[int]:
    """Reference: ``n`` greedy tokens of the whole prompt with no cache at all."""
    return backend.generate(None, 0, prompt_ids(backend, params, prompt), n)
