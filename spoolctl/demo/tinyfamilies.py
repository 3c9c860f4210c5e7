"""Tiny local models of the cache families beyond full attention (tests, benchmarks).

Each is built from the architecture's own transformers config class, with random
(seeded) weights and the locally trained tokenizer of ``tinymodel``, and written with
``save_pretrained``: transformers runs its own model code on it, and mlx-lm loads the
same directory with its own implementation of the architecture.

* ``sliding``: Gemma 3 text, three sliding-window layers (window 16) and one global
  layer -- the alternating local/global shape of Gemma 2/3 and gpt-oss.
* ``hybrid``: Jamba, Mamba layers interleaved with attention layers (and one MoE
  MLP) -- the attention + state-space shape of Jamba, Granite 4, Nemotron-H, Falcon-H1.
* ``ssm``: Mamba, recurrent state only (no per-token cache at all).

Requires the ``torch`` extra.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from spoolctl.errors import ConfigError

from .tinymodel import publish_dir, train_tokenizer

FAMILIES = ("sliding", "hybrid", "ssm")
#: The sliding window of the ``sliding`` model: small, so tests cross it with short prompts.
SLIDING_WINDOW = 16
_VERSION = 1  # bump when a family's shape changes: rebuilds cached directories


def _config(family: str, tokenizer) -> tuple[object, type]:
    common = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  tie_word_embeddings=False)
    if family == "sliding":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        return Gemma3TextConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            sliding_window=SLIDING_WINDOW, max_position_embeddings=16384,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            # mlx-lm reads the pattern, not layer_types; a config **kwarg, not typed
            sliding_window_pattern=4,  # type: ignore[call-arg]
            **common), \
            Gemma3ForCausalLM
    if family == "hybrid":
        from transformers import JambaConfig, JambaForCausalLM

        return JambaConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
            attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
            num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
            mamba_dt_rank=8, max_position_embeddings=16384, **common), JambaForCausalLM
    if family == "ssm":
        from transformers import MambaConfig, MambaForCausalLM

        return MambaConfig(hidden_size=128, num_hidden_layers=2, state_size=8, conv_kernel=4,
                           expand=2, **common), MambaForCausalLM
    raise ConfigError(f"unknown model family {family!r}", fix=f"use one of: {', '.join(FAMILIES)}")


def build_family_model(path: str | os.PathLike[str], family: str, *, seed: int = 0,
                       overrides: dict[str, object] | None = None) -> Path:
    """Build the tiny ``family`` model at ``path`` (atomically) and return it; a directory
    already built for the same family, seed, version and ``overrides`` (config fields set
    on top of the family's, e.g. another Mamba ``state_size``) is reused."""
    if family not in FAMILIES:
        raise ConfigError(f"unknown model family {family!r}",
                          fix=f"use one of: {', '.join(FAMILIES)}")
    target = Path(path)
    spec = {"family": family, "seed": seed, "version": _VERSION,
            **({"overrides": overrides} if overrides else {})}
    stamp = target / "spoolctl-tinymodel.json"
    try:
        if json.loads(stamp.read_text()) == spec:
            return target
    except (OSError, ValueError):
        pass
    import torch

    tokenizer = train_tokenizer(512)
    config, cls = _config(family, tokenizer)
    for name, value in (overrides or {}).items():
        if not hasattr(config, name):
            raise ConfigError(f"the {family} config has no field {name!r}",
                              fix="override fields of its transformers config class only")
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    with torch.no_grad():  # decisive logits: greedy ties practically never happen
        model.lm_head.weight.mul_(8.0)

    def write(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        stamp_ = staging / "spoolctl-tinymodel.json"
        stamp_.write_text(json.dumps(spec))

    return publish_dir(target, write)
