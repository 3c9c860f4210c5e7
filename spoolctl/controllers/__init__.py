"""Prompt-cache controllers: the contract, the shared local engine and its backends.

Importing this package imports no framework; backends import theirs lazily::

    from spoolctl.controllers import CachePrepareParams, open_local_controller
    with open_local_controller("pytorch", "/models/llama", root="/var/cache/spool") as ctl:
        handle = ctl.prepare(CachePrepareParams(model="/models/llama", instructions=[doc]))
        result = ctl.generate(handle, "Question: ...", max_new_tokens=64)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spoolctl.store.errors import ConfigError

from .contract import (
    CacheHandle,
    CachePrepareParams,
    Element,
    Includes,
    PromptCacheController,
    ToolDefinition,
    Usage,
    render_segments,
)
from .local import GenerateResult, KVBackend, LocalCacheController

BACKENDS = ("pytorch", "mlx")


def load_backend(name: str, model: str | Path, **options: Any) -> KVBackend:
    """Load the ``name`` backend ("pytorch" | "mlx") for the model directory ``model``."""
    if name == "pytorch":
        from .pytorch import PyTorchBackend

        return PyTorchBackend(model, **options)
    if name == "mlx":
        from . import mlx as mlx_backend

        return mlx_backend.MlxBackend(model, **options)
    raise ConfigError(f"unknown backend {name!r}", fix=f"use one of: {', '.join(BACKENDS)}")


def open_local_controller(
    backend: str, model: str | Path, root: str | Path | None = None, **options: Any
) -> LocalCacheController:
    """A LocalCacheController for ``backend`` on ``model``; ``root=None`` = managed temp store."""
    return LocalCacheController(load_backend(backend, model), root, **options)


_LAZY = {"PyTorchCacheController": ".pytorch", "PyTorchBackend": ".pytorch",
         "MlxCacheController": ".mlx", "MlxBackend": ".mlx"}


def __getattr__(name: str) -> Any:
    # Framework-backed classes load their framework only when first asked for.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "CacheHandle",
    "CachePrepareParams",
    "Element",
    "GenerateResult",
    "Includes",
    "KVBackend",
    "LocalCacheController",
    "PromptCacheController",
    "ToolDefinition",
    "Usage",
    "load_backend",
    "open_local_controller",
    "render_segments",
]
