"""The identity of a model the application loaded itself (``PyTorchBackend.from_loaded``).

* ``unwrap``: a ``torch.compile``-d model (``OptimizedModule``) is named by the module it
  wraps (``_orig_mod``); compiling changes how the weights run, not what they compute.
* ``weights_digest``: the content digest of every entry of the model's ``state_dict``:
  name, dtype, shape and bytes of each tensor; a quantized tensor by its integer
  representation, quantization scheme, scales and zero points; a packed-params tuple
  (``torch.ao`` dynamic quantization) element by element. Computed once per model object
  and kept while its parameters and buffers keep their data pointers and version counters.
* ``architecture``: what a caller-stated identity is checked against -- the model and config
  classes, the config's architecture fields and the name, dtype and shape of every
  ``state_dict`` entry (no bytes read).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from spoolctl.errors import ConfigError
from spoolctl.store import Hasher

from ..local.model_state import StatedIdentities

#: Config fields that fix the architecture (the rest -- generation settings, names -- do not).
_ARCH_FIELDS = ("model_type", "architectures", "num_hidden_layers", "hidden_size",
                "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "max_position_embeddings", "rope_theta", "tie_word_embeddings")

_lock = threading.Lock()
#: model -> (fingerprint of its tensors, digest): a model hashed once per process
_digests: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], str]] = \
    weakref.WeakKeyDictionary()
#: refuses an identity stated before, in this process, for another architecture
check_stated = StatedIdentities(
    differs="different classes, config or parameter shapes",
    fix="state a new identity for each model and each set of weights").check


def unwrap(model: Any) -> Any:
    """The module a ``torch.compile`` wrapper runs (the model itself if it is not one)."""
    seen = 0
    while type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        model = model._orig_mod
        seen += 1
        if seen > 8:
            break
    return model


def _fingerprint(model: Any) -> tuple[Any, ...]:
    """What changes when a parameter or buffer may have: identity, pointer, version."""
    out: list[Any] = []
    for t in (*model.parameters(), *model.buffers()):
        try:
            version = int(t._version)
        except RuntimeError:  # an inference tensor keeps no version counter
            version = -1
        out.append((id(t), int(t.data_ptr()), version))
    # torch.ao packed weights are no parameters: set_weight_bias swaps the packed object
    out.extend(id(m._packed_params) for m in model.modules()
               if hasattr(m, "_packed_params") and not hasattr(m._packed_params, "parameters"))
    return tuple(out)


def _leaves(torch: Any, name: str, value: Any) -> Iterator[tuple[str, str, Any | None]]:
    """``(name, header, tensor or None)`` of one state_dict value, quantized ones opened."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.is_quantized:
            scheme = t.qscheme()
            if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
                params = f"scale={t.q_scale()!r}:zero={t.q_zero_point()}"
                yield f"{name}", f"q:{t.dtype}:{scheme}:{params}:{list(t.shape)}", t.int_repr()
            else:
                axis = t.q_per_channel_axis()
                yield f"{name}", f"q:{t.dtype}:{scheme}:axis={axis}:{list(t.shape)}", \
                    t.int_repr()
                yield f"{name}.scales", "scales", t.q_per_channel_scales()
                yield f"{name}.zeros", "zeros", t.q_per_channel_zero_points()
        else:
            yield name, f"{t.dtype}:{list(t.shape)}", t
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _leaves(torch, f"{name}[{i}]", item)
    elif value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        yield name, f"value:{value!r}", None
    else:
        raise ConfigError(f"cannot digest the model's state entry {name!r} "
                          f"(a {type(value).__name__})",
                          fix="pass identity='<a name that changes whenever the weights do>'")


def _entries(torch: Any, model: Any) -> Iterator[tuple[str, str, Any | None]]:
    state = model.state_dict(keep_vars=False)
    for name in sorted(state):
        yield from _leaves(torch, name, state[name])


def weights_digest(torch: Any, model: Any) -> str:
    """``blake3:<hex>`` of every state_dict entry of ``model`` (module docstring)."""
    fingerprint = _fingerprint(model)
    with _lock:
        known = _digests.get(model)
    if known is not None and known[0] == fingerprint:
        return known[1]
    h = Hasher()
    for name, header, tensor in _entries(torch, model):
        head = f"{name}\x00{header}".encode()
        h.update(len(head).to_bytes(8, "big") + head)
        if tensor is not None:
            flat = tensor.to("cpu").contiguous().reshape(-1)
            h.update(flat.view(torch.uint8).numpy().tobytes())
    digest = "blake3:" + h.hexdigest()
    with _lock:
        _digests[model] = (fingerprint, digest)
    return digest


def architecture(torch: Any, model: Any) -> str:
    """``blake3:<hex>`` of the model's classes, architecture config fields and the name,
    dtype and shape of every state_dict entry (no tensor bytes)."""
    config = getattr(model, "config", None)
    fields = {k: getattr(config, k, None) for k in _ARCH_FIELDS} if config is not None else {}
    doc = {"model": type(model).__name__, "config": type(config).__name__, "fields": fields,
           "state": [[name, header] for name, header, _ in _entries(torch, model)]}
    h = Hasher()
    h.update(json.dumps(doc, sort_keys=True, default=str).encode())
    return "blake3:" + h.hexdigest()
