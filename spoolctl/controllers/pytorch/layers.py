"""Per-layer cache states of transformers caches beyond full attention (torch adapter part).

transformers 5.x builds a ``DynamicCache`` from the model config with one layer object per
model layer; four kinds carry what a prompt leaves behind:

* ``full``: ``DynamicLayer`` -- K/V of every token, ``[1, heads, tokens, head_dim]``.
* ``sliding``: ``DynamicSlidingWindowLayer`` -- K/V of the last ``window - 1`` tokens.
* ``state``: ``LinearAttentionLayer`` (Mamba, linear attention, short convolutions) --
  per state index a conv state and a recurrent state of fixed shape, whatever the length.
* ``hybrid`` / ``hybrid_sliding``: both in one layer.

The layout (``describe``) names each layer's kind, window, K/V dims and state shapes and
dtypes; an entry is loaded only into a model whose layout is equal, so a model of another
family (or the same family with another window) never reads it. Tensor names: ``k{i}`` /
``v{i}`` (attention), ``c{i}_{j}`` / ``r{i}_{j}`` (conv / recurrent state ``j``).

Reuse: a full-attention cache can be cut back to any shorter prefix; a sliding layer only
while it still holds every token (length < window); a recurrent state never (it is a
function of the whole prefix). Every kind can be extended forward.
"""

from __future__ import annotations

from typing import Any

#: Attribute on a cache without attention layers that records how many tokens it holds
#: (transformers' recurrent layers do not count tokens).
TOKENS_ATTR = "spoolctl_tokens"
LAYOUT_NAME = "hf-layers/v1"
#: The transformers cache layer classes ``layer_kind`` accepts (docs/controllers.md lists them).
STORED_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer", "LinearAttentionLayer",
                 "LinearAttentionAndFullAttentionLayer",
                 "LinearAttentionAndSlidingWindowAttentionLayer")


def _classes() -> dict[str, type]:
    from transformers import cache_utils as cu

    return {"full": cu.DynamicLayer, "sliding": cu.DynamicSlidingWindowLayer,
            "state": cu.LinearAttentionCacheLayerMixin}


def layer_kind(layer: Any) -> str:
    """``full`` | ``sliding`` | ``state`` | ``hybrid`` | ``hybrid_sliding``; ValueError for a
    layer kind spoolctl cannot store exactly (indexed, static, quantized...)."""
    c = _classes()
    name = type(layer).__name__
    state = isinstance(layer, c["state"])
    if type(layer) is c["full"]:
        return "full"
    if type(layer) is c["sliding"]:
        return "sliding"
    if name == "LinearAttentionLayer":
        return "state"
    if name == "LinearAttentionAndFullAttentionLayer" and state:
        return "hybrid"
    if name == "LinearAttentionAndSlidingWindowAttentionLayer" and state:
        return "hybrid_sliding"
    raise ValueError(f"cache layer {name} is not one spoolctl can store")


def only_full(cache: Any) -> bool:
    """Whether every layer is plain full attention (the v1 layout, trimmable anywhere)."""
    return all(layer_kind(layer) == "full" for layer in cache.layers)


def _has_kv(kind: str) -> bool:
    return kind in ("full", "sliding", "hybrid", "hybrid_sliding")


def _has_state(kind: str) -> bool:
    return kind in ("state", "hybrid", "hybrid_sliding")


def _window(kind: str, layer: Any) -> int | None:
    return int(layer.sliding_window) if kind in ("sliding", "hybrid_sliding") else None


def describe(cache: Any) -> list[dict[str, Any]]:
    """The layout of a cache that has run at least one token: per layer its kind, window,
    K/V dims and state shapes/dtypes (without the batch dimension)."""
    out = []
    for layer in cache.layers:
        kind = layer_kind(layer)
        d: dict[str, Any] = {"kind": kind}
        if (w := _window(kind, layer)) is not None:
            d["window"] = w
        if _has_kv(kind):
            d["kv_heads"], d["head_dim"] = int(layer.keys.shape[1]), int(layer.keys.shape[3])
        if _has_state(kind):
            for attr, key in (("conv_states", "conv"), ("recurrent_states", "recurrent")):
                d[key] = [None if t is None else
                          {"shape": list(t.shape[1:]), "dtype": str(t.dtype).removeprefix("torch.")}
                          for _, t in sorted(getattr(layer, attr).items())]
        out.append(d)
    return out


def summary(layers: list[dict[str, Any]]) -> str:
    """A compact, readable layout string for the identity (run-length per layer code)."""
    codes = []
    for d in layers:
        code = {"full": "F", "sliding": "S", "state": "M", "hybrid": "FM",
                "hybrid_sliding": "SM"}[d["kind"]]
        if "window" in d:
            code += str(d["window"])
        if "kv_heads" in d:
            code += f"h{d['kv_heads']}d{d['head_dim']}"
        for key in ("conv", "recurrent"):
            for s in d.get(key, []):
                code += f"{key[0]}" + ("-" if s is None else "x".join(map(str, s["shape"])))
        codes.append(code)
    runs: list[list[Any]] = []
    for code in codes:
        if runs and runs[-1][0] == code:
            runs[-1][1] += 1
        else:
            runs.append([code, 1])
    return ",".join(c if n == 1 else f"{n}*{c}" for c, n in runs)


