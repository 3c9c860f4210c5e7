"""A locally generated tiny Qwen2-VL for the mlx-vlm tests and benchmark.

Nothing is downloaded: a byte-level BPE tokenizer with the Qwen special tokens is
trained on inline text, the image processor config is written by hand, and the
weights are random (seeded) from mlx-vlm's own ``qwen2_vl.Model``, saved in mlx
format so ``mlx_vlm.load(path)`` reads them without conversion. Requires the
``vlm`` extra (mlx-vlm, mlx, transformers, pillow).

Shape (facts from ENVIRONMENT.md "mlx-vlm on Linux CPU"): LM hidden 64, 2 layers,
4 heads / 2 KV heads (head_dim 16, mRoPE sections [2, 3, 3]); vision depth 1,
embed_dim 32, 2 heads, integer ``mlp_ratio``; patch 14, merge 2, temporal 2,
min_pixels 784 and max_pixels 3136, so a 56x56 image is 4 image tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from spoolctl.errors import ConfigError

from .tinymodel import publish_dir

SPEC_VERSION = 1
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_CORPUS = """\
You are a helpful assistant that looks at pictures and answers questions about them.
Describe the image. What colour is the square? The picture shows a red circle on white.
The spool store keeps prompt caches on local disk with integrity and bounded capacity.
A manifest describes every entry; objects are named by the digest of their bytes.
The quick brown fox jumps over the lazy dog. 0123456789 !@#$%^&*()[]{};:'",.<>/?\\|`~-_=+
"""
# A minimal ChatML template (Qwen style) so chat-formatting helpers work offline.
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS] * 50, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL_TOKENS[1:])


def _config(tokenizer) -> dict:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "max_position_embeddings": 4096,
        "vocab_size": len(tokenizer),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "in_channels": 3,
            "in_chans": 3,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }


_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "rescale_factor": 1 / 255,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 784,
    "max_pixels": 3136,
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
}


def _weights(config: dict, seed: int) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import qwen2_vl

    mx.random.seed(seed)
    cfg = qwen2_vl.ModelConfig.from_dict(dict(config))
    cfg.text_config = qwen2_vl.TextConfig.from_dict(cfg.text_config) \
        if isinstance(cfg.text_config, dict) else cfg.text_config
    cfg.vision_config = qwen2_vl.VisionConfig.from_dict(cfg.vision_config) \
        if isinstance(cfg.vision_config, dict) else cfg.vision_config
    model = qwen2_vl.Model(cfg)
    weights = dict(tree_flatten(model.parameters()))
    # Random init gives near-uniform logits; widen them so greedy decoding is decisive.
    for name, w in weights.items():
        if name.endswith("lm_head.weight"):
            weights[name] = w * 8.0
    mx.eval(list(weights.values()))
    return weights


def build_tiny_vlm(path: str | os.PathLike[str], seed: int = 0) -> Path:
    """Build the tiny Qwen2-VL directory at ``path`` (atomically) and return it.

    A directory already built with the same spec version and seed is reused.
    """
    target = Path(path)
    stamp_data = {"spec": SPEC_VERSION, "seed": seed, "arch": "qwen2_vl"}
    stamp = target / "spoolctl-tinyvlm.json"
    if stamp.exists():
        try:
            if json.loads(stamp.read_text()) == stamp_data:
                return target
        except (OSError, ValueError):
            pass
    try:
        import mlx.core as mx
    except ImportError as exc:
        raise ConfigError(f"mlx is not usable here ({exc})",
                          fix="pip install 'spoolctl[vlm]'") from None
    tokenizer = _train_tokenizer()
    tokenizer.chat_template = _CHAT_TEMPLATE
    config = _config(tokenizer)
    weights = _weights(config, seed)

    def write(staging: Path) -> None:
        tokenizer.save_pretrained(staging)
        (staging / "config.json").write_text(json.dumps(config, indent=1))
        (staging / "preprocessor_config.json").write_text(json.dumps(_PREPROCESSOR, indent=1))
        (staging / "chat_template.json").write_text(
            json.dumps({"chat_template": _CHAT_TEMPLATE}))
        mx.save_safetensors(str(staging / "model.safetensors"), weights,
                            metadata={"format": "mlx"})
        (staging / "spoolctl-tinyvlm.json").write_text(json.dumps(stamp_data))

    return publish_dir(target, write)
