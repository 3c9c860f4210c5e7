"""mlx-lm prompt-cache files (``save_prompt_cache`` / ``load_prompt_cache``) for interop:
``MlxBackend.save_file`` / ``load_file``.

A file written here records the token ids it covers (``TOKENS_META``); a file without them
loads too (the caller then gives the tokens). The name must end in ``.safetensors`` (mlx
picks the format from the suffix). A missing or unreadable file is one ConfigError line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spoolctl.errors import ConfigError

from ..local.mlx_format import PromptCache
from .runtime import MlxRuntime

#: Metadata key of exported files: the token ids the cache covers (JSON).
TOKENS_META = "spoolctl_tokens"


def save_file(backend: MlxRuntime, cache: Sequence[Any], tokens: Sequence[int],
              path: str | os.PathLike[str]) -> None:
    """Write ``cache`` as an mlx-lm ``save_prompt_cache`` file (with the token ids)."""
    _check_file_name(path)
    used = backend.copy_cache(cache, len(tokens))
    with backend.lock:
        backend.cache_mod.save_prompt_cache(
            os.fspath(path), used,
            metadata={"spoolctl_format": backend.format, TOKENS_META: json.dumps(list(tokens))})


def load_file(backend: MlxRuntime, path: str | os.PathLike[str]
              ) -> tuple[list[Any], list[int] | None]:
    """An mlx-lm prompt-cache file: (cache, token ids if the file records them)."""
    _check_file_name(path)
    if not Path(path).is_file():
        raise ConfigError("prompt cache file not found", path=os.fspath(path),
                          fix="pass a file written by save_prompt_cache")
    try:
        with backend.lock:
            cache, meta = backend.cache_mod.load_prompt_cache(os.fspath(path),
                                                               return_metadata=True)
    except Exception as exc:  # mlx raises RuntimeError/ValueError/KeyError for bad files
        raise ConfigError(f"mlx-lm cannot load the prompt cache file: {str(exc)[:200]}",
                          path=os.fspath(path),
                          fix="pass a file written by save_prompt_cache") from None
    tokens = None
    if isinstance(meta, dict) and TOKENS_META in meta:
        try:
            tokens = [int(t) for t in json.loads(meta[TOKENS_META])]
        except (TypeError, ValueError):
            raise ConfigError("the file's token list is malformed", path=os.fspath(path),
                              fix="re-export it") from None
    if backend.layers is not None and tokens is not None:  # a state-space layer has no count
        counted = PromptCache(cache)
        counted.tokens = len(tokens)
        return counted, tokens
    return list(cache), tokens


def _check_file_name(path: str | os.PathLike[str]) -> None:
    # mlx picks the file format from the suffix: anything else cannot be read back.
    if Path(path).suffix != ".safetensors":
        raise ConfigError("an mlx-lm prompt cache file name must end in .safetensors",
                          path=os.fspath(path), fix="e.g. prompt-cache.safetensors")
