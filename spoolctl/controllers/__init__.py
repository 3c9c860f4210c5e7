"""Prompt-cache controllers: the contract, the shared local engine and its backends.

Importing this package imports no framework. Every controller is importable from
here; the framework-backed ones load their module on first access (PEP 562), and
their framework only when one is built::

    from spoolctl.controllers import CachePrepareParams, open_local_controller
    with open_local_controller("pytorch", "/models/llama", root="/var/cache/spool") as ctl:
        handle = ctl.prepare(CachePrepareParams(instructions=[doc]))  # the controller's model
        result = ctl.generate(handle, "Question: ...", max_new_tokens=64)
        print(result.usage.to_json())  # read from memory / disk, computed, written

| name | module | extra |
|---|---|---|
| ``PyTorchCacheController``, ``PyTorchBackend`` | ``pytorch`` | ``spoolctl[torch]`` |
| ``MlxCacheController``, ``MlxBackend`` | ``mlx`` | ``spoolctl[mlx]`` |
| ``MlxVlmCacheController``, ``MlxVlmBackend`` | ``mlx.vlm`` | ``spoolctl[vlm]`` |
| ``GoogleGenAICacheController`` | ``genai`` | ``spoolctl[genai]`` |

A name whose module cannot be imported (google-genai is imported with its module)
raises ImportError naming the extra to install; the others raise ConfigError naming
it when a backend is built without its framework. ``__all__`` lists only the eagerly
imported names, so ``from spoolctl.controllers import *`` works on a base install.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spoolctl.errors import ConfigError

from .contract import (
    CacheHandle,
    CachePrepareParams,
    Element,
    GenerateResult,
    ImageInput,
    Includes,
    KVBackend,
    PromptCacheController,
    ToolDefinition,
    Usage,
    render_segments,
)
from .local.decoding import Decoding
from .local.engine import LocalCacheController
from .local.use import Restored

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ resolves them
    from .genai.controller import GoogleGenAICacheController  # noqa: F401
    from .mlx import MlxBackend, MlxCacheController  # noqa: F401
    from .mlx.vlm import MlxVlmBackend, MlxVlmCacheController  # noqa: F401
    from .pytorch import PyTorchBackend, PyTorchCacheController  # noqa: F401

BACKENDS = ("pytorch", "mlx")

#: Lazily loaded names: (module, the extra that installs its framework).
_LAZY: dict[str, tuple[str, str]] = {
    "PyTorchCacheController": (".pytorch", "torch"),
    "PyTorchBackend": (".pytorch", "torch"),
    "MlxCacheController": (".mlx", "mlx"),
    "MlxBackend": (".mlx", "mlx"),
    "MlxVlmCacheController": (".mlx.vlm", "vlm"),
    "MlxVlmBackend": (".mlx.vlm", "vlm"),
    "GoogleGenAICacheController": (".genai.controller", "genai"),
}


def __getattr__(name: str) -> Any:
    # Framework-backed classes load their module only when first asked for.
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, extra = _LAZY[name]
    try:
        loaded = importlib.import_module(module, __name__)
    except ImportError as exc:
        raise ImportError(f"{name} needs a framework that is not installed ({exc}): "
                          f"pip install 'spoolctl[{extra}]'", name=exc.name) from exc
    return getattr(loaded, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


def load_backend(name: str, model: str | Path, **options: Any) -> KVBackend:
    """Load the ``name`` backend ("pytorch" | "mlx") for the model directory ``model``."""
    if name == "pytorch":
        from .pytorch import PyTorchBackend

        return PyTorchBackend(model, **options)
    if name == "mlx":
        from .mlx import MlxBackend

        return MlxBackend(model, **options)
    raise ConfigError(f"unknown backend {name!r}", fix=f"use one of: {', '.join(BACKENDS)}")


def open_local_controller(
    backend: str, model: str | Path, root: str | Path | None = None, **options: Any
) -> LocalCacheController:
    """A LocalCacheController for ``backend`` on ``model``; ``root=None`` = managed temp store."""
    return LocalCacheController(load_backend(backend, model), root, **options)


__all__ = [
    "BACKENDS",
    "CacheHandle",
    "CachePrepareParams",
    "Decoding",
    "Element",
    "GenerateResult",
    "ImageInput",
    "Includes",
    "KVBackend",
    "LocalCacheController",
    "PromptCacheController",
    "Restored",
    "ToolDefinition",
    "Usage",
    "load_backend",
    "open_local_controller",
    "render_segments",
]
