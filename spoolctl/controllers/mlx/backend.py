"""The mlx-lm KV backend (``MlxBackend``) of ``LocalCacheController``.

Imports ``mlx`` / ``mlx_lm`` only when a backend is built, so importing the module needs
neither; a missing framework is one ConfigError then.

* Caches are mlx-lm prompt caches (``make_prompt_cache``); mixed layers (windows,
  state-space, quantized KV) come as a ``PromptCache`` that counts its tokens.
* Every operation is non-mutating: ``prefill`` / ``trim`` return a new cache, because the
  controller hands one prepared cache to many generate calls.
* ``serialize`` writes mlx-lm's own prompt-cache file (no pickle) of the used positions;
  ``deserialize`` raises ``CacheFormatError`` (a miss, never a crash) for any other
  format, class, dtype or shape.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from spoolctl.errors import ConfigError

from ..local.decoding import DEFAULT, Decoding
from ..local.mlx_format import (
    PromptCache,
    cache_format,
    copy_state,
    describe_layer,
    dtype_name,
    layers_summary,
    model_digest,
    slice_caches,
    slice_layer,
)
from ..local.render import ChatTemplate, template_source
from . import appmodel, codec, files, generate, import_check
from .adapters import MlxModelState

KIND = "mlx"
#: How many prompt tokens one forward pass takes while prefilling (bounds peak memory).
PREFILL_STEP = 512
#: mlx-lm cache classes stored beyond plain ``KVCache`` (sliding windows, state-space,
#: quantized KV).
FAMILY_CLASSES = {"KVCache", "RotatingKVCache", "ArraysCache", "QuantizedKVCache"}
#: mlx-lm model types refused (docs/controllers.md): each layer's cache is a ``CacheList``
#: (two caches in one layer, e.g. attention + state-space), which spoolctl does not store.
REFUSED_MODEL_TYPES = ("baichuan_m1", "deepseek_v32", "falcon_h1", "longcat_flash")
#: ``kv_bits`` and ``kv_group_size`` values ``mx.quantize`` accepts.
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)
#: mlx-lm's defaults (``generate_step``): group size 64, quantize from token 5000 on.
KV_GROUP_SIZE = 64
QUANTIZED_KV_START = 5000


def check_options(prefill_step: int, model_id: str | None, kv_bits: int | None,
                  kv_group_size: int, quantized_kv_start: int) -> None:
    """One ConfigError for a bad backend option (the constructor's, ``from_loaded``'s)."""
    if not isinstance(prefill_step, int) or prefill_step < 1:
        raise ConfigError("prefill_step must be a positive integer", fix="pass e.g. 512")
    if model_id is not None and (not isinstance(model_id, str) or not model_id.strip()):
        raise ConfigError(f"model_id must be a non-empty string, not {model_id!r}",
                          fix="pass e.g. model_id='acme/llama-3-8b', or leave it out")
    if kv_bits is not None and (type(kv_bits) is not int or kv_bits not in KV_BITS):
        raise ConfigError(f"kv_bits must be one of {KV_BITS} or None, not {kv_bits!r}",
                          fix="pass e.g. kv_bits=4, or leave it out for a full-precision "
                              "cache")
    if type(kv_group_size) is not int or kv_group_size not in KV_GROUP_SIZES:
        raise ConfigError(f"kv_group_size must be one of {KV_GROUP_SIZES}, not "
                          f"{kv_group_size!r}", fix="pass e.g. kv_group_size=64")
    if type(quantized_kv_start) is not int or quantized_kv_start < 0:
        raise ConfigError(f"quantized_kv_start must be an integer >= 0, not "
                          f"{quantized_kv_start!r}", fix="pass e.g. quantized_kv_start=0")


def resolve_model(model: str) -> Path:
    """The directory of a model directory or of a hub id already downloaded."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists() or model.startswith((".", "/", "~")):
        raise ConfigError("model path is not a directory", path=path,
                          fix="pass a transformers-format model directory")
    try:  # a hub id: only what is already downloaded; spoolctl never fetches weights
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:
        raise ConfigError(f"model {model!r} is neither a directory nor in the local hub "
                          "cache", fix="pass a local model directory") from None


