"""A locally generated tiny Idefics3 (image + text) model for the vLLM multimodal tests.

Nothing is downloaded: the tokenizer is the project's inline-trained byte-level BPE
(``spoolctl.demo.tinymodel``) plus Idefics3's special tokens, the image processor is the
PIL ``Idefics3ImageProcessorPil`` (no torchvision needed) configured for 56x56 images
without tiling, and all weights are random (seeded). vLLM loads the directory as
``Idefics3ForConditionalGeneration`` (SigLIP-like vision tower, pixel-shuffle
connector, Llama text model).

Why Idefics3 and not LLaVA/Qwen2-VL: vLLM 0.32's ``llava`` and ``qwen2_vl`` modules
import torchvision, which the dev environment does not have.

A prompt holds one ``<image>`` token per image; vLLM replaces it with
``<fake_token_around_image><global-img>`` + ``IMAGE_SEQ_LEN`` x ``<image>`` +
``<fake_token_around_image>`` (``IMAGE_PLACEHOLDER_TOKENS`` tokens in all).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from spoolctl.demo.tinymodel import publish_dir

IMAGE_SIZE = 56
PATCH_SIZE = 7
SCALE_FACTOR = 2
IMAGE_TOKEN = "<image>"
#: ``<image>`` embeddings one image yields: (56/7)^2 patches, pixel-shuffled by 2x2.
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
#: Prompt positions one image's expanded placeholder occupies (fake + global + seq + fake).
IMAGE_PLACEHOLDER_TOKENS = IMAGE_SEQ_LEN + 3
_STAMP = {"arch": "tiny-idefics3", "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "v": 1}


def build_tiny_idefics3(path: str | os.PathLike[str], seed: int = 0) -> Path:
    """Build (atomically; reused when already built) a tiny Idefics3 directory at ``path``."""
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
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    from spoolctl.demo.tinymodel import train_tokenizer

    tokenizer = train_tokenizer(512)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"]})
    image_processor = Idefics3ImageProcessorPil(
        do_resize=True, size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE}, do_image_splitting=False)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_len=IMAGE_SEQ_LEN)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)

    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False)
    vision = Idefics3VisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    config = Idefics3Config(
        vision_config=vision, text_config=text, image_token_id=image_token_id,
        scale_factor=SCALE_FACTOR, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False)
    config.torch_dtype = "float32"

    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        # Near-uniform logits make greedy ties (kernel-dependent) likely: widen them.
        model.lm_head.weight.mul_(8.0)

    def write(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        processor.save_pretrained(staging)
        (staging / "spoolctl-tinymodel.json").write_text(json.dumps({**_STAMP, "seed": seed}))

    return publish_dir(target, write)


def image_token_id(model_dir: str | os.PathLike[str]) -> int:
    """The id of the one ``<image>`` token a prompt carries per image (``config.json``)."""
    return int(json.loads((Path(model_dir) / "config.json").read_text())["image_token_id"])


def expanded_placeholder(model_dir: str | os.PathLike[str]) -> list[int]:
    """The token ids vLLM puts in a prompt in place of one ``<image>`` token."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    fake, glob = tok.token_to_id("<fake_token_around_image>"), tok.token_to_id("<global-img>")
    return [fake, glob] + [image_token_id(model_dir)] * IMAGE_SEQ_LEN + [fake]
