"""Issue 15.1 / decision 1100: every operator command accepts the vLLM connector's base
root (``spoolctl config vllm --root R``) and a deployment directory under it, acts on every
rank store, reports per rank (human and JSON), exits with the worst rank's code, and
narrows with ``--rank`` / ``--deployment``. The stores here are written through the store
API in the connector's layout; ``test_operator_examples.py`` does the same against stores
written by a real vLLM engine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from operator_cli import run, run_json, script

from spoolctl.store import Store, entry_id_for
from spoolctl.store.maintain.scrub import ScrubState

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

DEP_A = "vllm-v1-" + "a1" * 24
DEP_B = "vllm-v1-" + "b2" * 24


class _Proc:
    def __init__(self, code: int, out: str, err: str):
        self.returncode, self.stdout, self.stderr = code, out, err


def cli(*args: str) -> _Proc:
    return _Proc(*run(*args))


cli_json = run_json


def _fill(rank_root: Path, rank: int, released: int = 1, n: int = 3) -> list[str]:
    ids = []
    with Store.open(rank_root, create=True) as store:
        for i in range(n):
            m = store.put(kind="vllm", namespace=f"vllm-v1-ns-r{rank}", key=f"{i:064x}",
                          objects={"kv": os.urandom(2048)}, meta={"chunk_index": i})
            ids.append(m.entry_id)
        for entry_id in ids[:released]:
            store.release(entry_id)
    return ids


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A base root: deployment A with ranks 0 and 1, deployment B with rank 0."""
    base = Path(os.path.realpath(tmp_path)) / "spool"
    for dep, ranks in ((DEP_A, (0, 1)), (DEP_B, (0,))):
        for rank in ranks:
            _fill(base / dep / f"rank-{rank:04d}", rank)
    return base


def _ranks(doc: dict) -> list[tuple[str, int]]:
    return [(s["deployment"], s["rank"]) for s in doc["stores"]]


ALL = [(DEP_A, 0), (DEP_A, 1), (DEP_B, 0)]


def test_cron_commands_act_on_every_rank_of_a_base_root(base: Path, tmp_path: Path) -> None:
    clean = cli_json("clean", "--root", str(base), "--yes")
    assert clean["kind"] == "base" and _ranks(clean) == ALL and clean["exit"] == 0
    for s in clean["stores"]:
        assert s["result"]["steps"]["released"]["entries"] == 1
        with Store.open(s["root"]) as store:
            assert store.released() == (0, 0) and store.totals().entries == 2
    scrub = cli_json("scrub", "--root", str(base), "--rate", "0")
    assert _ranks(scrub) == ALL
    for s in scrub["stores"]:
        assert s["result"]["checked"] == 2 and s["result"]["cycle_completed"]
        with Store.open(s["root"]) as store:  # progress recorded on each rank
            assert ScrubState.summary_of(store).last_cycle.checked == 2
    prom = Path(os.path.realpath(tmp_path)) / "spoolctl.prom"
    proc = script("metrics", "--root", str(base), "--textfile", str(prom))
    assert proc.returncode == 0, proc.stderr
    text = prom.read_text()
    for dep, rank in ALL:
        line = f'spoolctl_store_entries{{deployment="{dep}",rank="{rank:04d}"}} 2.0'
        assert line in text, text
        assert f'spoolctl_store_up{{deployment="{dep}",rank="{rank:04d}"}} 1.0' in text