def counted(cache: list[Any]) -> PromptCache:
    """A plain mlx-lm cache list as a ``PromptCache``, its token count read from an
    attention layer; ValueError for a state-space-only cache, which keeps no count."""
    offsets = {int(c.offset) for c in cache if hasattr(c, "offset")}
    if len(offsets) != 1:
        raise ValueError("this mlx-lm cache does not say how many tokens it holds (a "
                         "state-space-only model keeps no count): pass "
                         "spoolctl.controllers.mlx.PromptCache(cache) with .tokens set, "
                         "or a file from export_prompt_cache")
    out = PromptCache(cache)
    out.tokens = offsets.pop()
    return out


class MlxBackend:
    """The mlx-lm KV backend of ``LocalCacheController``.

    ``model``: a local model directory, or a hub id already in the local hub cache.
    ``model_id``: what ``params.model`` is normalised to (default: the id as given, else the
    resolved directory). ``kv_bits``: KV layers become ``QuantizedKVCache``
    (``kv_group_size``) at exactly token ``quantized_kv_start``, so a stored cache equals a
    cold prefill. ``adapter_path``: LoRA / DoRA adapters to load; adapters loaded later
    are keyed too (``model_state``). ConfigError for a bad option, model or framework.
    """

    kind = KIND

    def __init__(self, model: str | os.PathLike[str], *, prefill_step: int = PREFILL_STEP,
                 model_id: str | None = None, kv_bits: int | None = None,
                 kv_group_size: int = KV_GROUP_SIZE,
                 quantized_kv_start: int = QUANTIZED_KV_START,
                 adapter_path: str | os.PathLike[str] | None = None):
        mlx_lm = self._bind(prefill_step, model_id, kv_bits, kv_group_size, quantized_kv_start)
        self.model_name = os.fspath(model)
        model_dir = resolve_model(self.model_name)
        self.model_dir: Path | None = model_dir
        self.model_path: Path | None = model_dir
        is_dir = Path(self.model_name).expanduser().is_dir()
        self.model_id = model_id or (str(model_dir) if is_dir else self.model_name)
        if adapter_path is not None and not (Path(adapter_path) / "adapter_config.json").is_file():
            raise ConfigError("not an mlx-lm adapter directory (no adapter_config.json)",
                              path=os.fspath(adapter_path),
                              fix="pass a directory written by mlx_lm.lora (adapter_config.json "
                                  "and adapters.safetensors)")
        try:
            # a pair without return_config (the stub types the triple too)
            self.model, self.tokenizer = mlx_lm.load(  # type: ignore[misc]
                str(model_dir),
                adapter_path=os.fspath(adapter_path) if adapter_path is not None else None)
        except Exception as exc:  # mlx-lm raises whatever its model code hits (TypeError...)
            why = " ".join(str(exc).split())[:300]
            raise ConfigError(f"mlx-lm cannot load the model ({type(exc).__name__}: {why})",
                              path=self.model_dir,
                              fix="check config.json and the weights are a complete model of "
                                  "an architecture this mlx-lm supports") from None
        self._adopt({"model_digest": model_digest(model_dir)})

    @classmethod
    def from_loaded(cls, model: Any, tokenizer: Any, *, identity: str | None = None,
                    model_id: str | None = None, prefill_step: int = PREFILL_STEP,
                    kv_bits: int | None = None, kv_group_size: int = KV_GROUP_SIZE,
                    quantized_kv_start: int = QUANTIZED_KV_START) -> MlxBackend:
        """A backend of a model the application already loaded (``mlx_lm.load``'s pair;
        quantized, ``mx.compile``-d or with adapters as the app likes); the contract is in
        docs/controllers.md. ``identity=None``: the weights are named by the digest of
        every base parameter (``appmodel``), once per model object. ``identity="..."``:
        the caller's name for these weights, a promise that it changes whenever they do;
        the architecture is still part of the identity, and a name this process already
        saw on another architecture is a ConfigError. Other options: as the constructor."""
        self = cls.__new__(cls)
        self._bind(prefill_step, model_id, kv_bits, kv_group_size, quantized_kv_start)
        self.model, self.tokenizer, source = appmodel.check_loaded(model, tokenizer)
        self.model_name = source or type(self.model).__name__
        self.model_dir = Path(source) if source and Path(source).is_dir() else None
        self.model_path = self.model_dir
        self.model_id = model_id or self.model_name
        self._adopt(appmodel.weights_fields(self.mx, self.model, identity))
        return self

    def _bind(self, prefill_step: int, model_id: str | None, kv_bits: int | None,
              kv_group_size: int, quantized_kv_start: int) -> Any:
        """Check the options and import mlx / mlx_lm (one ConfigError without them);
        returns the ``mlx_lm`` module."""
        try:
            import mlx.core as mx
            import mlx_lm
            from mlx_lm.models import cache as mlx_cache
        except ImportError as exc:
            raise ConfigError(f"mlx-lm is not usable here ({exc})",
                              fix="pip install 'spoolctl[mlx]' (on Linux: 'mlx-lm[cpu]')") from None
        check_options(prefill_step, model_id, kv_bits, kv_group_size, quantized_kv_start)
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        self.quantized_kv_start = quantized_kv_start
        self.mx: Any = mx
        self.cache_mod: Any = mlx_cache
        self.mlx_lm_version = str(mlx_lm.__version__)
        self.mlx_version = str(mx.__version__)  # type: ignore[attr-defined]  # no stub
        self.format = cache_format(self.mlx_lm_version)
        self.prefill_step = prefill_step
        self.lock = threading.RLock()
        return mlx_lm

    def _adopt(self, weights: dict[str, str]) -> None:
        """Probe the loaded ``self.model`` and fix the identity (``weights`` names them)."""
        self._probe()
        kv_bits = self.kv_bits
        self._identity = {
            "framework": "mlx-lm",
            "mlx_lm_version": self.mlx_lm_version,
            "mlx_version": self.mlx_version,
            "cache_format": self.format,
            "model": self.model_id,
            **weights,
            "dtype": self.dtype,
            "device": self.device,
            **({"cache_layers": layers_summary(self.layers)} if self.layers is not None else {}),
            **({"kv_bits": str(kv_bits), "kv_group_size": str(self.kv_group_size),
                "quantized_kv_start": str(self.quantized_kv_start)} if kv_bits is not None
               else {}),
        }
        self._state = MlxModelState(self.mx, self.model)

    def model_state(self) -> dict[str, str]:
        """The identity fields of the LoRA layers acting on the base weights now (``{}``:
        the model as loaded without adapters; ``adapters``). ``UnidentifiedModel`` for
        a change it cannot name (a base weight replaced, another model object)."""
        return self._state.extra(self.model)

    # -- setup ---------------------------------------------------------------------------

    def _probe(self) -> None:
        """Learn the cache layout (classes, dtype, KV shape) from a one-token forward."""
        mx = self.mx
        cache = self.cache_mod.make_prompt_cache(self.model)
        classes = {type(c).__name__ for c in cache}
        if not classes <= FAMILY_CLASSES:
            model_type = getattr(getattr(self.model, "args", None), "model_type", None)
            raise ConfigError(
                f"model type {model_type!r} uses mlx-lm cache types {sorted(classes)}; "
                f"spoolctl stores {', '.join(sorted(FAMILY_CLASSES))}", path=self.model_dir,
                fix="use a model whose mlx-lm prompt cache has only those layer types, or "
                    "PyTorchCacheController for this model")
        if self.kv_bits is not None and "RotatingKVCache" in classes:
            raise ConfigError("mlx-lm cannot quantize a sliding-window (RotatingKVCache) "
                              "cache", path=self.model_dir,
                              fix="leave kv_bits out for this model")
        with self.lock:
            self.model(mx.array([[0]]), cache=cache)
            mx.eval([c.state for c in cache])
        #: Per-layer description of a cache that is not all ``KVCache`` (None: the plain
        #: full-attention layout): class, window, K/V dims, state shapes.
        self.layers: list[dict[str, Any]] | None = None
        self.classes = [type(c).__name__ for c in cache]
        if classes != {"KVCache"} or self.kv_bits is not None:
            self.layers = [describe_layer(c) for c in cache]
        #: Layers and classes of a cache that has not reached ``quantized_kv_start`` yet.
        self._plain_layers, self._plain_classes = self.layers, self.classes
        if self.kv_bits is not None:
            try:
                quantized = self._quantized(cache)
                mx.eval([c.state for c in quantized])
            except ValueError as exc:  # mx.quantize: a head dim the group size does not divide
                raise ConfigError(f"mlx cannot quantize this model's KV cache: {exc}",
                                  path=self.model_dir,
                                  fix="pass a kv_group_size that divides the head dim "
                                      "(32, 64 or 128)") from None
            self.layers = [describe_layer(c) for c in quantized]
            self.classes = [type(c).__name__ for c in quantized]
        first = next((c for c in cache if getattr(c, "keys", None) is not None), None)
        self.num_layers = len(cache)
        self.kv_heads = int(first.keys.shape[1]) if first is not None else 0
        self.k_head_dim = int(first.keys.shape[3]) if first is not None else 0
        self.v_head_dim = int(first.values.shape[3]) if first is not None else 0
        self.dtype = dtype_name(first.keys.dtype) if first is not None else \
            dtype_name(next(a for a in cache[0].cache if a is not None).dtype)
        self.device = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
        self.eos_ids = {int(t) for t in (getattr(self.tokenizer, "eos_token_ids", None) or ())}
        bos = getattr(self.tokenizer, "bos_token_id", None)
        plain = self.tokenizer.encode("a", add_special_tokens=False)
        full = self.tokenizer.encode("a")
        # Prepend BOS to the first segment only if this tokenizer adds one itself,
        # so segment-wise ids equal what mlx-lm would feed for the whole prompt.
        self._bos = [int(bos)] if bos is not None and full[:1] == [bos] and \
            plain[:1] != [bos] else []

    # -- protocol --------------------------------------------------------------------------

    def identity(self) -> dict[str, str]:
        return dict(self._identity)

    def tokenize_segments(self, segments: list[str], *, bos: bool = True) -> list[list[int]]:
        out = [[int(t) for t in self.tokenizer.encode(s, add_special_tokens=False)]
               for s in segments]
        if out and bos and self._bos:
            out[0] = self._bos + out[0]
        return out

    def chat_template(self) -> ChatTemplate | None:
        """mlx-lm's chat template of this tokenizer (None if it has none)."""
        tok = self.tokenizer
        if not getattr(tok, "has_chat_template", False):
            return None
        custom = getattr(tok, "_chat_template", None)  # an mlx-lm renderer module, if any
        extra = f"{getattr(custom, '__module__', '')}.{getattr(custom, '__name__', '')}" \
            if custom is not None else ""

        def apply(messages: list[dict], *, tools: Any, add_generation_prompt: bool,
                  **kwargs: Any) -> str:
            return tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           **kwargs)

        return ChatTemplate(apply=apply,
                            source=template_source(getattr(tok, "chat_template", None), extra))

    def new_cache(self) -> list[Any]:
        if self.layers is not None:
            return self._quantize_at_start(
                PromptCache(self.cache_mod.make_prompt_cache(self.model)))
        return self.cache_mod.make_prompt_cache(self.model)

    def _quantized(self, cache: Sequence[Any]) -> list[Any]:
        """mlx-lm's own conversion (``to_quantized``) of every KV layer of ``cache``."""
        return [c.to_quantized(group_size=self.kv_group_size, bits=self.kv_bits)
                if type(c).__name__ == "KVCache" else c for c in cache]

    def _quantize_at_start(self, cache: PromptCache) -> PromptCache:
        """``cache``, its KV layers converted in place once it holds ``quantized_kv_start``
        tokens (what mlx-lm's ``maybe_quantize_kv_cache`` does, at an exact token)."""
        if self.kv_bits is not None and cache.tokens >= self.quantized_kv_start and \
                any(type(c).__name__ == "KVCache" for c in cache):
            cache[:] = self._quantized(cache)
        return cache

    def expected_layout(self, token_count: int) -> tuple[list[str], list[dict[str, Any]] | None]:
        """Layer classes and descriptions of a cache of ``token_count`` tokens."""
        if self.kv_bits is not None and token_count < self.quantized_kv_start:
            return self._plain_classes, self._plain_layers
        return self.classes, self.layers

    @property
    def trimmable(self) -> bool:
        """Whether every cache can be cut back to a shorter prefix: all ``KVCache``, or all
        quantized from the first token (``quantized_kv_start=0``: quantized per token, so a
        cut keeps exactly the shorter prefix's bytes). A rotated window, a recurrent state,
        or a cache quantized from a later token (cutting below it would need the
        full-precision values) only serves prompts that extend it whole."""
        if self.kv_bits is not None:
            return self.quantized_kv_start == 0 and set(self.classes) == {"QuantizedKVCache"}
        return self.layers is None

    def clone(self, cache: Sequence[Any]) -> list[Any]:
        """An independent copy (cheaper than ``deepcopy``: only the used tokens)."""
        return self.copy_cache(cache)

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(tokens)))

    @staticmethod
    def size(cache: Sequence[Any]) -> int:
        """Tokens the cache covers."""
        if isinstance(cache, PromptCache):
            return cache.tokens
        return int(cache[0].offset) if cache else 0

    def length(self, cache: Sequence[Any]) -> int:
        return self.size(cache)

    def copy_cache(self, cache: Sequence[Any], keep: int | None = None) -> list[Any]:
        """An independent cache holding the first ``keep`` (default: all) tokens.

        Slicing makes new arrays, so writes into the copy (mlx-lm assigns into its
        buffers in place) never reach the original.
        """
        if self.layers is not None:
            return self._copy_layers(cache, keep)
        if len(cache) != self.num_layers or \
                any(type(c).__name__ != "KVCache" for c in cache):
            raise ValueError("not a prompt cache of this model")
        size = self.size(cache)
        keep = size if keep is None else keep
        if not 0 <= keep <= size:
            raise ValueError(f"cannot keep {keep} tokens of a {size}-token cache")
        return slice_caches(cache, keep, self.cache_mod.KVCache)

    def _copy_layers(self, cache: Sequence[Any], keep: int | None) -> list[Any]:
        """A copy of a mixed-layer cache (new arrays, so mlx-lm's in-place writes into the
        copy never reach the original), cut back to ``keep`` only where mlx-lm can do it
        exactly (a window that has not rotated; never a recurrent state). A plain mlx-lm
        list (``make_prompt_cache``, ``load_prompt_cache``: an import) counts its tokens by
        its attention layers' ``offset``."""
        if not isinstance(cache, PromptCache) and isinstance(cache, list):
            cache = counted(cache)
        if not isinstance(cache, PromptCache) or \
                [type(c).__name__ for c in cache] != self.expected_layout(cache.tokens)[0]:
            raise ValueError("not a prompt cache of this model")
        size = self.size(cache)
        keep = size if keep is None else keep
        if self.kv_bits is not None:
            return self._copy_quantizing(cache, keep)
        out = PromptCache(type(c).from_state(copy_state(self.mx, c.state)) for c in cache)
        out.tokens = size
        if keep != size:
            if not 0 <= keep < size or not self.cache_mod.can_trim_prompt_cache(out):
                raise ValueError(f"this model's cache ({', '.join(sorted(set(self.classes)))}) "
                                 f"cannot be cut back from {size} to {keep} tokens")
            if self.cache_mod.trim_prompt_cache(out, size - keep) != size - keep:
                raise ValueError("mlx-lm trimmed fewer tokens than asked")
            out.tokens = keep
        return out

    def _copy_quantizing(self, cache: PromptCache, keep: int) -> PromptCache:
        """``_copy_layers`` for a ``kv_bits`` model: KV layers (quantized or not yet) are
        sliced to ``keep`` tokens; a recurrent state is copied whole and never cut; a
        quantized cache is never cut below ``quantized_kv_start`` (the tokens before it
        were quantized from full-precision values the cache no longer holds)."""
        size = cache.tokens
        if keep != size:
            kinds = {type(c).__name__ for c in cache}
            if not 0 <= keep < size or not kinds <= {"KVCache", "QuantizedKVCache"} or \
                    ("QuantizedKVCache" in kinds and keep < self.quantized_kv_start):
                raise ValueError(f"this model's cache ({', '.join(sorted(kinds))}) cannot be "
                                 f"cut back from {size} to {keep} tokens")
        out = PromptCache(
            slice_layer(c, keep) if type(c).__name__ in ("KVCache", "QuantizedKVCache")
            else type(c).from_state(copy_state(self.mx, c.state)) for c in cache)
        out.tokens = keep
        return out

    def prefill(self, cache: Sequence[Any] | None, tokens: Sequence[int]) -> list[Any]:
        """A new cache: ``cache`` (not modified) extended by ``tokens``."""
        mx = self.mx
        with self.lock:
            out: Any = self.copy_cache(cache) if cache is not None else self.new_cache()
            start = 0
            while start < len(tokens):
                end = min(start + self.prefill_step, len(tokens))
                if self.kv_bits is not None and \
                        out.tokens < self.quantized_kv_start < out.tokens + end - start:
                    end = start + self.quantized_kv_start - out.tokens  # convert right there
                chunk = mx.array([list(tokens[start:end])])
                self.model(chunk, cache=out)
                if isinstance(out, PromptCache):
                    out.tokens += end - start
                    self._quantize_at_start(out)
                mx.eval([c.state for c in out])
                start = end
            return out

    def trim(self, cache: Sequence[Any], keep_tokens: int) -> list[Any]:
        """A new cache holding the first ``keep_tokens`` tokens (mlx-lm's own trim)."""
        if self.layers is not None:
            return self._copy_layers(cache, keep_tokens)
        out = self.copy_cache(cache)
        if not self.cache_mod.can_trim_prompt_cache(out):
            raise ValueError("this prompt cache cannot be trimmed")
        drop = self.size(out) - keep_tokens
        if drop < 0 or keep_tokens < 0:
            raise ValueError(f"cannot keep {keep_tokens} tokens of a {self.size(out)}-token cache")
        if drop and self.cache_mod.trim_prompt_cache(out, drop) != drop:
            raise ValueError("mlx-lm trimmed fewer tokens than asked")
        return out

    # -- the parts in modules of their own, each a function of the backend ------------------

    def serialize(self, cache: Sequence[Any], token_count: int
                  ) -> tuple[dict[str, bytes | memoryview], dict]:
        """mlx-lm prompt-cache bytes of the first ``token_count`` tokens, plus layout meta
        (``codec``)."""
        return codec.serialize(self, cache, token_count)

    def check_layout(self, layout: Mapping[str, Any], token_count: int) -> None:
        """Raise CacheFormatError unless ``layout`` describes a cache this backend can load."""
        codec.check_layout(self, layout, token_count)

    def deserialize(self, objects: Mapping[str, memoryview | bytes], layout: Mapping[str, Any],
                    token_count: int) -> list[Any]:
        """Rebuild a cache from ``serialize`` output; CacheFormatError on any mismatch."""
        return codec.deserialize(self, objects, layout, token_count)

    def generate(self, cache: Sequence[Any] | None, cached_tokens: int,
                 prompt_tokens: Sequence[int], max_new_tokens: int,
                 decoding: Decoding = DEFAULT) -> list[int]:
        """Continuation of ``prompt_tokens`` (``generate.generate``)."""
        return generate.generate(self, cache, cached_tokens, prompt_tokens,
                                     max_new_tokens, decoding)

    def check_import(self, cache: Sequence[Any], tokens: Sequence[int], *,
                     full: bool = True) -> None:
        """Check that ``cache`` holds ``tokens`` for this model; ValueError on a mismatch
        (``import_check.check_import``)."""
        import_check.check_import(self, cache, tokens, full=full)

    def save_file(self, cache: Sequence[Any], tokens: Sequence[int],
                  path: str | os.PathLike[str]) -> None:
        """Write ``cache`` as an mlx-lm ``save_prompt_cache`` file (with the token ids)."""
        files.save_file(self, cache, tokens, path)

    def load_file(self, path: str | os.PathLike[str]) -> tuple[list[Any], list[int] | None]:
        """An mlx-lm prompt-cache file: (cache, token ids if the file records them)."""
        return files.load_file(self, path)
