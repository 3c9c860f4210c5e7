"""The PyTorch (transformers) backend of the local controller, and its controller.

This is the only spoolctl module that imports torch / transformers / safetensors
(lazily, in ``PyTorchBackend.__init__``). KV tensors are stored as one
safetensors object (``kv``: ``k0, v0, k1, v1, ...``, each ``[1, kv_heads,
tokens, head_dim]``); nothing is ever pickled or ``torch.load``-ed. Loading checks
names, count, shapes and dtype against the loaded model before a tensor reaches
it.

Supported: transformers >= 5.19, < 5.24 (``cache.layers[i].keys/values``, negative
``crop``; ``pyproject.toml`` bounds the ``torch`` extra to it). The cache argument
of ``forward`` / ``generate`` is read from the model's signature once: ``cache=``
where the model takes it (5.24 renamed it and deprecates ``past_key_values=``),
else ``past_key_values=`` (in 5.19 ``cache=`` is swallowed by ``**kwargs`` and the
cache silently not extended) -- decision 1705. Decoding is transformers' own
``model.generate`` (sampling, streamers, logits processors), continued from the
cache; a prefill checks that the model really extended the given cache.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spoolctl.errors import ConfigError
from spoolctl.store import Hasher

from . import pytorch_appmodel as appmodel
from . import pytorch_layers as hf_layers
from .local.deadlines import DEFAULT_LOOKUP_DEADLINE_S, DEFAULT_READ_DEADLINE_S
from .local.decoding import DEFAULT, Decoding
from .local.engine import DEFAULT_LOCK_TIMEOUT, DEFAULT_MEMORY_ENTRIES, LocalCacheController
from .local.render import ChatTemplate, template_source
from .local.safetensors_layout import tiling_error
from .pytorch_adapters import TorchModelState

KV_OBJECT = "kv"
DTYPES = ("float32", "float16", "bfloat16")
MAX_HEADER = 16 << 20  # a KV header lists 2 tensors per layer: far below this
PREFILL_CHUNK = 512  # tokens per forward: bounds attention memory on long prompts
_HASH_BLOCK = 8 << 20
# Files whose bytes define the model's outputs for given token ids.
_MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".tiktoken", ".py",
                        ".jinja")
#: Relative tolerance of ``check_import``'s recomputed positions, by dtype (a batched and a
#: one-token forward differ by rounding; a cache of another token differs by O(1)).
_IMPORT_RTOL = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 6e-2}
IMPORT_CHECKS = 4  # positions an imported cache's "sample" check recomputes


def quiet_frameworks() -> None:
    """Silence transformers' progress bars and info logs (for the CLI and the demo)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def model_digest(model_dir: Path) -> str:
    """Digest of every file that defines the model (config, tokenizer, weights).

    Hashing the weights costs about a second per 3 GB once per process; it makes a
    retrained model at the same path a different namespace, so its caches are never
    mixed up (pass ``trusted_revision=`` to vouch for the files instead).
    """
    h = Hasher()
    files = sorted(p for p in model_dir.rglob("*")
                   if p.is_file() and p.suffix in _MODEL_FILE_SUFFIXES
                   and not p.name.startswith("."))
    if not files:
        raise ConfigError("no model files found", path=model_dir,
                          fix="pass a directory written by save_pretrained()")
    for path in files:
        rel = path.relative_to(model_dir).as_posix().encode()
        h.update(len(rel).to_bytes(8, "big") + rel)
        with open(path, "rb") as f:
            while block := f.read(_HASH_BLOCK):
                h.update(block)
        h.update(b"\x00")
    return h.hexdigest()


