"""Start-up checks of the connector's root and size, before any store is opened (no vLLM).

What an operator gets wrong on the first day and would otherwise learn late: a root the
engine's user cannot write (found when the first rank store is created, inside a vLLM
traceback), a max size smaller than one chunk (a server that never stores anything; only
a skip counter says so), and a root on tmpfs (a "persistent" cache in RAM that competes
with vLLM for memory and is gone at reboot). ``check_root`` and ``check_max_size`` are
shared by the connector's first hook and ``spoolctl config vllm``; each failure is one
``ConfigError`` line naming the path and the fix, each risk one warning line.

Kept apart from other start-up warnings (the connector's own, e.g. about its shutdown
drain) so each can change alone.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from spoolctl.errors import ConfigError
from spoolctl.store import filesystem_type, format_size

if TYPE_CHECKING:
    from ..vllm_api.protocols import VllmConfigLike

log = logging.getLogger("spoolctl.connector")

# Filesystems whose contents live in memory: accepted (they survive an engine restart,
# which is what the connector is for), but said, once, at start-up.
MEMORY_FS = frozenset({"tmpfs", "ramfs"})


def check_root(root: str | os.PathLike[str], option: str = "spoolctl_root") -> list[str]:
    """Raise ConfigError if the engine's user cannot create stores under ``root`` (the
    nearest existing directory at or above it must be writable and searchable); return
    warning lines (a root on a memory filesystem). Creates nothing: a probe file is made
    and removed only in a directory that already exists. ``option``: the setting's name."""
    path = Path(root)
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{existing} is not a directory", path=str(path),
                          fix=f"give a directory (or a path under one) as {option}")
    why = ""
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "permission denied"
    else:
        try:  # access() trusts mode bits for root; a read-only mount says no only on write
            fd, probe = tempfile.mkstemp(prefix=".spoolctl-probe-", dir=existing)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            why = exc.strerror or str(exc)
    if why:
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            why, fix = "read-only filesystem", f"use a writable local disk for {option}"
        else:
            fix = (f"run vLLM as a user that can write it (`chown -R USER {existing}`), "
                   "or pick a root that user owns")
        raise ConfigError(f"cannot create stores under {existing} as uid {os.geteuid()} "
                          f"({why.lower()})", path=str(path), fix=fix)
    fstype = filesystem_type(existing)
    if fstype in MEMORY_FS:
        return [f"{option} {path} is on {fstype}: the cache lives in RAM (it competes "
                "with vLLM for memory and is empty after a reboot); use a local disk"]
    return []


def check_roots(roots: tuple[str, ...] | list[str], *, bound_s: float) -> list[str]:
    """``check_root`` of every drive root, each bounded by ``bound_s``: a root whose disk
    does not answer in time is one warning line (the connector starts without it and
    retries, ``drivestores``), never a hung start. Several roots on one filesystem are
    allowed with one warning (one failure domain)."""
    from ..diskguard import bounded

    warnings: list[str] = []
    devices: dict[int, str] = {}
    for root in roots:
        done, found = bounded(functools.partial(_root_facts, root), bound_s)
        if not done:
            warnings.append(f"spoolctl root {root} does not answer within {bound_s:g} s (a "
                            "hung or slow disk); the connector starts without it and "
                            "retries it")
            continue
        lines, device = found
        warnings += lines
        if len(roots) > 1 and device in devices:
            warnings.append(f"spoolctl roots {devices[device]} and {root} are on one "
                            "filesystem: one failure domain, not two drives")
        devices.setdefault(device, root)
    return warnings


def _root_facts(root: str) -> tuple[list[str], int]:
    return check_root(root), _device(root)


def _device(root: str) -> int:
    """``st_dev`` of ``root`` or of its nearest existing parent."""
    path = Path(root)
    while not path.exists() and path.parent != path:
        path = path.parent
    return os.stat(path).st_dev


def chunk_bytes_estimate(vllm_config: VllmConfigLike, chunk_tokens: int) -> int | None:
    """Bytes of KV one chunk holds on one rank, from the model's config (layers on this
    stage x KV heads on this rank x head size x 2 for K and V, 1 for MLA's latent x the KV
    cache element size); None when the config does not say. A model with attention-free
    or sliding-window layers stores no more than this."""
    try:
        model, par = vllm_config.model_config, vllm_config.parallel_config
        layers = int(model.get_num_layers(par))
        heads = int(model.get_num_kv_heads(par))
        head = int(model.get_head_size())
        kv = 1 if getattr(model, "use_mla", False) else 2
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        size = _element_size(model.dtype if cache_dtype == "auto" else cache_dtype)
    except Exception:  # a model kind without these facts: the later exact path decides
        return None
    if size is None or min(layers, heads, head) <= 0:
        return None
    return chunk_tokens * layers * heads * head * kv * size


def _element_size(dtype: object) -> int | None:
    size = getattr(dtype, "itemsize", None)  # a torch.dtype
    if isinstance(size, int):
        return size
    name = str(dtype).removeprefix("torch.")
    if name.startswith(("fp8", "float8", "int8", "uint8")):
        return 1
    return {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}.get(name)


def chunk_bytes_from_model_dir(model_dir: str | os.PathLike[str], *, tp: int = 1,
                               chunk_tokens: int = 256) -> int | None:
    """The same estimate from a local model directory's ``config.json`` (for ``spoolctl
    config vllm --model``, before vLLM starts; no framework needed): None for a hub id, a
    config without these fields, or a quantized/MLA model whose KV size it cannot tell."""
    import json

    try:
        with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict):
            return None
        cfg = doc.get("text_config", doc)
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        head = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(
            cfg["num_attention_heads"]))
        size = _element_size(cfg.get("dtype") or cfg.get("torch_dtype"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError):
        return None
    if size is None or "kv_lora_rank" in cfg or min(layers, heads, head, tp) <= 0:
        return None
    return chunk_tokens * layers * max(1, heads // tp) * head * 2 * size


def check_max_size(max_bytes: int | None, chunk_bytes: int | None, chunk_tokens: int) -> None:
    """Raise ConfigError when a bounded store cannot hold a single chunk."""
    if max_bytes is None or chunk_bytes is None or max_bytes >= chunk_bytes:
        return
    raise ConfigError(
        f"spoolctl_max_size {format_size(max_bytes)} is smaller than one "
        f"{chunk_tokens}-token chunk of this model ({format_size(chunk_bytes)} per rank): "
        "nothing would ever be stored", path="kv_connector_extra_config",
        fix=f"set spoolctl_max_size to many chunks, e.g. {format_size(chunk_bytes * 1024)}")


def preflight(vllm_config: VllmConfigLike) -> list[str]:
    """The connector's start-up checks for ``vllm_config`` (see the module docstring):
    ConfigError on a root it cannot use or a max size below one chunk; the warning lines,
    each also logged once."""
    from .settings import parse_settings

    tcfg = vllm_config.kv_transfer_config
    assert tcfg is not None, "vLLM builds a KV connector only with a kv_transfer_config"
    settings = parse_settings(tcfg.kv_connector_extra_config,
                              block_size=int(vllm_config.cache_config.block_size))
    if not os.path.isabs(settings.root):
        raise ConfigError("spoolctl_root must be an absolute path", path=settings.root,
                          fix="give the full path of the base directory for rank stores")
    check_max_size(settings.max_bytes, chunk_bytes_estimate(vllm_config, settings.chunk_tokens),
                   settings.chunk_tokens)
    warnings = check_roots(settings.roots, bound_s=4 * settings.lookup_deadline)
    for line in warnings:
        log.warning("spoolctl: %s", line)
    return warnings
