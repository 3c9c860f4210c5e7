"""What the PyTorch backend needs from the host before a model runs: quiet framework logs,
the digest of the model's files, the name of the cache argument, a usable device."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from spoolctl.errors import ConfigError
from spoolctl.store import Hasher

_HASH_BLOCK = 8 << 20
# Files whose bytes define the model's outputs for given token ids.
_MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".tiktoken", ".py",
                        ".jinja")


def quiet_frameworks() -> None:
    """Silence transformers' progress bars and info logs (for the CLI and the demo)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def model_digest(model_dir: Path) -> str:
    """Digest of every file that defines the model (config, tokenizer, weights): a retrained
    model at the same path is another namespace. ConfigError when there are no model files.
    """
    h = Hasher()
    files = sorted(p for p in model_dir.rglob("*")
                   if p.is_file() and p.suffix in _MODEL_FILE_SUFFIXES
                   and not p.name.startswith("."))
    if not files:
        raise ConfigError("no model files found", path=model_dir,
                          fix="pass a directory written by save_pretrained()")
    for path in files:
        rel = path.relative_to(model_dir).as_posix().encode()
        h.update(len(rel).to_bytes(8, "big") + rel)
        with open(path, "rb") as f:
            while block := f.read(_HASH_BLOCK):
                h.update(block)
        h.update(b"\x00")
    return h.hexdigest()


def cache_argument(forward: Any) -> str:
    """The name under which ``forward`` (and ``generate``) take the KV cache: ``cache``
    where the model declares it (transformers >= 5.24, which deprecates the old name),
    else ``past_key_values`` (5.19 swallows ``cache=`` into ``**kwargs``)."""
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    if "cache" in params:
        return "cache"
    # recurrent-only models (Mamba) take their state as ``cache_params``
    return "cache_params" if "cache_params" in params and "past_key_values" not in params \
        else "past_key_values"


def usable_device(torch: Any, device: str) -> Any:
    """``torch.device(device)`` after checking this torch can allocate on it; a ConfigError
    naming the cause otherwise (not the AssertionError a CPU-only torch raises later)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"bad device {device!r}: {exc}", fix="use e.g. 'cpu' or 'cuda'") \
            from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} is not available: this torch "
                          f"({torch.__version__}) has no CUDA support or sees no GPU",
                          fix="pass device='cpu', or install a CUDA build of torch")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {device!r} is not available: MPS needs Apple silicon "
                          "and a torch built with MPS", fix="pass device='cpu'")
    try:
        torch.empty(1, device=dev)
    except (AssertionError, RuntimeError) as exc:
        raise ConfigError(f"device {device!r} is not usable: {str(exc)[:200]}",
                          fix="pass device='cpu', or a device this machine has") from None
    return dev
