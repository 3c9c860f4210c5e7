"""The PyTorch (transformers) KV backend (``PyTorchBackend``) of ``LocalCacheController``.

Imports torch / transformers / safetensors only when a backend is built (one ConfigError
naming the extra without them). Supported: transformers >= 5.19, < 5.24; the cache argument
of ``forward`` / ``generate`` is read from the model's signature (``frameworks``). A prefill
checks that the model really extended the given cache.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spoolctl.errors import ConfigError

from ..local.decoding import DEFAULT, Decoding
from ..local.render import ChatTemplate, template_source
from . import appmodel, codec, generate, import_check
from . import layers as hf_layers
from .adapters import TorchModelState
from .frameworks import cache_argument, model_digest, usable_device

DTYPES = ("float32", "float16", "bfloat16")
PREFILL_CHUNK = 512  # tokens per forward: bounds attention memory on long prompts


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
    under the same identifier is not detected.
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
        self.model_path: Path | None = self.path
        self.model_id = model_id or str(path.resolve())
        self.prefill_chunk = prefill_chunk
        self.device = usable_device(torch, device)
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
        self.run: Any = self.model
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
        self.run = model
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
        self.torch: Any = torch
        self.safetensors: Any = safetensors.torch
        self._DynamicCache = transformers.DynamicCache
        self._v5 = int(transformers.__version__.split(".")[0]) >= 5
        return torch, transformers

    def _adopt(self) -> None:
        """Read what the backend needs from ``self.model`` / ``self.tokenizer`` (loaded from
        the directory, or handed over by the application: ``from_loaded``)."""
        self._loaded_model = self.model  # what model_state compares the backend's model to
        self._state: TorchModelState | None = None
        self.cache_arg = cache_argument(self.model.forward)
        self.dtype = next(self.model.parameters()).dtype
        self.config = self.model.config.get_text_config(decoder=True) \
            if hasattr(self.model.config, "get_text_config") else self.model.config
        self.num_layers = int(self.config.num_hidden_layers)
        heads = int(getattr(self.config, "num_attention_heads", None) or 1)
        self.kv_heads = int(getattr(self.config, "num_key_value_heads", None) or heads)
        self.head_dim = int(getattr(self.config, "head_dim", None)
                            or self.config.hidden_size // heads)
        #: Per-layer layout of a model whose cache is not all full attention (None: the
        #: v1 full-attention layout); see ``layers``.
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
        torch = self.torch
        with torch.no_grad():
            ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
            out = self.run(input_ids=ids, use_cache=True, **{self.cache_arg: cache})
        return out.logits[0, -1].float()

    # -- identity / tokens ----------------------------------------------------------------

    def identity(self) -> dict[str, str]:
        with self._identity_lock:
            if self._identity is None:
                import transformers

                self._identity = {
                    "framework": "transformers",
                    "transformers": transformers.__version__,
                    "torch": self.torch.__version__.split("+")[0],
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
                self._state = TorchModelState(self.torch, self._loaded_model)
            return dict(self._identity)

    def _weights_fields(self) -> dict[str, str]:
        """The identity fields naming the weights: the files' digest, a vouched revision,
        or for a handed-over model the digest of its tensors or the caller's stated name
        plus its architecture (``appmodel``)."""
        if self.path is None:
            if self._stated is not None:
                return {"revision": f"stated:{self._stated}",
                        "architecture": appmodel.architecture(self.torch, self.model)}
            return {"revision": f"params:{appmodel.weights_digest(self.torch, self.model)}"}
        return {"revision": f"trusted:{self._trusted_revision}" if self._trusted_revision
                else f"blake3:{model_digest(self.path)}"}

    def model_state(self) -> dict[str, str]:
        """The identity fields of the PEFT adapters acting on the base weights now (``{}``:
        the model as loaded; ``adapters``). ``UnidentifiedModel`` for a change it
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

    def kv_pairs(self, cache: Any) -> list[tuple[Any, Any]]:
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

    def forward_passes(self, held: int, new: int) -> int:
        """Forward passes ``forward`` runs to add ``new`` tokens to a cache of ``held``."""
        if new <= 0:
            return 0
        if self._resume_chunk == 1:
            return 1 if held == 0 else new
        return -(-new // self.prefill_chunk)

    def extend_cost(self, held: int, new: int) -> float:
        """Estimated cost of adding ``new`` tokens to a cache of ``held``, in single-token
        forward passes: each pass costs one, plus its tokens over ``prefill_chunk`` (a full
        chunk costs about two single-token passes: an estimate that favours recomputing)."""
        return self.forward_passes(held, new) + new / self.prefill_chunk

    def recompute_cheaper(self, held: int, new: int) -> bool:
        """Whether a cold prefill of ``held + new`` tokens costs less than extending a cache
        of ``held`` tokens by ``new`` (a model continued one token per forward)."""
        return new > 0 and self.extend_cost(0, held + new) < self.extend_cost(held, new)

    @property
    def trimmable(self) -> bool:
        """Whether a cache of this model can always be cut back to a shorter prefix (full
        attention); otherwise only forward extension is exact (``trim`` refuses)."""
        return self.layers is None

    def forward(self, cache: Any, tokens: Sequence[int]) -> Any:
        """Run ``tokens`` through the model extending ``cache``; the last position's logits."""
        torch = self.torch
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
                out = self.run(input_ids=chunk, use_cache=True, logits_to_keep=1,
                                 **{self.cache_arg: cache})
                if recurrent_only:
                    setattr(cache, hf_layers.TOKENS_ATTR, before + chunk.shape[1])
                elif self.length(cache) != before + chunk.shape[1]:
                    raise RuntimeError("the model did not extend the given KV cache")
                logits = out.logits[0, -1]
                start += chunk.shape[1]
        return logits

    def prefill(self, cache: Any, tokens: list[int]) -> Any:
        if tokens:
            self.forward(cache, tokens)
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
        for i, (k, v) in enumerate(self.kv_pairs(cache)):
            copy.update(k.clone(), v.clone(), i)
        return copy

    # -- the parts in modules of their own, each a function of the backend ------------------

    def layout(self) -> dict[str, Any]:
        """The layout meta every entry of this model records (``codec``)."""
        return codec.layout_of(self)

    def serialize(self, cache: Any, token_count: int
                  ) -> tuple[dict[str, bytes | memoryview], dict]:
        return codec.serialize(self, cache, token_count)

    def deserialize(self, objects: dict[str, memoryview], layout: dict, token_count: int) -> Any:
        return codec.deserialize(self, objects, layout, token_count)

    def resolve(self, decoding: Decoding) -> Decoding:
        """``decoding`` over the model's ``generation_config`` (``generate.resolve``)."""
        return generate.resolve(self, decoding)

    def generate(self, cache: Any | None, cached_tokens: int, prompt_tokens: list[int],
                 max_new_tokens: int, decoding: Decoding = DEFAULT) -> list[int]:
        """``model.generate`` continued from ``cache`` (never modified; ``generate``)."""
        return generate.generate(self, cache, cached_tokens, prompt_tokens, max_new_tokens,
                                 decoding)

    def check_import(self, cache: Any, tokens: Sequence[int], *, full: bool = True) -> None:
        """ValueError unless ``cache`` holds ``tokens`` for this model (``import_check``)."""
        import_check.check_import(self, cache, tokens, full=full)
