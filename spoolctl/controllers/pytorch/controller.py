"""The transformers prompt-cache controller: ``LocalCacheController`` over
``PyTorchBackend``, for a model directory or a model the application loaded."""

from __future__ import annotations

import os
from typing import Any

from spoolctl.errors import ConfigError

from ..local.deadlines import DEFAULT_LOOKUP_DEADLINE_S, DEFAULT_READ_DEADLINE_S
from ..local.engine import DEFAULT_LOCK_TIMEOUT, DEFAULT_MEMORY_ENTRIES, LocalCacheController
from .backend import PyTorchBackend


class PyTorchCacheController(LocalCacheController):
    """The prompt-cache controller for transformers models (``kind = "pytorch"``).

    ``model``: a local model directory (or an already built ``PyTorchBackend``);
    ``root``: store root, open Store, or None for a managed temporary store.
    ``restore(handle).cache`` is a ``transformers.DynamicCache``; ``import_cache`` takes one.
    ``tenant``: on an encrypted store, the tenant whose key seals the entries (see
    ``LocalCacheController``).
    ``lookup_deadline`` / ``read_deadline``: see ``LocalCacheController`` (a hung disk costs
    ``prepare`` one deadline, then a cold run).
    """

    def __init__(self, model: str | os.PathLike[str] | PyTorchBackend,
                 root: Any = None, *, dtype: str | None = None, device: str = "cpu",
                 revision: str | None = None, model_id: str | None = None,
                 trusted_revision: str | None = None,
                 max_bytes: int | None = None,
                 memory_entries: int = DEFAULT_MEMORY_ENTRIES,
                 lock_timeout: float = DEFAULT_LOCK_TIMEOUT, read_only: bool = False,
                 tenant: str | None = None,
                 lookup_deadline: float = DEFAULT_LOOKUP_DEADLINE_S,
                 read_deadline: float = DEFAULT_READ_DEADLINE_S):
        backend = model if isinstance(model, PyTorchBackend) else \
            PyTorchBackend(model, dtype=dtype, device=device, revision=revision,
                           model_id=model_id, trusted_revision=trusted_revision)
        super().__init__(backend, root, max_bytes=max_bytes, memory_entries=memory_entries,
                         lock_timeout=lock_timeout, read_only=read_only, tenant=tenant,
                         lookup_deadline=lookup_deadline, read_deadline=read_deadline)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, root: Any = None, *,
                   identity: str | None = None, model_id: str | None = None,
                   **options: Any) -> PyTorchCacheController:
        """A controller of a model the application already loaded (``model``: what
        ``from_pretrained`` returned, quantized or ``torch.compile``-d as the app likes);
        ``identity``: see ``PyTorchBackend.from_loaded``; ``options``: the store options of
        the constructor (``max_bytes``, ``tenant``, ``read_only``...)."""
        loading = sorted({"dtype", "device", "revision", "trusted_revision"} & set(options))
        if loading:
            raise ConfigError(f"{', '.join(loading)} cannot apply to a model already loaded",
                              fix="cast or move the model before handing it over; name its "
                                  "weights with identity=")
        backend = PyTorchBackend.from_loaded(model, tokenizer, identity=identity,
                                             model_id=model_id)
        return cls(backend, root, **options)
