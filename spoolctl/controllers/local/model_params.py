"""The params a local controller runs: its model spelled one way, read-only where the
controller is.

``params.model`` is normalised to the controller's ``model_id``: any spelling of the model
directory's path (trailing slashes, ``~``, symlinks, relative paths) is the same key, and
another model is a ConfigError. A read-only controller makes every call ``read_only``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from spoolctl.store import ConfigError

from ..contract import CachePrepareParams


def normalize_params(params: Any, *, model_id: str, model_path: str | os.PathLike[str] | None,
                     read_only: bool) -> CachePrepareParams:
    """``params`` for a controller of ``model_id`` (its model directory ``model_path``):
    its model spelled as ``model_id`` (another model is refused), ``read_only`` forced on a
    read-only controller."""
    if not isinstance(params, CachePrepareParams):
        raise ConfigError(f"expected CachePrepareParams, not {type(params).__name__}",
                          fix="build CachePrepareParams(instructions=[...], data=[...])")
    changes: dict[str, Any] = {}
    if params.model != model_id:
        if params.model is not None and not same_model(params.model, model_path):
            raise ConfigError(
                f"params.model {params.model!r} is not the model this controller runs "
                f"({model_id})", fix=f"pass model={model_id!r}, the model's directory, "
                                     "or leave model out")
        changes["model"] = model_id
    if read_only and not params.read_only:
        changes["read_only"] = True
    return dataclasses.replace(params, **changes) if changes else params


def same_model(name: str, model_path: str | os.PathLike[str] | None) -> bool:
    """Whether ``name`` is a path that resolves to the model directory ``model_path``."""
    if model_path is None:
        return False
    try:
        return os.path.realpath(os.path.expanduser(name)) == os.path.realpath(model_path)
    except (OSError, ValueError):
        return False
