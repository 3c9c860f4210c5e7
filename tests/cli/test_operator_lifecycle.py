"""Issue 29.5 / decision 2112: `status` and `doctor` show vLLM deployments nothing will read
again (superseded by a newer generation of the same model, or unused for long), with their
last use and bytes, and `clean --superseded` / `--unused-for` reclaim them by rule (cron).
Stores are written through the store API in the connector's layout, each chunk carrying the
identity facts the connector records (``deployment`` in its manifest's meta)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from operator_cli import run, run_json

from spoolctl.store import Store
from spoolctl.store.maintain.staleness import DeploymentUse, judge

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

DEP_OLD = "vllm-v1-" + "a1" * 24  # the model before its weights were replaced
DEP_NEW = "vllm-v1-" + "b2" * 24  # the same model path with the new weights
DEP_OTHER = "vllm-v1-" + "c3" * 24  # another model, idle for 40 days
DAY = 86400.0


def _identity(model: str, weights: str, rank: int) -> dict:
    return {"model": model, "revision": None, "dtype": "float32", "kv_cache_dtype": "auto",
            "block_size": 32, "tp": [rank, 2], "pp": [0, 1], "engine": "vllm-0.32/cpu",
            "chunk_tokens": 64, "weights": weights}


def _fill(root: Path, rank: int, model: str, weights: str, created: float, used: float,
          n: int = 3) -> None:
    now = [created]  # the store's clock: when these chunks were stored, then last read
    with Store.open(root, create=True, clock=lambda: now[0]) as store:
        ids = [store.put(kind="vllm", namespace=f"ns-{root.parent.name[-4:]}-r{rank}",
                         key=f"{i:064x}", objects={"kv": os.urandom(1024)},
                         meta={"chunk_index": i,
                               "deployment": _identity(model, weights, rank)}).entry_id
               for i in range(n)]
        now[0] = used
        store.touch(ids)


@pytest.fixture
def base(tmp_path: Path) -> Path:
    base = Path(os.path.realpath(tmp_path)) / "spool"
    now = time.time()
    for rank in (0, 1):
        _fill(base / DEP_OLD / f"rank-{rank:04d}", rank, "/models/m", "blake3:" + "1" * 64,
              now - 10 * DAY, now - 9 * DAY)
        _fill(base / DEP_NEW / f"rank-{rank:04d}", rank, "/models/m", "blake3:" + "2" * 64,
              now - 8 * DAY, now - 60)
        _fill(base / DEP_OTHER / f"rank-{rank:04d}", rank, "/models/other",
              "blake3:" + "3" * 64, now - 50 * DAY, now - 40 * DAY)
    return base


def _bytes(root: Path) -> int:
    with Store.open(root) as store:
        return store.totals().bytes


def _entries(root: Path) -> int:
    with Store.open(root) as store:
        return store.totals().entries


def test_status_shows_the_superseded_deployment_its_last_use_and_bytes(base: Path) -> None:
    doc = run_json("status", "--root", str(base))
    old = doc["deployments"][DEP_OLD]["lifecycle"]
    assert (old["state"], old["reason"], old["successor"]) == \
        ("superseded", "weights changed", DEP_NEW)
    assert old["entries"] == 6 and old["bytes"] == sum(
        _bytes(base / DEP_OLD / f"rank-{r:04d}") for r in (0, 1))
    assert old["weights"] == "blake3:" + "1" * 64 and old["model"] == "/models/m"
    assert time.time() - old["last_used"] == pytest.approx(9 * DAY, abs=600)
    assert doc["deployments"][DEP_NEW]["lifecycle"]["state"] == "current"
    assert doc["deployments"][DEP_OTHER]["lifecycle"]["state"] == "current"
    code, out, _ = run("status", "--root", str(base))
    assert code == 0 and "superseded (weights changed)" in out.replace("\n", " ")
    assert "clean --superseded" in out


def test_doctor_warns_about_a_superseded_deployment(base: Path) -> None:
    code, out, err = run("doctor", "--root", str(base), "--json")
    assert code in (0, 1), err  # other checks depend on the machine; this one does not
    doc = json.loads(out)
    for store in doc["stores"]:
        checks = {c["name"]: c for c in store["result"]["checks"]}
        life = checks.get("deployment.lifecycle")
        if store["deployment"] == DEP_OLD:
            assert life is not None and life["status"] == "warn"
            assert "superseded" in life["detail"] and "clean --superseded" in life["fix"]
        else:
            assert life is None


def test_clean_superseded_reclaims_only_the_replaced_deployment(base: Path) -> None:
    dry = run_json("clean", "--root", str(base), "--superseded", "--dry-run")
    assert all(_entries(base / d / "rank-0000") == 3 for d in (DEP_OLD, DEP_NEW, DEP_OTHER))
    assert [s["result"]["deployment_lifecycle"]["reclaimed"] for s in dry["stores"]
            if s["deployment"] == DEP_OLD] == [True, True]
    doc = run_json("clean", "--root", str(base), "--superseded", "--yes")
    for s in doc["stores"]:
        life = s["result"]["deployment_lifecycle"]
        if s["deployment"] == DEP_OLD:
            assert life["reclaimed"] and life["entries"] == 3
            assert s["result"]["steps"]["released"]["entries"] == 3
        else:
            assert not life["reclaimed"]
    assert [_entries(base / DEP_OLD / f"rank-{r:04d}") for r in (0, 1)] == [0, 0]
    assert _entries(base / DEP_NEW / "rank-0001") == _entries(base / DEP_OTHER / "rank-0000") == 3


def test_clean_unused_for_reclaims_what_nothing_used_for_that_long(base: Path) -> None:
    run_json("clean", "--root", str(base), "--unused-for", "30d", "--yes")
    assert [_entries(base / DEP_OTHER / f"rank-{r:04d}") for r in (0, 1)] == [0, 0]
    # 9 days unused and superseded, but the rule asked only for 30 days unused
    assert _entries(base / DEP_OLD / "rank-0000") == 3
    assert _entries(base / DEP_NEW / "rank-0000") == 3


def test_clean_by_rule_on_one_store_is_a_usage_error(base: Path) -> None:
    code, _, err = run("clean", "--root", str(base / DEP_OLD / "rank-0000"), "--superseded",
                       "--yes")
    assert code == 2 and "base root" in err


def _use(name: str, first: float, last: float, weights: str, model: str = "/m",
         engine: str = "vllm-0.32/cpu") -> DeploymentUse:
    ident = {"model": model, "revision": None, "dtype": "float32", "kv_cache_dtype": "auto",
             "block_size": 32, "tp": [0, 1], "pp": [0, 1], "engine": engine,
             "chunk_tokens": 64, "weights": weights}
    return DeploymentUse(name, 3, 3000, first, last, ident)


def test_a_deployment_replaced_and_not_used_since_is_superseded() -> None:
    old, new = _use("old", 100, 200, "w1"), _use("new", 300, 400, "w2")
    other = _use("other", 10, 20, "w9", model="/other")  # another model: never superseded
    v = judge([old, new, other], now=500)
    assert (v["old"].state, v["old"].successor, v["old"].reason) == \
        ("superseded", "new", "weights changed")
    assert v["new"].state == v["other"].state == "current"
    upgraded = judge([_use("a", 100, 200, "w1"), _use("b", 300, 400, "w1", engine="vllm-0.33")],
                     now=500)
    assert upgraded["a"].reason == "vLLM version changed"


def test_two_generations_both_in_use_are_both_current() -> None:
    v = judge([_use("a", 100, 450, "w1"), _use("b", 300, 400, "w2")], now=500)
    assert v["a"].state == v["b"].state == "current"


def test_unused_for_longer_than_the_rule_is_unused() -> None:
    v = judge([_use("a", 100, 200, "w1")], now=200 + 86400 * 31, unused_for=86400 * 30)
    assert v["a"].state == "unused"
    assert judge([_use("a", 100, 200, "w1")], now=300, unused_for=86400)["a"].state == "current"


def test_a_narrowed_command_still_sees_the_successor(base: Path) -> None:
    """`--deployment OLD` or `--root R/OLD`: the newer sibling is what makes it superseded."""
    doc = run_json("status", "--root", str(base / DEP_OLD))
    assert doc["deployments"][DEP_OLD]["lifecycle"]["successor"] == DEP_NEW
    doc = run_json("clean", "--root", str(base), "--deployment", DEP_OLD[:12], "--rank", "1",
                   "--superseded", "--yes")
    assert [s["result"]["deployment_lifecycle"]["reclaimed"] for s in doc["stores"]] == [True]
    assert _entries(base / DEP_OLD / "rank-0001") == 0
    assert _entries(base / DEP_OLD / "rank-0000") == 3  # --rank 1 only
