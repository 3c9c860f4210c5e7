"""What a transformers model is right now: its base weights plus the PEFT adapters acting
on them (``local.model_state``), for ``PyTorchBackend.model_state``.

Per call, in one walk over the modules (no weight is hashed):

* The model object must be the one the backend loaded, or a ``peft.PeftModel`` around it
  (``PeftModel.from_pretrained(ctl.backend.model, ...)`` injects its layers into it).
  Anything else -- another wrapper, ``torch.compile``, a new model -- is unidentified.
* The base weights (every parameter not owned by a PEFT adapter) must be the tensors, data
  pointers and version counters seen when the identity was computed: an in-place edit
  (``weight.add_(...)``, even under ``no_grad``) bumps ``_version``; a new tensor or a
  moved/cast model changes the pointer. Either is unidentified, for good.
* The model must be in eval mode with no active dropout (a training model's outputs are
  random).
* Each PEFT tuner layer (``BaseTunerLayer``) contributes what acts in it: its active
  adapters (none when disabled), its merged ones, and each one's per-layer settings
  (rank, alpha, scaling -- ``set_scale`` shows here --, dropout, DoRA...). Each adapter is
  named by its content: its config (minus where it was loaded from) and every tensor of it,
  digested once and kept while its tensors keep their pointers and version counters
  (a training step on the adapter re-digests it: a new, identified state).

Not seen: a weight edited through ``.data`` (no version bump; PEFT's own merge does this,
which the merge state covers), forward hooks, and monkey-patched ``forward`` methods.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from spoolctl.store import Hasher

from ..local.model_state import ADAPTERS, UnidentifiedModel, canonical, digest_of

#: PEFT config fields that say where an adapter came from or how it was first initialised,
#: not what it computes (the tensors are digested).
_CONFIG_NOISE = frozenset({"base_model_name_or_path", "revision", "inference_mode",
                           "peft_version", "auto_mapping", "init_lora_weights"})
_KEPT_DIGESTS = 64  # adapter digests remembered (each: one fingerprint tuple)


def _tuner_type() -> type | None:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no peft: no PEFT layers can be in the model
        return None
    return BaseTunerLayer


def _stamp(torch: Any, t: Any) -> tuple[int, int, int]:
    """What changes when a tensor's contents may have: identity, data pointer, version."""
    try:
        version = int(t._version)
    except RuntimeError:  # an inference tensor keeps no version counter
        version = -1
    return id(t), int(t.data_ptr()), version


def _adapter_tensors(layer: Any, name: str) -> Iterator[tuple[str, Any]]:
    """``(path, tensor)`` of adapter ``name`` in a tuner layer (its weight containers)."""
    for attr in getattr(layer, "adapter_layer_names", ()):
        container = getattr(layer, attr, None)
        if container is None or name not in container:
            continue
        held = container[name]
        if hasattr(held, "named_parameters"):
            for sub, t in held.named_parameters():
                yield f"{attr}.{sub}", t
            for sub, t in held.named_buffers():
                yield f"{attr}.{sub}#", t
        else:
            yield attr, held


def _adapter_names(layer: Any) -> set[str]:
    names: set[str] = set()
    for attr in getattr(layer, "adapter_layer_names", ()):
        container = getattr(layer, attr, None)
        if container is not None and hasattr(container, "keys"):
            names.update(container.keys())
    return names


def _settings(layer: Any, name: str) -> dict[str, Any]:
    """The per-layer settings of adapter ``name`` (``other_param_names``: rank, alpha,
    scaling, dropout, ...), cheap to read on every call."""
    out: dict[str, Any] = {}
    for attr in getattr(layer, "other_param_names", ()):
        held = getattr(layer, attr, None)
        if held is not None and hasattr(held, "keys") and name in held:
            value = held[name]
            out[attr] = value if isinstance(value, (bool, int, float, str)) or value is None \
                else repr(value)
    return out