def kv_tokens(d: dict[str, Any], tokens: int) -> int:
    """Token positions a layer's K/V hold after ``tokens`` tokens."""
    return min(tokens, d["window"] - 1) if "window" in d else tokens


def tensors(cache: Any, layout: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """Every tensor of ``cache`` by name (detached, contiguous, on the CPU), after checking
    each against ``layout`` for ``tokens`` tokens; ValueError on any mismatch."""
    if len(cache.layers) != len(layout):
        raise ValueError(f"cache has {len(cache.layers)} layers, the model {len(layout)}")
    out = {}
    for i, (layer, d) in enumerate(zip(cache.layers, layout, strict=True)):
        kind = layer_kind(layer)
        if kind != d["kind"] or _window(kind, layer) != d.get("window"):
            raise ValueError(f"cache layer {i} is {kind}, the model's {d['kind']}")
        if _has_kv(kind):
            shape = (1, d["kv_heads"], kv_tokens(d, tokens), d["head_dim"])
            for name, t in ((f"k{i}", layer.keys), (f"v{i}", layer.values)):
                if t is None or tuple(t.shape) != shape:
                    raise ValueError(f"cache tensor {name} has shape "
                                     f"{None if t is None else tuple(t.shape)}, not {shape}")
                out[name] = t.detach().to("cpu").contiguous()
            if "window" in d and int(layer.cumulative_length) != tokens:
                raise ValueError(f"sliding layer {i} has seen {layer.cumulative_length} tokens, "
                                 f"not {tokens}")
        if _has_state(kind):
            for attr, key, p in (("conv_states", "conv", "c"),
                                 ("recurrent_states", "recurrent", "r")):
                for j, spec in enumerate(d[key]):
                    t = getattr(layer, attr).get(j)
                    if spec is None:
                        if t is not None:
                            raise ValueError(f"layer {i} has an unexpected {key} state {j}")
                        continue
                    if t is None or list(t.shape) != [1, *spec["shape"]] or \
                            str(t.dtype).removeprefix("torch.") != spec["dtype"]:
                        raise ValueError(f"layer {i} {key} state {j} does not match {spec}")
                    if not layer.has_previous_state[j] and key == "conv":
                        raise ValueError(f"layer {i} state {j} has not seen the prompt")
                    out[f"{p}{i}_{j}"] = t.detach().to("cpu").contiguous()
    return out


Shapes = dict[str, tuple[tuple[int, ...], str | None]]


def expected(layout: list[dict[str, Any]], tokens: int) -> Shapes:
    """Name -> (shape, dtype or None for the model dtype) of every tensor an entry holds."""
    out: Shapes = {}
    for i, d in enumerate(layout):
        if "kv_heads" in d:
            shape = (1, d["kv_heads"], kv_tokens(d, tokens), d["head_dim"])
            out[f"k{i}"] = out[f"v{i}"] = (shape, None)
        for key, p in (("conv", "c"), ("recurrent", "r")):
            for j, spec in enumerate(d.get(key, [])):
                if spec is not None:
                    out[f"{p}{i}_{j}"] = ((1, *spec["shape"]), spec["dtype"])
    return out


def fill(cache: Any, layout: list[dict[str, Any]], named: dict[str, Any], tokens: int,
         device: Any) -> Any:
    """Put checked tensors (``expected``'s names) into a new cache built from the config."""
    if len(cache.layers) != len(layout):
        raise ValueError("the model's cache has another number of layers")
    for i, (layer, d) in enumerate(zip(cache.layers, layout, strict=True)):
        kind = layer_kind(layer)
        if kind != d["kind"]:
            raise ValueError(f"cache layer {i} is {kind}, the entry's {d['kind']}")
        if _has_kv(kind):
            k, v = named[f"k{i}"].to(device), named[f"v{i}"].to(device)
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            if "window" in d:
                layer.cumulative_length = tokens
        if _has_state(kind):
            for key, p in (("conv", "c"), ("recurrent", "r")):
                for j, spec in enumerate(d[key]):
                    if spec is None:
                        continue
                    t = named[f"{p}{i}_{j}"].to(device)
                    if key == "conv":
                        layer.lazy_initialization(conv_states=t, state_idx=j,
                                                  conv_kernel_size=int(spec["shape"][-1]))
                        layer.conv_states[j].copy_(t)
                    else:
                        layer.lazy_initialization(recurrent_states=t, state_idx=j)
                        layer.recurrent_states[j].copy_(t)
                    layer.has_previous_state[j] = True
    if not any("kv_heads" in d for d in layout):
        setattr(cache, TOKENS_ATTR, tokens)
    return cache


def length(cache: Any) -> int:
    """Tokens a cache holds: its attention length, or (recurrent only) the recorded count."""
    if any(_has_kv(layer_kind(layer)) for layer in cache.layers):
        return int(cache.get_seq_length())
    return int(getattr(cache, TOKENS_ATTR, 0))


def trim_refusal(cache: Any, keep: int) -> str | None:
    """None if ``cache`` can be cut back to ``keep`` tokens exactly, else why not."""
    n = length(cache)
    for layer in cache.layers:
        kind = layer_kind(layer)
        if _has_state(kind):
            return "a recurrent (state-space) state cannot be cut back to a shorter prefix"
        if "sliding" in kind and n >= int(layer.sliding_window) and keep < n:
            return (f"a sliding-window layer (window {layer.sliding_window}) that has seen "
                    f"{n} tokens cannot be cut back")
    return None