def test_a_deployment_directory_and_the_filters(base: Path) -> None:
    dep = base / DEP_A
    doc = cli_json("clean", "--root", str(dep), "--yes", "--dry-run")
    assert doc["kind"] == "deployment" and _ranks(doc) == ALL[:2]
    assert cli_json("ls", "--root", str(base), "--rank", "1")["stores"][0]["rank"] == 1
    narrowed = cli_json("status", "--root", str(base), "--deployment", DEP_B[:12])
    assert _ranks(narrowed) == [(DEP_B, 0)]
    assert narrowed["deployments"][DEP_B]["agree"]
    for args in (("--rank", "7"), ("--deployment", "nope")):
        proc = cli("status", "--root", str(base), *args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    one = cli("status", "--root", str(dep / "rank-0000"), "--rank", "0")
    assert one.returncode == 2 and "apply to a vLLM base root" in one.stderr


def test_every_command_accepts_the_base_root(base: Path) -> None:
    target = _fill(base / DEP_A / "rank-0001", 1, released=0)[2]  # already there: same ids
    assert cli_json("status", "--root", str(base))["exit"] == 0
    assert [s["result"]["count"] for s in cli_json("ls", "--root", str(base))["stores"]] == \
        [3, 3, 3]
    found = cli_json("inspect", target[:12], "--root", str(base))
    assert _ranks(found) == [(DEP_A, 1)] and found["stores"][0]["result"]["entry_id"] == target
    assert cli_json("request-auth", target, "--root", str(base))["stores"][0]["result"][
        "result"] == "verified"
    absent = cli("inspect", "ab" * 32, "--root", str(base))
    assert absent.returncode == 1 and absent.stderr.startswith("error: no entry")
    assert cli_json("doctor", "--root", str(base))["kind"] == "base"
    assert cli_json("quarantine", "ls", "--root", str(base))["exit"] == 0
    assert cli_json("quarantine", "purge", "--root", str(base), "--all", "--yes")["exit"] == 0
    inited = cli_json("init", "--root", str(base), "--max-size", "1GiB")
    assert [s["result"]["max_bytes"] for s in inited["stores"]] == [1 << 30] * 3
    human = cli("clean", "--root", str(base), "--yes")
    assert human.returncode == 0, human.stderr
    for dep, rank in ALL:  # each rank under its own heading
        assert f"{dep}/rank-{rank:04d}" in human.stdout
    assert "3 stores under" in human.stdout


def test_one_failing_rank_does_not_stop_the_others(base: Path) -> None:
    bad = base / DEP_A / "rank-0001"
    marker = json.loads((bad / ".spoolctl-root").read_text())
    (bad / ".spoolctl-root").write_text(json.dumps({**marker, "created": "yesterday"}))
    doc = cli_json("clean", "--root", str(base), "--yes", expect=2)
    by_rank = {(s["deployment"], s["rank"]): s for s in doc["stores"]}
    assert "invalid created" in by_rank[(DEP_A, 1)]["error"]
    for key in ((DEP_A, 0), (DEP_B, 0)):
        assert by_rank[key]["exit"] == 0
        with Store.open(by_rank[key]["root"]) as store:
            assert store.released() == (0, 0)


def test_an_empty_base_root_is_nothing_to_do(tmp_path: Path) -> None:
    base = Path(os.path.realpath(tmp_path)) / "spool"
    base.mkdir()
    (base / DEP_A).mkdir()  # the connector made the directory, no rank store yet
    for args in (["clean", "--yes"], ["scrub"], ["status"], ["ls"]):
        proc = cli(*args, "--root", str(base))
        assert proc.returncode == 0, (args, proc.stderr)
        assert "nothing to" in proc.stdout and proc.stderr == ""
    assert cli_json("clean", "--root", str(base), "--yes")["stores"] == []
    assert not (base / ".spoolctl-root").exists() and sorted(os.listdir(base)) == [DEP_A]


def test_a_path_that_is_no_root_says_so_without_advising_init(tmp_path: Path) -> None:
    odd = Path(os.path.realpath(tmp_path)) / "odd"
    odd.mkdir()
    (odd / "notes.txt").write_text("hello")
    for args in (["clean", "--yes"], ["scrub"], ["metrics"], ["status"]):
        proc = script(*args, "--root", str(odd))
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.count("\n") == 1 and "spoolctl init" not in proc.stderr
        assert "deployment directory or base root" in proc.stderr


def test_status_of_a_base_root_checks_every_deployment(base: Path) -> None:
    with Store.open(base / DEP_A / "rank-0001") as store:
        store.release(entry_id_for("vllm", "vllm-v1-ns-r1", f"{2:064x}"))
    doc = cli_json("status", "--root", str(base), "--check", expect=1)
    assert not doc["deployments"][DEP_A]["agree"] and doc["deployments"][DEP_B]["agree"]
    table = cli("status", "--root", str(base))
    assert table.returncode == 0 and "ranks disagree" in table.stdout


def test_status_names_each_deployment_and_shows_its_capacity(base: Path) -> None:
    """Issue 36.9: with several deployments on a root, status (human and JSON) says which is
    which (model, dtype, TP from the deployment.json its workers write) and each rank's max
    size and usage; a missing or unusable description is said, never fatal."""
    from spoolctl.connector.deployment import description
    from spoolctl.connector.deployment.identity import DeploymentIdentity

    ident = DeploymentIdentity(model="/models/llama-3-8b", revision=None,
                               dtype="torch.bfloat16", kv_cache_dtype="auto", block_size=16,
                               kv_layout=(), tp_size=2, pp_size=1, tp_rank=0, pp_rank=0,
                               engine="vllm-0.32", chunk_tokens=256, weights="w" * 16)
    description.record(base / DEP_A, ident)
    (base / DEP_B / "deployment.json").write_text("[not a description]")
    for rank in (0, 1):
        cli("init", "--root", str(base / DEP_A / f"rank-{rank:04d}"), "--max-size", "1MiB")
    doc = cli_json("status", "--root", str(base))
    a, b = doc["deployments"][DEP_A], doc["deployments"][DEP_B]
    assert a["description"]["model"] == "/models/llama-3-8b"
    assert (a["description"]["tp_size"], a["description"]["dtype"]) == (2, "torch.bfloat16")
    assert b["description"] is None and "not a deployment description" in b[
        "description_error"]
    assert [r["max_bytes"] for r in a["ranks"]] == [1 << 20, 1 << 20]
    out = cli("status", "--root", str(base)).stdout
    assert "model /models/llama-3-8b, bfloat16 (KV cache auto), TP 2 x PP 1" in " ".join(
        out.split())
    usage = 100 * a["ranks"][0]["bytes"] / (1 << 20)
    assert f"│ 1.0 MiB  │ {usage:.1f}%" in out  # A's ranks: max size, usage
    assert "│ none     │ -" in out  # B's rank: no max size
    words = " ".join(out.split())  # rich wraps long lines
    assert "deployment.json is not a deployment description" in words
    assert "hit rate: no lookup recorded yet" in words  # no engine has run: where to look


def test_status_shows_the_engines_hit_rate(base: Path) -> None:
    """Issue 36.9: `status` on a root shows the hit rate its engine counted (the scheduler's
    usage.json, written at most every interval and only when the counts changed, off the
    scheduler's thread); a malformed or inconsistent record is said, never fatal."""
    from waiting import wait_until

    from spoolctl.connector.deployment import usage_record

    now = [1_000_000.0]
    for rank in (0, 1):
        cli("init", "--root", str(base / DEP_A / f"rank-{rank:04d}"), "--max-size", "1MiB")
    rec = usage_record.UsageRecorder(base / DEP_A, interval=15.0, clock=lambda: now[0])
    counts = [(4096, 3072, 4, 3)]
    def written() -> object:
        return wait_until(lambda: not rec._busy.locked(), what="the background write")

    assert rec.offer(lambda: counts[-1])  # the first offer writes
    written()
    assert usage_record.read(base / DEP_A).lookup_tokens == 4096
    now[0] += 5
    counts.append((8192, 7168, 8, 7))
    assert not rec.offer(lambda: counts[-1])  # within the interval: not written
    now[0] += 15
    assert rec.offer(lambda: counts[-1])
    written()
    assert usage_record.read(base / DEP_A).lookup_tokens == 8192
    now[0] += 1
    counts.append((8192 + 512, 7168 + 512, 9, 8))
    assert not rec.offer(lambda: counts[-1])  # changed, but within the interval...
    rec.close(lambda: counts[-1])  # ...and the engine's exit writes the final counts
    assert usage_record.read(base / DEP_A).lookup_tokens == 8192 + 512
    now[0] += 20
    assert not rec.offer(lambda: counts[-1])  # unchanged since the last write: none
    (base / DEP_A / "usage.json").write_text(json.dumps(
        {"schema": "spoolctl-usage/v1", "since": 1_000_000.0, "updated": 1_000_020.0,
         "lookup_tokens": 8192, "hit_tokens": 7168, "lookups": 8, "hits": 7}))
    doc = cli_json("status", "--root", str(base))
    usage = doc["deployments"][DEP_A]["usage"]
    assert (usage["hit_tokens"], usage["lookup_tokens"], usage["hits"]) == (7168, 8192, 7)
    assert usage["hit_rate"] == 7168 / 8192 and usage["since"] == 1_000_000.0
    words = " ".join(cli("status", "--root", str(base)).stdout.split())
    assert "hit rate: 87.5% of prompt tokens (7,168 of 8,192 restored; 7 of 8 requests hit)" \
        in words
    # Hand-edited into nonsense (more hits than lookups): said, and status still works.
    (base / DEP_A / "usage.json").write_text(json.dumps(
        {"schema": "spoolctl-usage/v1", "since": 1.0, "updated": 2.0, "lookup_tokens": 1,
         "hit_tokens": 5, "lookups": 1, "hits": 1}))
    doc = cli_json("status", "--root", str(base))
    assert doc["deployments"][DEP_A]["usage"] is None
    assert "is not a usage record" in doc["deployments"][DEP_A]["usage_error"]
