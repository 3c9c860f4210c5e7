"""The connector's commit path in the crash matrix: a real vLLM engine process dies (os._exit,
like kill -9) inside the background store at a durability checkpoint. After a restart on the
same store every visible entry verifies, leftovers are reclaimable, and the same prompts give
the greedy tokens of a cold computation (bypass), restoring whatever chunks did survive."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from faultseam import CRASH_EXIT_CODE
from testpaths import TESTS_DIR

from spoolctl.store import Store

pytestmark = pytest.mark.slow

DRIVER = TESTS_DIR.joinpath("vllm_support.py")
CHUNK = 64
rng = random.Random(11)
PROMPT = [rng.randrange(3, 500) for _ in range(4 * CHUNK + 9)]  # 4 chunks -> 4 entries


def engine(job: dict, work: Path, name: str, crash_at: str | None = None):
    job_path, out_path = work / f"{name}.job.json", work / f"{name}.out.json"
    job_path.write_text(json.dumps(job))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("SPOOLCTL_CRASH_AT", None)
    if crash_at:
        env["SPOOLCTL_CRASH_AT"] = crash_at
    proc = subprocess.run([sys.executable, str(DRIVER), str(job_path), str(out_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    return proc, (json.loads(out_path.read_text()) if out_path.exists() else None)


@pytest.mark.parametrize("point", [
    pytest.param("object.fsynced:2", marks=pytest.mark.extended), "manifest.published:3"])
def test_engine_killed_inside_a_store_commit(point, tiny_model_dir, tmp_path) -> None:
    work = Path(os.path.realpath(tmp_path))
    base = {"model": str(tiny_model_dir), "root": str(work / "store"),
            "extra": {"spoolctl_chunk_tokens": CHUNK}}
    proc, _ = engine({**base, "requests": [{"name": "p", "tokens": PROMPT}]}, work, "crash",
                     crash_at=point)
    assert proc.returncode == CRASH_EXIT_CODE, proc.stderr[-3000:]
    (rank_root,) = [p.parent for p in (work / "store").rglob(".spoolctl-root")]
    with Store.open(rank_root) as store:
        for row in store.entries(include_pending=True):  # visible = complete and verified
            assert row.state == "committed"
            store.verify(row.entry_id)
        survivors = store.totals().entries
        nth = int(point.rsplit(":", 1)[1])
        if "manifest" in point:  # a published manifest is a commit: chunks 0..nth-1
            assert survivors == nth
        else:
            # The nth chunk's object never became durable, so neither it nor any chunk of
            # its group commit is visible; chunks committed in an earlier batch are (how the
            # writer grouped them depends on timing: chunks queued together commit together).
            assert survivors <= nth - 1
    proc, out = engine({**base, "requests": [
        {"name": "cold", "tokens": PROMPT, "bypass": True},
        {"name": "p", "tokens": PROMPT},
        {"name": "again", "tokens": PROMPT},
    ]}, work, "restart")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = out["results"]
    assert res["p"]["tokens"] == res["cold"]["tokens"] == res["again"]["tokens"]
    assert res["p"]["num_cached_tokens"] == survivors * CHUNK
    assert res["again"]["num_cached_tokens"] == 4 * CHUNK  # the lost chunks were re-stored
    with Store.open(rank_root) as store:
        store.clean_tmp(min_age=0)
        report = store.collect_orphans(min_age=0)
        assert report.dropped_rows == 0 and store.quarantine_items() == []
        assert list(store.layout.tmp.iterdir()) == []
