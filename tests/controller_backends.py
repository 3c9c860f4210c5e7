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


def make_mlx_adapter(path: Path, seed: int) -> Path:
    """An adapter directory mlx-lm loads (``adapter_config.json`` + ``adapters.safetensors``)
    for the tiny model: rank-4 LoRA on the q/v projections of both layers, random nonzero
    weights from ``seed``."""
    import json

    import mlx.core as mx

    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": 2,
        "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0,
                            "keys": ["self_attn.q_proj", "self_attn.v_proj"]}}))
    key = mx.random.key(seed)
    weights = {}
    for layer in range(2):
        for proj, out in (("q_proj", 128), ("v_proj", 64)):
            key, ka, kb = mx.random.split(key, 3)
            stem = f"model.layers.{layer}.self_attn.{proj}"
            weights[f"{stem}.lora_a"] = mx.random.normal((128, 4), key=ka) * 0.5
            weights[f"{stem}.lora_b"] = mx.random.normal((4, out), key=kb) * 0.5
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    return path


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