class TorchModelState:
    """The model state of one ``PyTorchBackend`` (see the module docstring); the baseline is
    the model as it is when this object is made (when the identity is computed)."""

    def __init__(self, torch: Any, root: Any):
        self._torch = torch
        self._root = root
        self._tuner = _tuner_type()
        self._lock = threading.Lock()
        self._digests: dict[tuple[Any, ...], str] = {}
        _, owned, _ = self._walk()
        self._base = self._base_print(owned)

    def _walk(self) -> tuple[list[tuple[str, Any]], set[int], bool]:
        """(tuner layers by name, ids of the adapter tensors, whether a dropout is active)."""
        torch = self._torch
        dropout_type = torch.nn.modules.dropout._DropoutNd
        tuners: list[tuple[str, Any]] = []
        owned: set[int] = set()
        active_dropout = False
        for name, module in self._root.named_modules():
            if self._tuner is not None and isinstance(module, self._tuner):
                tuners.append((name, module))
                for adapter in _adapter_names(module):
                    owned.update(id(t) for _, t in _adapter_tensors(module, adapter))
            elif module.training and isinstance(module, dropout_type) and module.p > 0:
                active_dropout = True
        return tuners, owned, active_dropout

    def _base_print(self, owned: set[int]) -> tuple[tuple[int, int, int], ...]:
        return tuple(sorted(_stamp(self._torch, p) for p in self._root.parameters()
                            if id(p) not in owned))

    def extra(self, model: Any) -> dict[str, str]:
        """The identity fields of the adapters acting now (``{}``: the base model as
        loaded); ``UnidentifiedModel`` for a change this cannot name."""
        if model is not self._root and not self._wraps_root(model):
            raise UnidentifiedModel(f"the backend's model is now a {type(model).__name__} "
                                    "around something else than the loaded model")
        if self._root.training:
            raise UnidentifiedModel("the model is in training mode")
        tuners, owned, dropout = self._walk()
        if dropout:
            raise UnidentifiedModel("a dropout layer is active (training mode)")
        if self._base_print(owned) != self._base:
            raise UnidentifiedModel("a base weight was replaced or edited in memory")
        rows = []
        for name, layer in tuners:
            active = [] if layer.disable_adapters else list(layer.active_adapters)
            merged = list(layer.merged_adapters)
            if active or merged:
                rows.append((name, active, merged, layer))
        if not rows:
            return {}
        names = sorted({a for _, active, merged, _ in rows for a in (*active, *merged)})
        digests = {a: self._adapter_digest(model, tuners, a)
                   for a in names}
        doc = [[name, [digests[a] for a in active], [digests[a] for a in merged],
                [[digests[a], _settings(layer, a)] for a in dict.fromkeys((*active, *merged))]]
               for name, active, merged, layer in rows]
        return {ADAPTERS: digest_of(doc)}

    def _wraps_root(self, model: Any) -> bool:
        """Whether ``model`` is a PEFT wrapper whose base model is the loaded one."""
        if not type(model).__module__.startswith("peft."):
            return False
        base = getattr(model, "get_base_model", None)
        return callable(base) and base() is self._root

    def _config(self, model: Any, name: str) -> Any:
        for holder in (self._root, model):
            configs = getattr(holder, "peft_config", None)
            if isinstance(configs, dict) and name in configs:
                return configs[name]
        raise UnidentifiedModel("a PEFT adapter has no config")

    def _adapter_digest(self, model: Any, tuners: list[tuple[str, Any]], name: str) -> str:
        """The content digest of adapter ``name``: its config and every tensor of it,
        computed again only when one of its tensors changed (``_stamp``)."""
        config = self._config(model, name)
        tensors = [(where, path, t) for where, layer in tuners
                   for path, t in _adapter_tensors(layer, name)]
        key = (name, id(config), tuple(_stamp(self._torch, t) for _, _, t in tensors))
        with self._lock:
            known = self._digests.get(key)
        if known is not None:
            return known
        as_dict = config.to_dict() if hasattr(config, "to_dict") else vars(config)
        h = Hasher()
        h.update(digest_of({k: v for k, v in canonical(as_dict).items()
                            if k not in _CONFIG_NOISE}).encode())
        for where, path, t in tensors:
            flat = t.detach().to("cpu").contiguous().reshape(-1)
            head = f"{where}:{path}:{flat.dtype}:{list(t.shape)}".encode()
            h.update(len(head).to_bytes(8, "big") + head)
            h.update(flat.view(self._torch.uint8).numpy().tobytes())
        digest = "blake3:" + h.hexdigest()
        with self._lock:
            if len(self._digests) >= _KEPT_DIGESTS:
                self._digests.pop(next(iter(self._digests)))
            self._digests[key] = digest
        return digest
