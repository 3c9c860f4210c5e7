"""The mlx-lm prompt-cache controller: ``LocalCacheController`` over ``MlxBackend``, plus
interop with mlx-lm's own prompt-cache files."""

from __future__ import annotations

import os
from typing import Any

from spoolctl.errors import ConfigError
from spoolctl.store import Store

from ..contract import CacheHandle, CachePrepareParams
from ..local.deadlines import DEFAULT_LOOKUP_DEADLINE_S, DEFAULT_READ_DEADLINE_S
from ..local.engine import DEFAULT_LOCK_TIMEOUT, DEFAULT_MEMORY_ENTRIES, LocalCacheController
from .backend import KV_GROUP_SIZE, PREFILL_STEP, QUANTIZED_KV_START, MlxBackend


class MlxCacheController(LocalCacheController):
    """The prompt-cache controller for mlx-lm: ``LocalCacheController`` over ``MlxBackend``.

    Entries are ``kind="mlx"`` in the same store as every other kind, so
    ``spoolctl status/scrub/clean`` handle them like any entry. ``model`` is a model
    directory (loaded here) or an already built ``MlxBackend`` (shared, e.g. by tests
    or by several controllers of one process). ``root=None`` is a managed temporary
    store that ``close()`` removes. ``kv_bits`` / ``kv_group_size`` /
    ``quantized_kv_start``: mlx-lm's quantized KV cache (see ``MlxBackend``); ignored when
    ``model`` is a built backend. ``tenant``: on an encrypted store, the tenant whose key
    seals the entries (see ``LocalCacheController``). ``adapter_path``: LoRA adapters to
    load with the model (see ``MlxBackend``). ``lookup_deadline`` / ``read_deadline``: see
    ``LocalCacheController`` (a hung disk costs ``prepare`` one deadline, then a cold run).
    ``from_model``: a controller of a model the application loaded itself.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | MlxBackend,
        root: str | os.PathLike[str] | Store | None = None,
        *,
        max_bytes: int | None = None,
        memory_entries: int = DEFAULT_MEMORY_ENTRIES,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        prefill_step: int = PREFILL_STEP,
        model_id: str | None = None,
        read_only: bool = False,
        kv_bits: int | None = None,
        kv_group_size: int = KV_GROUP_SIZE,
        quantized_kv_start: int = QUANTIZED_KV_START,
        tenant: str | None = None,
        adapter_path: str | os.PathLike[str] | None = None,
        lookup_deadline: float = DEFAULT_LOOKUP_DEADLINE_S,
        read_deadline: float = DEFAULT_READ_DEADLINE_S,
    ):
        backend = model if isinstance(model, MlxBackend) else \
            MlxBackend(model, prefill_step=prefill_step, model_id=model_id, kv_bits=kv_bits,
                       kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
                       adapter_path=adapter_path)
        if root is not None and not isinstance(root, Store):
            root = os.fspath(root)
        super().__init__(backend, root, max_bytes=max_bytes, memory_entries=memory_entries,
                         lock_timeout=lock_timeout, read_only=read_only, tenant=tenant,
                         lookup_deadline=lookup_deadline, read_deadline=read_deadline)
        self.mlx: MlxBackend = backend

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any,
                   root: str | os.PathLike[str] | Store | None = None, *,
                   identity: str | None = None, model_id: str | None = None,
                   **options: Any) -> MlxCacheController:
        """A controller of a model the application already loaded (``model, tokenizer``:
        what ``mlx_lm.load`` returned; quantized, ``mx.compile``-d or with adapters as the
        app likes); ``identity``: see ``MlxBackend.from_loaded``; ``options``: the
        constructor's cache options (``prefill_step``, ``kv_bits``, ``kv_group_size``,
        ``quantized_kv_start``) and store options (``max_bytes``, ``tenant``...)."""
        if "adapter_path" in options:
            raise ConfigError("adapter_path cannot apply to a model already loaded",
                              fix="load the adapters before handing the model over "
                                  "(mlx_lm.load(..., adapter_path=...)); they are keyed by "
                                  "their content")
        cache_options = {k: options.pop(k) for k in
                         ("prefill_step", "kv_bits", "kv_group_size", "quantized_kv_start")
                         if k in options}
        backend = MlxBackend.from_loaded(model, tokenizer, identity=identity,
                                         model_id=model_id, **cache_options)
        return cls(backend, root, **options)

    def export_prompt_cache(self, target: CachePrepareParams | CacheHandle,
                            path: str | os.PathLike[str]) -> list[int]:
        """Write the cache of a handle (params are prepared first) as an mlx-lm
        ``save_prompt_cache`` file that ``mlx_lm.load_prompt_cache`` reads; the file also
        records the token ids it covers. Returns those ids."""
        restored = self.restore(target)
        if not restored.tokens:
            raise ConfigError("nothing to export: the handle holds no cache",
                              fix="prepare params with a cacheable prefix (not read-only "
                                  "on a miss)")
        self.mlx.save_file(restored.cache, restored.tokens, path)
        return restored.tokens

    def import_prompt_cache(self, params: CachePrepareParams,
                            path: str | os.PathLike[str], *, check: str = "full") -> CacheHandle:
        """Store an mlx-lm prompt-cache file (``save_prompt_cache``, e.g. from
        ``export_prompt_cache`` or your own prefill of ``prefix_tokens(params)``) as the
        entry of ``params``. A file that records token ids must record exactly the
        prefix's; every file is checked like ``import_cache`` (``check`` as there)."""
        cache, tokens = self.mlx.load_file(path)
        if tokens is not None and tokens != self.prefix_tokens(params):
            raise ConfigError("the file caches other tokens than these params' prefix",
                              path=os.fspath(path),
                              fix="export and import with the same params and model")
        return self.import_cache(params, cache, check=check)