class PyTorchBackend:
    """A transformers causal LM loaded with ``from_pretrained`` from a local directory.

    ``dtype``: "float32" | "float16" | "bfloat16" | None (default: what transformers
    loads, the checkpoint's own dtype).
    ``device``: a torch device string ("cpu", "cuda", "cuda:1", "mps"); one this torch
    cannot use is a ConfigError.
    ``revision``: a name for this version of the model (e.g. the hub revision it was
    downloaded at), recorded in the identity next to the content digest of the files,
    which is always computed: a revision name never turns change detection off.
    ``trusted_revision``: a caller-vouched identifier used *instead of* hashing the files
    (for huge checkpoints whose every change comes with a new identifier); a changed file
    under the same identifier is not detected (decision 2103).
    ``model_id``: the name ``params.model`` is normalised to (default: the resolved
    model directory); also the model in the identity, so a vouched id keeps caches
    valid when the directory moves.
    """

    kind = "pytorch"

    def __init__(self, model: str | os.PathLike[str], *, dtype: str | None = None,
                 device: str = "cpu", revision: str | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, model_id: str | None = None,
                 trusted_revision: str | None = None):
        if model_id is not None and (not isinstance(model_id, str) or not model_id.strip()):
            raise ConfigError(f"model_id must be a non-empty string, not {model_id!r}",
                              fix="pass e.g. model_id='acme/llama-3-8b', or leave it out")
        path = Path(model).expanduser()
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ConfigError("not a transformers model directory (no config.json)", path=path,
                              fix="pass a local directory written by save_pretrained()")
        for name, value in (("revision", revision), ("trusted_revision", trusted_revision)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"{name} must be a non-empty string, not {value!r}",
                                  fix=f"pass e.g. {name}='3f1c2a9', or leave it out")
        if dtype is not None and dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {dtype!r}",
                              fix=f"use one of: {', '.join(DTYPES)}")
        torch, transformers = self._bind_frameworks(prefill_chunk)
        self.path: Path | None = path.resolve()
        self.model_path = self.path
        self.model_id = model_id or str(path.resolve())
        self.prefill_chunk = prefill_chunk
        self.device = _usable_device(torch, device)
        dtype_kw: dict[str, Any] = {}
        if dtype is not None:
            dtype_kw["dtype" if self._v5 else "torch_dtype"] = getattr(torch, dtype)
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.resolve()))
            self.model = transformers.AutoModelForCausalLM.from_pretrained(str(path.resolve()),
                                                                           **dtype_kw)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load the model: {str(exc)[:300]}", path=self.path,
                              fix="check the directory holds a causal LM and its tokenizer") \
                from None
        self.model.to(self.device).eval()
        self._revision = revision
        self._trusted_revision = trusted_revision
        self._stated: str | None = None
        self._run: Any = self.model
        self._adopt()

    @classmethod
    def from_loaded(cls, model: Any, tokenizer: Any, *, identity: str | None = None,
                    model_id: str | None = None,
                    prefill_chunk: int = PREFILL_CHUNK) -> PyTorchBackend:
        """A backend of a model the application already loaded (quantized, compiled, on its
        own device map); the contract is in docs/controllers.md.

        ``identity=None``: the weights are named by the digest of every tensor in the
        model's ``state_dict`` (quantized ones by their integers and scales), computed once
        per model object. ``identity="..."``: the caller's name for these weights instead,
        a promise that it changes whenever they do; the model's architecture (classes,
        config, tensor names, dtypes and shapes) is still part of the identity, and a name
        this process already saw on another architecture is a ConfigError.
        A ``torch.compile``-d model runs the prefill forwards compiled and is named by
        the module it wraps. The model is put in eval mode.
        """
        for name, value in (("identity", identity), ("model_id", model_id)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"{name} must be a non-empty string, not {value!r}",
                                  fix=f"pass e.g. {name}='acme-8b-int8@3f1c2a9', or leave it out")
        self = cls.__new__(cls)
        torch, _ = self._bind_frameworks(prefill_chunk)
        base = appmodel.unwrap(model)
        if not isinstance(base, torch.nn.Module) or not callable(getattr(base, "generate", None)) \
                or getattr(base, "config", None) is None:
            raise ConfigError(f"not a transformers causal LM: a {type(base).__name__}",
                              fix="pass the model AutoModelForCausalLM.from_pretrained() "
                                  "returned (quantized or compiled is fine)")
        if not callable(tokenizer) or not hasattr(tokenizer, "decode"):
            raise ConfigError(f"not a transformers tokenizer: a {type(tokenizer).__name__}",
                              fix="pass the tokenizer AutoTokenizer.from_pretrained() returned")
        self.path = None
        self.model_path = None
        self.model_id = model_id or str(getattr(base.config, "_name_or_path", "") or
                                        type(base).__name__)
        self.prefill_chunk = prefill_chunk
        first = next(iter((*base.parameters(), *base.buffers())), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.model = base.eval()
        self.tokenizer = tokenizer
        self._revision = None
        self._trusted_revision = None
        self._stated = identity
        self._run = model
        self._adopt()
        if identity is not None:
            appmodel.check_stated(identity, appmodel.architecture(torch, base))
        return self

    def _bind_frameworks(self, prefill_chunk: int) -> tuple[Any, Any]:
        """Check ``prefill_chunk`` and import torch, safetensors and transformers (one
        ConfigError naming the extra without them); returns (torch, transformers)."""
        if prefill_chunk < 1:
            raise ConfigError("prefill_chunk must be >= 1", fix="use e.g. 512")
        try:
            import safetensors.torch
            import torch
            import transformers
        except ImportError as exc:
            raise ConfigError(f"the PyTorch backend needs torch and transformers ({exc})",
                              fix="pip install 'spoolctl[torch]'") from None
        self._torch = torch
        self._st = safetensors.torch
        self._DynamicCache = transformers.DynamicCache
        self._v5 = int(transformers.__version__.split(".")[0]) >= 5
        return torch, transformers

    def _adopt(self) -> None:
        """Read what the backend needs from ``self.model`` / ``self.tokenizer`` (loaded from
        the directory, or handed over by the application: ``from_loaded``)."""
        self._loaded_model = self.model  # what model_state compares the backend's model to
        self._state: TorchModelState | None = None
        self._cache_arg = cache_argument(self.model.forward)
        self.dtype = next(self.model.parameters()).dtype
        self.config = self.model.config.get_text_config(decoder=True) \
            if hasattr(self.model.config, "get_text_config") else self.model.config
        self.num_layers = int(self.config.num_hidden_layers)
        heads = int(getattr(self.config, "num_attention_heads", None) or 1)
        self.kv_heads = int(getattr(self.config, "num_key_value_heads", None) or heads)
        self.head_dim = int(getattr(self.config, "head_dim", None)
                            or self.config.hidden_size // heads)
        #: Per-layer layout of a model whose cache is not all full attention (None: the
        #: v1 full-attention layout); see ``pytorch_layers``.
        self.layers: list[dict[str, Any]] | None = None
        #: Tokens per forward when continuing a cache that already holds tokens: 1 for
        #: models whose multi-token forward ignores a previous recurrent state.
        self._resume_chunk = self.prefill_chunk
        self._identity: dict[str, str] | None = None
        self._identity_lock = threading.Lock()
        bos = self.tokenizer.bos_token_id
        probe = self.tokenizer("a")["input_ids"]
        self._bos = bos if bos is not None and probe[:1] == [bos] else None
        eos = self.model.generation_config.eos_token_id if self.model.generation_config \
            else None
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self._probe_layers()

    def _probe_layers(self) -> None:
        """Learn the cache layout of a model that is not all full attention: run a few
        tokens, record each layer's kind, window and state shapes, and check whether a
        multi-token forward continues a cache exactly (transformers' Mamba restarts its
        scan from a zero state: such a model is continued one token at a time)."""
        cache = self.new_cache()
        try:
            if not getattr(cache, "layers", None) or hf_layers.only_full(cache):
                return
        except ValueError as exc:
            raise ConfigError(f"the model's cache cannot be stored: {exc}", path=self.path,
                              fix="use a model with full, sliding-window or state-space "
                                  "(Mamba / linear attention) cache layers") from None
        probe = [int(t) % max(2, len(self.tokenizer)) for t in range(3, 11)]
        whole = self._probe_forward(cache, probe)
        self.layers = hf_layers.describe(cache)
        split = self.new_cache()
        self._probe_forward(split, probe[:5])
        resumed = self._probe_forward(split, probe[5:])
        scale = float(whole.abs().max()) + 1e-6
        if float((whole - resumed).abs().max()) > 1e-3 * scale:
            self._resume_chunk = 1

    def _probe_forward(self, cache: Any, tokens: list[int]) -> Any:
        torch = self._torch
        with torch.no_grad():
            ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
            out = self._run(input_ids=ids, use_cache=True, **{self._cache_arg: cache})
        return out.logits[0, -1].float()

    # -- identity / tokens ----------------------------------------------------------------

    def identity(self) -> dict[str, str]:
        with self._identity_lock:
            if self._identity is None:
                import transformers

                self._identity = {
                    "framework": "transformers",
                    "transformers": transformers.__version__,
                    "torch": self._torch.__version__.split("+")[0],
                    "model": self.model_id,
                    **self._weights_fields(),
                    **({"revision_name": self._revision} if self._revision else {}),
                    "dtype": str(self.dtype).removeprefix("torch."),
                    "device": self.device.type,
                    "kv_layout":
                        f"hf-dynamic/L{self.num_layers}/H{self.kv_heads}/D{self.head_dim}"
                        if self.layers is None else
                        f"{hf_layers.LAYOUT_NAME}/{hf_layers.summary(self.layers)}",
                }
                self._state = TorchModelState(self._torch, self._loaded_model)
            return dict(self._identity)

    def _weights_fields(self) -> dict[str, str]:
        """The identity fields naming the weights: the files' digest, a vouched revision,
        or for a handed-over model the digest of its tensors or the caller's stated name
        plus its architecture (``pytorch_appmodel``)."""
        if self.path is None:
            if self._stated is not None:
                return {"revision": f"stated:{self._stated}",
                        "architecture": appmodel.architecture(self._torch, self.model)}
            return {"revision": f"params:{appmodel.weights_digest(self._torch, self.model)}"}
        return {"revision": f"trusted:{self._trusted_revision}" if self._trusted_revision
                else f"blake3:{model_digest(self.path)}"}

    def model_state(self) -> dict[str, str]:
        """The identity fields of the PEFT adapters acting on the base weights now (``{}``:
        the model as loaded; ``pytorch_adapters``). ``UnidentifiedModel`` for a change it
        cannot name (a base weight edited since the identity was computed, an unknown
        wrapper in ``self.model``)."""
        self.identity()
        assert self._state is not None
        return self._state.extra(self.model)

    def tokenize_segments(self, segments: list[str], *, bos: bool = True) -> list[list[int]]:
        """One id list per segment, no special tokens added except (``bos``) the
        tokenizer's BOS in front of the first segment when the tokenizer adds one."""
        ids = [list(x) for x in
               self.tokenizer(list(segments), add_special_tokens=False)["input_ids"]] \
            if segments else []
        if ids and bos and self._bos is not None:
            ids[0] = [self._bos, *ids[0]]
        return ids

    def chat_template(self) -> ChatTemplate | None:
        """The tokenizer's chat template (None if it has none), rendering to text."""
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            return None
        tokenizer = self.tokenizer

        def apply(messages: list[dict], *, tools: Any, add_generation_prompt: bool,
                  **kwargs: Any) -> str:
            return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **kwargs)

        return ChatTemplate(apply=apply, source=template_source(template))

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    # -- cache operations ---------------------------------------------------------------------

    def new_cache(self) -> Any:
        return self._DynamicCache(config=self.model.config) if self._v5 \
            else self._DynamicCache()

    def _kv(self, cache: Any) -> list[tuple[Any, Any]]:
        if hasattr(cache, "layers"):  # transformers 5.x
            return [(layer.keys, layer.values) for layer in cache.layers]
        return list(zip(cache.key_cache, cache.value_cache, strict=True))  # 4.x

    def length(self, cache: Any) -> int:
        if self.layers is not None:
            return hf_layers.length(cache)
        return int(cache.get_seq_length())

    @property
    def extends_by_token(self) -> bool:
        """Whether a cache that holds tokens is continued one token per forward."""
        return self._resume_chunk == 1

    @property
    def trimmable(self) -> bool:
        """Whether a cache of this model can always be cut back to a shorter prefix (full
        attention); otherwise only forward extension is exact (``trim`` refuses)."""
        return self.layers is None

    def _forward(self, cache: Any, tokens: Sequence[int]) -> Any:
        """Run ``tokens`` through the model extending ``cache``; the last position's logits."""
        torch = self._torch
        logits = None
        recurrent_only = self.layers is not None and \
            not any("kv_heads" in d for d in self.layers)
        start = 0
        with torch.no_grad():
            while start < len(tokens):
                before = self.length(cache)
                # A model that cannot resume multi-token runs a cold prefill in one forward
                # (no attention memory to bound) and continues one token at a time.
                step = self.prefill_chunk if self._resume_chunk > 1 else \
                    (len(tokens) if before == 0 else 1)
                chunk = torch.tensor([list(tokens[start:start + step])],
                                     dtype=torch.long, device=self.device)
                out = self._run(input_ids=chunk, use_cache=True, logits_to_keep=1,
                                 **{self._cache_arg: cache})
                if recurrent_only:
                    setattr(cache, hf_layers.TOKENS_ATTR, before + chunk.shape[1])
                elif self.length(cache) != before + chunk.shape[1]:
                    raise RuntimeError("the model did not extend the given KV cache")
                logits = out.logits[0, -1]
                start += chunk.shape[1]
        return logits

    def prefill(self, cache: Any, tokens: list[int]) -> Any:
        if tokens:
            self._forward(cache, tokens)
        return cache

    def trim(self, cache: Any, keep_tokens: int) -> Any:
        length = self.length(cache)
        if not 0 < keep_tokens <= length:
            raise ValueError(f"cannot trim a {length}-token cache to {keep_tokens} tokens")
        if self.layers is not None and \
                (why := hf_layers.trim_refusal(cache, keep_tokens)) is not None:
            raise ValueError(why)
        if keep_tokens < length:
            # Negative crop = tokens to remove: the one form 5.x and 4.57 agree on.
            cache.crop(keep_tokens - length)
        return cache

    def clone(self, cache: Any) -> Any:
        if self.layers is not None:
            n = self.length(cache)
            named = hf_layers.tensors(cache, self.layers, n)
            return hf_layers.fill(self.new_cache(), self.layers,
                                  {k: t.clone() for k, t in named.items()}, n, self.device)
        copy = self.new_cache()
        for i, (k, v) in enumerate(self._kv(cache)):
            copy.update(k.clone(), v.clone(), i)
        return copy

    def _layout(self) -> dict[str, Any]:
        if self.layers is not None:  # what each layer holds (kind, window, state shapes)
            return {"encoding": "safetensors", "object": KV_OBJECT, "cache": hf_layers.LAYOUT_NAME,
                    "layers": self.layers, "dtype": str(self.dtype).removeprefix("torch."),
                    "batch": 1}
        return {"encoding": "safetensors", "object": KV_OBJECT, "layers": self.num_layers,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "dtype": str(self.dtype).removeprefix("torch."), "batch": 1}

    def serialize(self, cache: Any, token_count: int) -> tuple[dict[str, bytes], dict]:
        if self.layers is not None:
            if self.length(cache) != token_count:
                raise ValueError(f"cache holds {self.length(cache)} tokens, not {token_count}")
            named = hf_layers.tensors(cache, self.layers, token_count)
            return {KV_OBJECT: self._st.save(named)}, self._layout()
        tensors = {}
        kv = self._kv(cache)
        if len(kv) != self.num_layers:
            raise ValueError(f"cache has {len(kv)} layers, the model {self.num_layers}")
        for i, (k, v) in enumerate(kv):
            for name, t in ((f"k{i}", k), (f"v{i}", v)):
                if tuple(t.shape) != (1, self.kv_heads, token_count, self.head_dim):
                    raise ValueError(f"cache tensor {name} has shape {tuple(t.shape)}")
                tensors[name] = t.detach().to("cpu").contiguous()
        return {KV_OBJECT: self._st.save(tensors)}, self._layout()

    def deserialize(self, objects: dict[str, memoryview], layout: dict, token_count: int) -> Any:
        if layout != self._layout():
            raise ValueError(f"stored layout {layout} does not match the model {self._layout()}")
        if set(objects) != {KV_OBJECT}:
            raise ValueError(f"expected one object {KV_OBJECT!r}, found {sorted(objects)}")
        tensors = self._tensors_from(objects[KV_OBJECT])
        if self.layers is not None:
            want = hf_layers.expected(self.layers, token_count)
            if sorted(tensors) != sorted(want):
                raise ValueError("stored tensor names do not match the model's layers")
            for name, (shape, dtype) in want.items():
                t = tensors[name]
                dt = self.dtype if dtype is None else getattr(self._torch, dtype)
                if tuple(t.shape) != shape or t.dtype != dt:
                    raise ValueError(f"stored tensor {name} {tuple(t.shape)} {t.dtype} does "
                                     f"not match {shape} {dt}")
            cache = hf_layers.fill(self.new_cache(), self.layers, tensors, token_count,
                                   self.device)
            if self.length(cache) != token_count:
                raise ValueError("loaded cache length differs from the token count")
            return cache
        names = [f"{kind}{i}" for i in range(self.num_layers) for kind in ("k", "v")]
        if sorted(tensors) != sorted(names):
            raise ValueError("stored tensor names do not match the model's layers")
        shape = (1, self.kv_heads, token_count, self.head_dim)
        cache = self.new_cache()
        for i in range(self.num_layers):
            k, v = tensors[f"k{i}"], tensors[f"v{i}"]
            for t in (k, v):
                if tuple(t.shape) != shape or t.dtype != self.dtype:
                    raise ValueError(f"stored tensor {tuple(t.shape)} {t.dtype} does not match "
                                     f"{shape} {self.dtype}")
            cache.update(k.to(self.device), v.to(self.device), i)
        if self.length(cache) != token_count:
            raise ValueError("loaded cache length differs from the token count")
        return cache

    def _tensors_from(self, data: memoryview) -> dict[str, Any]:
        """Parse a safetensors buffer into tensors that VIEW it (no copy; the cache copies
        once when it takes them). Strict: every offset, dtype and size is checked."""
        torch = self._torch
        data = memoryview(data)
        if data.readonly:
            # torch cannot make a tensor that views a read-only buffer without undefined
            # behaviour on write (and warns); the store's verified reads are writable, so
            # only bytes handed in by other callers are copied, once.
            data = memoryview(bytearray(data))
        dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
        if len(data) < 8:
            raise ValueError("KV object too short for a safetensors header")
        n = int.from_bytes(data[:8], "little")
        if not 2 <= n <= min(len(data) - 8, MAX_HEADER):
            raise ValueError("bad safetensors header length")
        try:
            header = json.loads(bytes(data[8:8 + n]))
        except RecursionError:  # absurdly deep nesting: hostile, not a cache we wrote
            raise ValueError("safetensors header is nested too deeply") from None
        if not isinstance(header, dict):
            raise ValueError("safetensors header is not an object")
        body = len(data) - 8 - n
        out: dict[str, Any] = {}
        spans: list[tuple[int, int]] = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
                raise ValueError(f"bad safetensors entry {name!r}")
            # only a str can name a dtype (a list or dict here is unhashable, not a miss)
            dtype = dtypes.get(info["dtype"]) if isinstance(info["dtype"], str) else None
            shape, offsets = info["shape"], info["data_offsets"]
            if dtype is None:
                raise ValueError(f"unsupported tensor dtype {str(info['dtype'])[:20]!r}")
            if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                    and isinstance(offsets, list) and len(offsets) == 2
                    and all(isinstance(o, int) for o in offsets)
                    and 0 <= offsets[0] <= offsets[1] <= body):
                raise ValueError(f"bad shape or offsets for tensor {name!r}")
            numel = math.prod(shape)
            itemsize = torch.empty((), dtype=dtype).element_size()
            if numel * itemsize != offsets[1] - offsets[0] or numel == 0:
                raise ValueError(f"tensor {name!r} size does not match its shape")
            out[name] = torch.frombuffer(data, dtype=dtype, count=numel,
                                         offset=8 + n + offsets[0]).view(shape)
            spans.append((offsets[0], offsets[1]))
        if (why := tiling_error(spans, body)) is not None:
            raise ValueError(f"bad safetensors body: {why}")
        return out

    # -- generation ---------------------------------------------------------------------------

    def resolve(self, decoding: Decoding) -> Decoding:
        """``decoding`` over the model's ``generation_config``: what ``model.generate``
        would sample with where the caller left a setting out (transformers' global
        defaults where the config leaves one out too)."""
        config = self.model.generation_config
        defaults_of = getattr(config, "_get_default_generation_params", None)
        defaults = defaults_of() if callable(defaults_of) else {}

        def value(name: str, fallback: float) -> Any:
            got = getattr(config, name, None)
            return got if got is not None else defaults.get(name, fallback)

        return decoding.over(float(value("temperature", 1.0)) if config.do_sample else 0.0,
                             top_p=float(value("top_p", 1.0)), top_k=int(value("top_k", 0)))

    def _generation_config(self, decoding: Decoding, max_new_tokens: int, *,
                           sample: bool = True) -> Any:
        """The model's generation config (its repetition penalty and every other setting
        ``model.generate`` would use) with spoolctl's length and the resolved sampling
        settings (sampling flags cleared for greedy decoding, so transformers has nothing to
        warn about). ``sample=False``: a seeded sampler in ``logits_processor`` draws the
        token, so transformers' own sampling stays off."""
        config = copy.deepcopy(self.model.generation_config)
        config.max_new_tokens = max_new_tokens
        config.max_length = None
        config.min_new_tokens = None
        sampling = sample and not decoding.greedy
        config.do_sample = sampling
        config.temperature = decoding.temperature if sampling else None
        config.top_p = decoding.top_p if sampling else None
        config.top_k = decoding.top_k if sampling else None
        if config.pad_token_id is None:
            config.pad_token_id = self.tokenizer.pad_token_id \
                if self.tokenizer.pad_token_id is not None else min(self.eos_ids, default=None)
        if self.eos_ids:
            config.eos_token_id = sorted(self.eos_ids)
        return config

    def generate(self, cache: Any | None, cached_tokens: int, prompt_tokens: list[int],
                 max_new_tokens: int, decoding: Decoding = DEFAULT) -> list[int]:
        """``model.generate`` continued from ``cache`` (cloned, never modified): the
        uncached prompt tokens but the last are prefilled in chunks first, so a long
        prompt never runs as one forward. ``decoding`` over the model's own defaults
        (``resolve``)."""
        torch = self._torch
        decoding = self.resolve(decoding)
        if not 0 <= cached_tokens < len(prompt_tokens):
            raise ValueError("the cache must leave at least one prompt token to run")
        if cache is None:
            work, cached_tokens = self.new_cache(), 0
        else:
            if self.length(cache) != cached_tokens:
                raise ValueError("cache length differs from cached_tokens")
            work = self.clone(cache)
        if len(prompt_tokens) - cached_tokens > 1:
            self._forward(work, prompt_tokens[cached_tokens:-1])
        # generate() slices the prompt by the cache's length, except for ``cache_params``
        # (recurrent-only) models, which would run the whole prompt again on top of the
        # state: they get only the uncached last token.
        recurrent = self._cache_arg == "cache_params" and len(prompt_tokens) > 1
        shown = prompt_tokens[-1:] if recurrent else prompt_tokens
        ids = torch.tensor([list(shown)], dtype=torch.long, device=self.device)
        kwargs = {self._cache_arg: work, **decoding.extra}
        seeded = decoding.seed is not None and not decoding.greedy
        if seeded:
            # A generator of this call's own: torch's global one is shared by every thread
            # (two seed=0 calls at once would interleave their draws; decision 2103).
            sampler = self._seeded_sampler(decoding)
            kwargs["logits_processor"] = [*(kwargs.get("logits_processor") or []), sampler]
        try:
            with torch.no_grad():
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), streamer=decoding.streamer,
                    generation_config=self._generation_config(decoding, max_new_tokens,
                                                              sample=not seeded),
                    **kwargs)
        except (TypeError, ValueError) as exc:
            if decoding.extra:  # most likely the caller's kwargs: say so
                raise ConfigError(f"transformers refused generate_kwargs: {str(exc)[:200]}",
                                  fix="pass only model.generate() keyword arguments") from None
            raise
        if not recurrent and self.length(work) < len(prompt_tokens):
            raise RuntimeError("generate did not continue from the given KV cache")
        return out[0, len(shown):].tolist()

    def _seeded_sampler(self, decoding: Decoding) -> Any:
        """A logits processor that samples like transformers (temperature, top-k, top-p
        warpers, then a multinomial draw) from a generator seeded for this call only, and
        leaves only the drawn token possible, so the (greedy) search picks it."""
        import transformers

        torch = self._torch
        warpers = [transformers.TemperatureLogitsWarper(float(decoding.temperature))]
        if decoding.top_k:
            warpers.append(transformers.TopKLogitsWarper(decoding.top_k))
        if decoding.top_p < 1:
            warpers.append(transformers.TopPLogitsWarper(decoding.top_p))
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(decoding.seed))

        class SeededSampler(transformers.LogitsProcessor):
            def __call__(self, input_ids: Any, scores: Any) -> Any:
                for warp in warpers:
                    scores = warp(input_ids, scores)
                probs = torch.softmax(scores.float(), dim=-1)
                drawn = torch.multinomial(probs, num_samples=1, generator=generator)
                only = torch.full_like(scores, float("-inf"))
                return only.scatter_(1, drawn, 0.0)

        return SeededSampler()

    def check_import(self, cache: Any, tokens: Sequence[int], *, full: bool = True) -> None:
        """Check that ``cache`` holds ``tokens`` for this model; ValueError on a mismatch.

        ``full`` (the default): prefill ``tokens`` again, in chunks, and compare every
        layer's K/V at every position -- a changed token anywhere changes at least its own
        position's K/V (decision 2102); costs one prefill and a second cache's memory.
        ``full=False``: recompute only four positions (first, two inside, last), each on the
        cache trimmed just before it -- catches another template, model or dtype, not a
        token changed elsewhere."""
        n = len(tokens)
        rtol = _IMPORT_RTOL.get(str(self.dtype).removeprefix("torch."), 6e-2)
        if self.layers is not None:  # states are a function of the whole prefix: recompute
            self._check_states(cache, list(tokens), rtol)
            return
        kv = self._kv(cache)
        if full:
            self._check_all_positions(kv, list(tokens), rtol)
            return
        for pos in sorted({0, n // 3, (2 * n) // 3, n - 1})[:IMPORT_CHECKS]:
            work = self.new_cache()
            for i, (k, v) in enumerate(kv if pos else ()):
                work.update(k[:, :, :pos].clone(), v[:, :, :pos].clone(), i)
            self._forward(work, [int(tokens[pos])])
            for (k, v), (k2, v2) in zip(kv, self._kv(work), strict=True):
                for a, b in ((k[:, :, pos], k2[:, :, pos]), (v[:, :, pos], v2[:, :, pos])):
                    scale = float(b.abs().max()) + 1e-6
                    if float((a.float() - b.float()).abs().max()) > rtol * scale:
                        raise ValueError(f"position {pos} of the cache does not match token "
                                         f"{int(tokens[pos])} recomputed")

    def _check_states(self, cache: Any, tokens: list[int], rtol: float) -> None:
        """Prefill ``tokens`` again and compare every tensor of every layer."""
        work = self.prefill(self.new_cache(), tokens)
        got = hf_layers.tensors(cache, self.layers or [], len(tokens))
        want = hf_layers.tensors(work, self.layers or [], len(tokens))
        for name, b in want.items():
            a = got[name].float()
            scale = float(b.float().abs().max()) + 1e-6
            if float((a - b.float()).abs().max()) > rtol * scale:
                raise ValueError(f"cache state {name} does not match the tokens recomputed")

    def _check_all_positions(self, kv: list[tuple[Any, Any]], tokens: list[int],
                             rtol: float) -> None:
        """Prefill ``tokens`` chunk by chunk and compare each chunk's positions at once."""
        torch = self._torch
        work = self.new_cache()
        for start in range(0, len(tokens), self.prefill_chunk):
            end = min(start + self.prefill_chunk, len(tokens))
            self._forward(work, tokens[start:end])
            for (k, v), (k2, v2) in zip(kv, self._kv(work), strict=True):
                for a, b in ((k, k2), (v, v2)):
                    got = a[:, :, start:end].to(b.device).float()
                    want = b[:, :, start:end].float()
                    # per position: the largest error against that position's own scale
                    err = (got - want).abs().amax(dim=(0, 1, 3))
                    scale = want.abs().amax(dim=(0, 1, 3)) + 1e-6
                    bad = torch.nonzero(err > rtol * scale)
                    if len(bad):
                        pos = start + int(bad[0, 0])
                        raise ValueError(f"position {pos} of the cache does not match token "
                                         f"{tokens[pos]} recomputed")


def cache_argument(forward: Any) -> str:
    """The name under which ``forward`` (and ``generate``) take the KV cache: ``cache``
    where the model declares it (transformers >= 5.24, which deprecates the old name),
    else ``past_key_values`` (decision 1705)."""
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    if "cache" in params:
        return "cache"
    # recurrent-only models (Mamba) take their state as ``cache_params``
    return "cache_params" if "cache_params" in params and "past_key_values" not in params \
        else "past_key_values"


def _usable_device(torch: Any, device: str) -> Any:
    """``torch.device(device)`` after checking this torch can allocate on it; a ConfigError
    naming the cause otherwise (not the AssertionError a CPU-only torch raises later)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"bad device {device!r}: {exc}", fix="use e.g. 'cpu' or 'cuda'") \
            from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} is not available: this torch "
                          f"({torch.__version__}) has no CUDA support or sees no GPU",
                          fix="pass device='cpu', or install a CUDA build of torch")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {device!r} is not available: MPS needs Apple silicon "
                          "and a torch built with MPS", fix="pass device='cpu'")
    try:
        torch.empty(1, device=dev)
    except (AssertionError, RuntimeError) as exc:
        raise ConfigError(f"device {device!r} is not usable: {str(exc)[:200]}",
                          fix="pass device='cpu', or a device this machine has") from None
    return dev


class PyTorchCacheController(LocalCacheController):
    """The prompt-cache controller for transformers models (``kind = "pytorch"``).

    ``model``: a local model directory (or an already built ``PyTorchBackend``);
    ``root``: store root, open Store, or None for a managed temporary store.
    ``restore(handle).cache`` is a ``transformers.DynamicCache``; ``import_cache`` takes one.
    ``tenant``: on an encrypted store, the tenant whose key seals the entries (see
    ``LocalCacheController``).
    ``lookup_deadline`` / ``read_deadline``: see ``LocalCacheController`` (a hung disk costs
    ``prepare`` one deadline, then a cold run; decision 2701).
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
