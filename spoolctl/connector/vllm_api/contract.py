"""Startup check of vLLM's connector API against the signatures this connector implements.

vLLM marks ``KVConnectorBase_V1`` experimental and its signatures drift between
minor releases. A silent drift would mean callbacks receiving arguments in the
wrong places (wrong blocks restored). So before any model memory is allocated
the connector compares every callback it implements with the installed base
class and refuses to start, with one message listing every difference.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from spoolctl.errors import ConfigError

# method -> parameter names after ``self``/``cls`` (the vLLM 0.32 API this connector targets)
EXPECTED: Mapping[str, tuple[str, ...]] = {
    "__init__": ("vllm_config", "role", "kv_cache_config"),
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    "build_connector_meta": ("scheduler_output",),
    "request_finished": ("request", "block_ids"),
    "register_kv_caches": ("kv_caches",),
    "bind_connector_metadata": ("connector_metadata",),
    "start_load_kv": ("forward_context", "kwargs"),
    "wait_for_layer_load": ("layer_name",),
    "save_kv_layer": ("layer_name", "kv_layer", "attn_metadata", "kwargs"),
    "wait_for_save": (),
    "get_finished": ("finished_req_ids",),
    "get_transfer_results": ("finished_req_ids",),
    "get_block_ids_with_load_errors": (),
    "get_kv_connector_stats": (),
    "build_kv_connector_stats": ("data",),
    "build_prom_metrics": ("vllm_config", "metric_types", "labelnames",
                           "per_engine_labelvalues"),
    "get_required_kvcache_layout": ("vllm_config",),
    "shutdown": (),
    "reset_cache": (),
    "take_events": (),
    "has_pending_push_work": (),
    "get_handshake_metadata": (),
    "build_connector_worker_meta": (),
    "set_xfer_handshake_metadata": ("metadata",),
    "set_xfer_handshake_metadata_pp_aware": ("metadata",),
    "update_connector_output": ("connector_output",),
}

# Callbacks that exist only in some supported vLLM versions (0.33 added sleep-mode hooks):
# checked when the installed base class has them, not required otherwise.
OPTIONAL_EXPECTED: Mapping[str, tuple[str, ...]] = {
    "unregister_kv_caches": (),
    "restore_kv_caches": (),
}


def _params(fn: object) -> tuple[str, ...]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    names = tuple(sig.parameters)
    return names[1:] if names and names[0] in ("self", "cls") else names


# SupportsHMA's one method (vLLM calls it instead of request_finished once claimed).
HMA_EXPECTED: Mapping[str, tuple[str, ...]] = {
    "request_finished_all_groups": ("request", "block_ids"),
}


def signature_drift(base: type, expected_map: Mapping[str, tuple[str, ...]] = EXPECTED,
                    optional: Mapping[str, tuple[str, ...]] | None = None) -> list[str]:
    """Differences between ``base`` (vLLM's KVConnectorBase_V1) and ``expected_map`` (every
    method required) plus ``optional`` (checked only where ``base`` has it)."""
    problems = []
    wanted = [(n, e, True) for n, e in expected_map.items()]
    wanted += [(n, e, False) for n, e in (optional or {}).items()]
    for name, expected, required in wanted:
        fn = inspect.getattr_static(base, name, None)
        if fn is None:
            if required:
                problems.append(f"{name} is gone")
            continue
        if isinstance(fn, (classmethod, staticmethod)):
            fn = fn.__func__
        try:
            got = _params(fn)
        except (TypeError, ValueError):
            problems.append(f"{name} has no readable signature")
            continue
        if got != expected:
            problems.append(f"{name}({', '.join(got)}) != expected ({', '.join(expected)})")
    return problems


def check_contract(base: type, version: str, hma: type | None = None) -> None:
    """Raise ConfigError naming every drifted callback, if any (``hma``: SupportsHMA)."""
    problems = signature_drift(base, EXPECTED, OPTIONAL_EXPECTED)
    if hma is not None:
        problems += signature_drift(hma, HMA_EXPECTED)
    if problems:
        raise ConfigError(
            f"spoolctl connector does not support this vLLM ({version}): KV connector API "
            f"changed: {'; '.join(problems)}",
            path="vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1",
            fix="install a spoolctl release that supports this vLLM, or use vLLM 0.32 or 0.33",
        )
