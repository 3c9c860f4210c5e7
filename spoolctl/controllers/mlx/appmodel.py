"""The identity of an mlx-lm model the application loaded itself (``MlxBackend.from_loaded``).

* ``unwrap``: ``mx.compile(model)`` returns a function object that forwards attribute
  access to the module; it is named by, and runs as, the module it wraps (a compiled
  function cannot take mlx-lm's cache objects, and compiling changes how the weights run,
  not what they compute).
* ``weights_digest``: the content digest of every base parameter (name, dtype, shape and
  bytes; a quantized layer by its packed integers, scales and biases, plus its class, bits,
  group size and mode). LoRA / DoRA arrays are left out: the adapters acting are keyed by
  their content per call (``adapters.MlxModelState``). Computed once per model object and
  kept while the model holds the same array objects.
* ``architecture``: what a caller-stated identity is checked against -- the model class,
  its ``args`` and the name, dtype and shape of every base parameter and the quantization
  of every layer (no bytes read).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
import weakref
from typing import Any, cast

from spoolctl.errors import ConfigError
from spoolctl.store import Hasher

from ..local.model_state import StatedIdentities
from .adapters import lora_layers

_lock = threading.Lock()
#: id(model) -> (model ref, (name, array id) per parameter, the arrays held so their ids
#: stay unique, digest); an entry goes when its model does
_digests: dict[int, tuple[weakref.ref[Any], tuple[tuple[str, int], ...], list[Any], str]] = {}
#: refuses an identity stated before, in this process, for another architecture
check_stated = StatedIdentities(
    differs="other class, args, parameter shapes or quantization",
    fix="state a new identity for each model and each set of weights, or leave identity "
        "out to name the weights by their digest").check


def unwrap(model: Any) -> Any:
    """The module an ``mx.compile`` wrapper calls (the model itself if it is a module)."""
    import mlx.nn as nn

    if isinstance(model, nn.Module) and not issubclass(type(model), nn.Module):
        # the wrapper answers isinstance and every attribute as the module it wraps
        roots = [m for name, m in model.named_modules() if name == ""]
        if len(roots) == 1 and issubclass(type(roots[0]), nn.Module):
            return roots[0]
    return model


def _base_name(name: str, lora: dict[str, set[int]]) -> str:
    """``name`` as it is without LoRA layers (a LoRA layer holds its base as ``linear``)."""
    for layer in lora:
        if name.startswith(f"{layer}.linear.") or name == f"{layer}.linear":
            return layer + name[len(layer) + len(".linear"):]
    return name


def _base_parameters(model: Any) -> list[tuple[str, Any]]:
    """``(name, array)`` of every parameter not held by a LoRA / DoRA layer, by its name
    without LoRA layers, so a model with adapters has its base's names."""
    from mlx.utils import tree_flatten

    lora = lora_layers(model)
    owned = set().union(*lora.values())
    flat = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    return sorted(((_base_name(n, lora), a) for n, a in flat if id(a) not in owned),
                  key=lambda na: na[0])


def _quantization(model: Any) -> list[list[Any]]:
    """Every quantized layer: path, class, bits, group size, mode (how its ints read)."""
    lora = lora_layers(model)
    return sorted([_base_name(name, lora), type(m).__name__, getattr(m, "bits", None),
                   getattr(m, "group_size", None), getattr(m, "mode", None)]
                  for name, m in model.named_modules()
                  if hasattr(m, "bits") and hasattr(m, "group_size"))


def _raw(mx: Any, a: Any) -> memoryview:
    """The bytes of an array (bfloat16 has no buffer format: read as uint16)."""
    flat = a.reshape(-1)
    return memoryview(flat.view(mx.uint16) if a.dtype == mx.bfloat16 else flat).cast("B")


def weights_digest(mx: Any, model: Any) -> str:
    """``blake3:<hex>`` of the base parameters and quantization of ``model`` (module
    docstring); one pass over the bytes per model object and set of arrays."""
    params = _base_parameters(model)
    key = tuple((name, id(a)) for name, a in params)
    with _lock:
        known = _digests.get(id(model))
    if known is not None and known[0]() is model and known[1] == key:
        return known[3]
    h = Hasher(threaded=True)  # the whole model, hashed while the app waits
    quant = json.dumps(_quantization(model), default=str).encode()
    h.update(len(quant).to_bytes(8, "big") + quant)
    for name, a in params:
        head = f"{name}\x00{a.dtype}:{list(a.shape)}".encode()
        h.update(len(head).to_bytes(8, "big") + head)
        h.update(_raw(mx, a))
    digest = "blake3:" + h.hexdigest()
    ref = weakref.ref(model, functools.partial(_forget, id(model)))
    with _lock:
        _digests[id(model)] = (ref, key, [a for _, a in params], digest)
    return digest


def _forget(key: int, _: object) -> None:
    with _lock:
        _digests.pop(key, None)


def architecture(model: Any) -> str:
    """``blake3:<hex>`` of the model class, its ``args``, the name, dtype and shape of every
    base parameter and every layer's quantization (no array bytes)."""
    args = getattr(model, "args", None)
    fields = dataclasses.asdict(args) if dataclasses.is_dataclass(args) and \
        not isinstance(args, type) else repr(args)
    doc = {"model": f"{type(model).__module__}.{type(model).__name__}", "args": fields,
           "params": [[n, str(a.dtype), list(a.shape)] for n, a in _base_parameters(model)],
           "quantization": _quantization(model)}
    h = Hasher()
    h.update(json.dumps(doc, sort_keys=True, default=str).encode())
    return "blake3:" + h.hexdigest()


def check_loaded(model: Any, tokenizer: Any) -> tuple[Any, Any, str | None]:
    """``(module, TokenizerWrapper, source directory or None)`` of what the app handed
    over; one ConfigError for what is no mlx-lm model or tokenizer."""
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    base = unwrap(model)
    if not issubclass(type(base), nn.Module) or not hasattr(base, "layers"):
        raise ConfigError(f"not an mlx-lm model: a {type(base).__name__}",
                          fix="pass the model mlx_lm.load() returned (quantized, compiled or "
                              "with adapters is fine)")
    if not isinstance(tokenizer, TokenizerWrapper):
        if not callable(getattr(tokenizer, "encode", None)) or \
                not callable(getattr(tokenizer, "decode", None)):
            raise ConfigError(f"not a tokenizer: a {type(tokenizer).__name__}",
                              fix="pass the tokenizer mlx_lm.load() returned")
        tokenizer = TokenizerWrapper(tokenizer)
    source = getattr(tokenizer, "name_or_path", None)
    return base, tokenizer, source if isinstance(source, str) and source else None


def weights_fields(mx: Any, model: Any, identity: str | None) -> dict[str, str]:
    """The identity fields naming the weights of a handed-over model: the digest of its
    parameters, or the caller's stated name bound to the architecture (checked)."""
    if identity is None:
        return {"model_digest": f"params:{weights_digest(mx, model)}"}
    if not isinstance(identity, str) or not identity.strip():
        raise ConfigError(f"identity must be a non-empty string, not {identity!r}",
                          fix="pass e.g. identity='acme-8b-4bit@3f1c2a9', or leave it out "
                              "to name the weights by their digest")
    arch = architecture(model)
    check_stated(identity, arch)
    return {"model_digest": f"stated:{identity}", "architecture": arch}
