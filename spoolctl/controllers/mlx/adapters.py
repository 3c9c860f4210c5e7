"""What an mlx-lm model is right now: its base weights plus the LoRA / DoRA layers acting
on them (``local.model_state``), for ``MlxBackend.model_state``.

mlx-lm's adapters (``mlx_lm.load(..., adapter_path=...)``, ``mlx_lm.tuner.utils
.load_adapters``, ``model.load_weights`` of another adapter file, ``remove_lora_layers``)
replace modules and arrays; an mlx array is never edited in place by them. Per call, in one
walk over the modules:

* The model object must be the one the backend loaded.
* The base arrays (every parameter not held by a LoRA layer's ``lora_a`` / ``lora_b`` /
  ``m``) must be the array objects seen when the identity was computed (held here, so their
  ids cannot be reused); a replaced one -- an in-memory fuse, ``model.update`` of a weight,
  a cast -- is unidentified, for good (the held arrays are then let go).
* No dropout may be active (a module in training mode with p > 0).
* The LoRA layers that act are named by their content: each layer's class, scale and
  arrays, digested once per set of array objects.

Not seen: an array written through item assignment (``w[...] = x``). A fused model saved
with ``mlx_lm.fuse`` is a model directory of its own (its files' digest).
"""

from __future__ import annotations

import threading
from typing import Any, cast

from spoolctl.store import Hasher

from ..local.model_state import ADAPTERS, UnidentifiedModel, digest_of

_LEAVES = ("lora_a", "lora_b", "m")  # the arrays of mlx-lm's LoRA / DoRA layers
_KEPT_DIGESTS = 16  # adapter digests remembered (each holds its adapter arrays)


def _lora_arrays(module: Any) -> list[tuple[str, Any]]:
    return [(k, module[k]) for k in _LEAVES if k in module] \
        if isinstance(module, dict) and "lora_a" in module and "lora_b" in module else []


def lora_layers(root: Any) -> dict[str, set[int]]:
    """The LoRA / DoRA layers of ``root`` by name: the ids of their own arrays (not the
    base weights they wrap)."""
    return {name: {id(a) for _, a in arrays} for name, module in root.named_modules()
            if (arrays := _lora_arrays(module))}


class MlxModelState:
    """The model state of one ``MlxBackend`` (see the module docstring); the baseline is the
    model as it is when this object is made."""

    def __init__(self, mx: Any, root: Any):
        from mlx.utils import tree_flatten

        self._mx = mx
        self._flatten = tree_flatten
        self._root = root
        self._lock = threading.Lock()
        self._digests: dict[tuple[Any, ...], tuple[list[Any], str]] = {}
        _, owned, _ = self._walk()
        self._base: list[Any] | None = self._base_arrays(owned)
        self._base_ids = sorted(id(a) for a in self._base)

    def _walk(self) -> tuple[list[tuple[str, Any]], set[int], bool]:
        """(LoRA layers by name, ids of their arrays, whether a dropout is active)."""
        import mlx.nn as nn

        layers: list[tuple[str, Any]] = []
        owned: set[int] = set()
        dropout = False
        for name, module in self._root.named_modules():
            arrays = _lora_arrays(module)
            if arrays:
                layers.append((name, module))
                owned.update(id(a) for _, a in arrays)
            if isinstance(module, nn.Dropout) and module.training and \
                    float(getattr(module, "_p_1", 1.0)) < 1.0:
                dropout = True
        return sorted(layers, key=lambda nm: nm[0]), owned, dropout

    def _base_arrays(self, owned: set[int]) -> list[Any]:
        # tree_flatten returns a list of (path, array) pairs when given no destination
        flat = cast(list[tuple[str, Any]], self._flatten(self._root.parameters()))
        return [a for _, a in flat if id(a) not in owned]

    def extra(self, model: Any) -> dict[str, str]:
        """The identity fields of the LoRA layers acting now (``{}``: the model as loaded);
        ``UnidentifiedModel`` for a change this cannot name."""
        if model is not self._root:
            raise UnidentifiedModel(f"the backend's model is now another {type(model).__name__}")
        layers, owned, dropout = self._walk()
        if dropout:
            raise UnidentifiedModel("a dropout layer is active (training mode)")
        with self._lock:
            if self._base is not None and \
                    sorted(id(a) for a in self._base_arrays(owned)) != self._base_ids:
                self._base = None  # for good: nothing to compare with any more
            if self._base is None:
                raise UnidentifiedModel("a base weight was replaced in memory (fused, updated "
                                        "or cast)")
        if not layers:
            return {}
        doc = [self._adapter_digest(layers),
               [[name, type(m).__name__, float(getattr(m, "scale", 0.0))] for name, m in layers]]
        return {ADAPTERS: digest_of(doc)}

    def _adapter_digest(self, layers: list[tuple[str, Any]]) -> str:
        arrays = [(f"{name}.{leaf}", a) for name, m in layers for leaf, a in _lora_arrays(m)]
        key = tuple((path, id(a)) for path, a in arrays)
        with self._lock:
            known = self._digests.get(key)
        if known is not None:
            return known[1]
        mx = self._mx
        h = Hasher()
        for path, a in arrays:
            head = f"{path}:{a.dtype}:{list(a.shape)}".encode()
            h.update(len(head).to_bytes(8, "big") + head)
            raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a  # no bf16 buffers
            h.update(bytes(memoryview(raw)))
        digest = "blake3:" + h.hexdigest()
        with self._lock:
            if len(self._digests) >= _KEPT_DIGESTS:
                self._digests.pop(next(iter(self._digests)))
            self._digests[key] = ([a for _, a in arrays], digest)  # held: ids stay unique
        return digest
