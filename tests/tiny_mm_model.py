"""A locally generated tiny LLaVA (CLIP vision tower + Llama text model) for vLLM tests.

Nothing is downloaded: the tokenizer is the project's inline-trained byte-level BPE
(``spoolctl.tinymodel``) plus an ``<image>`` special token, the image processor is a
``CLIPImageProcessor`` configured for 56x56 images, and all weights are random (seeded).
vLLM (``LlavaForConditionalGeneration``) loads the directory with its processor:
a 56 px image with 14 px patches becomes 16 placeholder tokens in the prompt.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

IMAGE_SIZE = 56
PATCH_SIZE = 14
IMAGE_TOKEN = "<image>"
#: Placeholder tokens one image expands to ("default" strategy drops the CLS token).
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
_STAMP = {"arch": "tiny-llava", "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "v": 1}


def build_tiny_llava(path: str | os.PathLike[str], seed: int = 0) -> Path:
    """Build (atomically; reused when already built) a tiny LLaVA directory at ``path``.

    ``config.json`` carries ``image_token_index``: the id the prompt's single image
    placeholder token must have (vLLM expands it to ``IMAGE_TOKENS`` tokens).
    """
    target = Path(path)
    stamp = target / "spoolctl-tinymodel.json"
    if stamp.exists():
        try:
            if json.loads(stamp.read_text()) == {**_STAMP, "seed": seed}:
                return target
        except (OSError, ValueError):
            pass
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from spoolctl.tinymodel import _train_tokenizer

    tokenizer = _train_tokenizer(512)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)

    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False)
    vision = CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=64)
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_id,
        vision_feature_select_strategy="default", vision_feature_layer=-1,
        projector_hidden_act="gelu", image_seq_length=IMAGE_TOKENS,
        tie_word_embeddings=False)
    config.torch_dtype = "float32"

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        # Near-uniform logits make greedy ties (kernel-dependent) likely: widen them.
        model.lm_head.weight.mul_(8.0)
        # Make the image matter: a random projector on a random tower gives small
        # embeddings; scale them up so different pixels visibly change the output.
        model.model.multi_modal_projector.linear_2.weight.mul_(4.0)

    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1)

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tinyllava-", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        processor.save_pretrained(staging)
        (staging / "spoolctl-tinymodel.json").write_text(json.dumps({**_STAMP, "seed": seed}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def image_token_id(model_dir: str | os.PathLike[str]) -> int:
    """The placeholder id a prompt uses for one image (``config.json``)."""
    return int(json.loads((Path(model_dir) / "config.json").read_text())["image_token_index"])
