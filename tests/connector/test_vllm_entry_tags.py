"""A real vLLM engine with a tag key does not restore a chunk the store's writer replaced
(issue 35 item 6, decision 2011).

A  keyed engine (``spoolctl_tag_key_file`` in ``kv_connector_extra_config``), cold: stores
   every complete chunk of P and Q, tagged.
   Then someone who can write the store but lacks the key replaces the first chunk of P
   with their own KV (all zeros) and *recomputes both digests*: a consistent manifest and
   object, exactly what a commit writes -- without a valid tag. The store is copied.
B  keyed engine again (key from ``SPOOLCTL_TAG_KEY_FILE`` this time), a restart: P's forged
   chunk is refused (quarantined ``auth_tag``, a load error vLLM recomputes) and P's greedy
   tokens equal the cold run; Q, untouched, is restored whole with the same tokens.
C  negative control, an engine without a key on the copy: the same forgery is restored and
   changes P's tokens -- what B prevented is a real attack.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_engines import key_file, run_engine, sched_counter

from spoolctl import metrics as m
from spoolctl.connector.planning.chain import chain_root, chunk_keys
from spoolctl.store import Store, entry_id_for
from spoolctl.store.format.entry_tags import KEY_ENV, KEY_FILE_ENV

pytestmark = pytest.mark.slow

CHUNK = 64
rng = random.Random(35)
_unused = [rng.randrange(3, 500) for _ in range(3 * CHUNK + 9)]  # keeps the draws below
Q = [rng.randrange(3, 500) for _ in range(2 * CHUNK + 7)]
P = [rng.randrange(3, 500) for _ in range(2 * CHUNK + 5)]  # zero KV for chunk 0 shows


def forge_first_chunk(root: Path, ns: str, tokens: list[int]) -> str:
    """Replace the prompt's first chunk with zero KV, digests recomputed, no (valid) tag."""
    key = chunk_keys(chain_root(ns, None), tokens, CHUNK)[0]
    with Store.open(root, tag_key=None) as store:  # the writer: no key
        real = store.manifest(entry_id_for("vllm", ns, key))
        store.release(real.entry_id)
        store.clean_released()
        forged = store.put(kind="vllm", namespace=ns, key=key,
                           objects={"kv": bytes(real.object("kv").size)}, meta=real.meta)
    assert forged.object("kv").digest != real.object("kv").digest
    return forged.entry_id


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-tags")))
    tag_key = key_file(work, "tag.key")
    base = {"model": str(tiny_model_dir), "root": str(work / "store"),
            "extra": {"spoolctl_chunk_tokens": CHUNK}}
    no_key = (KEY_FILE_ENV, KEY_ENV)
    a = run_engine({**base, "extra": {**base["extra"], "spoolctl_tag_key_file": str(tag_key)},
                    "requests": [{"name": "p", "tokens": P}, {"name": "q", "tokens": Q}]},
                   work, "A", unset=no_key)
    root, ns = Path(a["store_root"]), a["namespace"]
    forged_p = forge_first_chunk(root, ns, P)
    shutil.copytree(work / "store", work / "copy", symlinks=True)
    b = run_engine({**base, "requests": [{"name": "p", "tokens": P}, {"name": "q", "tokens": Q}]},
                   work, "B", env={KEY_FILE_ENV: str(tag_key)}, unset=(KEY_ENV,))
    with Store.open(root, tag_key=None, read_only=True) as store:
        quarantined = {i.entry_id: i.reason for i in store.quarantine_items()}
    c = run_engine({**base, "root": str(work / "copy"), "requests": [{"name": "p", "tokens": P}]},
                   work, "C", unset=no_key)
    return {"A": a, "B": b, "C": c, "forged_p": forged_p, "quarantined_after_b": quarantined}


def test_a_forged_chunk_is_not_restored_under_a_key(runs):
    a, b = runs["A"], runs["B"]
    assert a["results"]["p"]["num_cached_tokens"] == 0
    assert b["results"]["p"]["tokens"] == a["results"]["p"]["tokens"]  # equal to cold
    assert sched_counter(b, m.LOAD_ERRORS, role="worker", reason="auth_tag") == 1
    assert sched_counter(b, m.QUARANTINE_EVENTS, role="worker", reason="auth_tag") == 1
    assert runs["quarantined_after_b"] == {runs["forged_p"]: "auth_tag"}
    assert b["alive"]


def test_tagged_chunks_restore_whole_with_identical_tokens(runs):
    a, b = runs["A"], runs["B"]
    assert b["results"]["q"]["num_cached_tokens"] == 2 * CHUNK
    assert b["results"]["q"]["tokens"] == a["results"]["q"]["tokens"]


def test_without_a_key_the_same_forgery_reaches_the_model(runs):
    """Negative control: the forged KV really changes P's output when restored."""
    a, c = runs["A"], runs["C"]
    assert c["results"]["p"]["num_cached_tokens"] == 2 * CHUNK
    assert c["results"]["p"]["tokens"] != a["results"]["p"]["tokens"]
