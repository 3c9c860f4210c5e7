"""The local controllers' backends of a locally generated model, by framework name, for the
tests that run the same check on PyTorch and MLX."""

from __future__ import annotations

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
