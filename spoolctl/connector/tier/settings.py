"""The tier's options (the ``secondary_tiers`` entry of vLLM's extra config), validated.

Pure: no vLLM import. Every refusal is one ConfigError line naming the option and the fix.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spoolctl.errors import ConfigError
from spoolctl.store import format_size, parse_duration, parse_size

# Options vLLM's tier factory passes on to every tier (it consumes type, module_path and
# backpressure itself).
VLLM_OPTIONS = frozenset({"locality", "enable_kv_events"})
OPTIONS = frozenset({"root", "max_size", "read_threads", "write_threads", "queue_depth",
                     "read_deadline", "weights_id", "weights_memo"})
# The store never keeps an entry over 90% of its bound: below two chunks almost nothing fits.
MIN_CHUNKS = 2


@dataclass(frozen=True)
class TierSettings:
    """``root``: the store; ``max_size``: its bound in bytes (None: keep the store's own);
    ``queue_depth``: store jobs queued before new ones are dropped (backpressure);
    ``read_deadline``: seconds a promotion may take before it is failed (a hung disk);
    ``weights_id``: the operator's name for the weights instead of their digest."""

    root: Path
    max_size: int | None = None
    read_threads: int = 2
    write_threads: int = 2
    queue_depth: int = 16
    read_deadline: float = 30.0
    weights_id: str | None = None
    weights_memo: str | None = None


def _refuse(option: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"SpoolTier option {option!r} {problem}", fix=fix)


def _positive_int(options: Mapping[str, Any], name: str, default: int, most: int) -> int:
    value = options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise _refuse(name, f"must be an integer from 1 to {most}, got {value!r}",
                      f'set "{name}" to a whole number such as {default}')
    return value


def _root(options: Mapping[str, Any]) -> Path:
    root = options.get("root")
    if not isinstance(root, str) or not root:
        raise _refuse("root", "is missing", 'set "root" to an absolute directory, '
                      'e.g. "/var/cache/spoolctl"')
    if not os.path.isabs(root):
        raise _refuse("root", f"must be an absolute path, got {root!r}",
                      'set "root" to an absolute directory')
    return Path(root)


def _max_size(options: Mapping[str, Any]) -> int | None:
    value = options.get("max_size")
    if value is None:
        return None
    try:
        size = parse_size(str(value)) if not isinstance(value, int) else value
    except ConfigError:
        size = -1
    if isinstance(value, bool) or size <= 0:
        raise _refuse("max_size", f"is not a size: {value!r}",
                      'set "max_size" to a size such as "500GiB" or a byte count')
    return size


def _deadline(options: Mapping[str, Any]) -> float:
    value = options.get("read_deadline", TierSettings.read_deadline)
    try:
        seconds = float(value) if isinstance(value, int | float) and not isinstance(
            value, bool) else parse_duration(str(value))
    except ConfigError:
        seconds = -1.0
    if not 0 < seconds <= 3600:
        raise _refuse("read_deadline", f"is not a duration up to 1h: {value!r}",
                      'set "read_deadline" to seconds or a duration such as "30s"')
    return seconds


def _optional_text(options: Mapping[str, Any], name: str) -> str | None:
    value = options.get(name)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise _refuse(name, "must be a non-empty string", f'set "{name}" or leave it out')
    return value


def _memo(options: Mapping[str, Any]) -> str | None:
    value = _optional_text(options, "weights_memo")
    if value is not None and value != "off" and not os.path.isabs(value):
        raise _refuse("weights_memo", f"must be an absolute directory or off, got {value!r}",
                      'set "weights_memo" to an absolute directory, or "off"')
    return value


def check_room(max_bytes: int | None, chunk_bytes: int, *, recorded: bool = False) -> None:
    """ConfigError when a store bounded at ``max_bytes`` cannot keep ``MIN_CHUNKS`` chunks of
    ``chunk_bytes``: the tier would start and never store anything. ``recorded``: the
    bound is the existing store's own, not the option's."""
    if max_bytes is None or max_bytes >= MIN_CHUNKS * chunk_bytes:
        return
    where = "the store's recorded max size" if recorded else "option 'max_size'"
    raise ConfigError(
        f"SpoolTier {where} {format_size(max_bytes)} is smaller than {MIN_CHUNKS} chunks of "
        f"this engine ({format_size(chunk_bytes)} each): nothing would ever be stored",
        fix=f'set "max_size" to many chunks, e.g. "{format_size(chunk_bytes * 1024)}"')


def parse_settings(options: Mapping[str, Any]) -> TierSettings:
    """The settings ``options`` give; ConfigError (one line) for an unknown or bad one."""
    unknown = sorted(set(options) - OPTIONS - VLLM_OPTIONS)
    if unknown:
        raise _refuse(unknown[0], "is not known",
                      f"use only {', '.join(sorted(OPTIONS))} in the SpoolTier entry")
    return TierSettings(
        root=_root(options), max_size=_max_size(options),
        read_threads=_positive_int(options, "read_threads", TierSettings.read_threads, 64),
        write_threads=_positive_int(options, "write_threads", TierSettings.write_threads, 64),
        queue_depth=_positive_int(options, "queue_depth", TierSettings.queue_depth, 4096),
        read_deadline=_deadline(options),
        weights_id=_optional_text(options, "weights_id"),
        weights_memo=_memo(options))
