"""End-to-end tests of the ``spoolctl`` console script, run as a real process on real
stores in temp dirs (corrupt bytes, kill -9, concurrent processes)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from operator_cli import ENV, SPOOLCTL, script, script_json
from waiting import wait_until

from spoolctl.store import Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

cli = script  # the installed console script, stdin not a terminal (like cron)
cli_json = script_json


def payload(key: str, size: int) -> bytes:
    import random

    return random.Random(key).randbytes(size)


def fill(root: Path, n: int, *, size: int = 4096, kind: str = "pytorch",
         max_bytes: int | None = None) -> list[str]:
    """Commit ``n`` entries with deterministic payloads; return their ids."""
    with Store.open(root, create=True, max_bytes=max_bytes) as store:
        return [store.put(kind=kind, namespace="model-a", key=f"k{i}",
                          objects={"kv": payload(f"k{i}", size)}).entry_id for i in range(n)]


def object_path(root: Path, entry_id: str) -> Path:
    with Store.open(root) as store:
        return store.layout.object_path(store.manifest(entry_id).objects[0].digest)


def flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return Path(os.path.realpath(tmp_path)) / "store"


# -- init / status / ls / inspect ----------------------------------------------------------


def test_init_status_ls_inspect(root: Path) -> None:
    doc = cli_json("init", "--root", str(root), "--max-size", "64MiB")
    assert doc["max_bytes"] == 64 << 20 and doc["created"] is True
    ids = fill(root, 6)
    with Store.open(root) as store:
        store.release(ids[0])
        genai = store.put(kind="genai", namespace="gemini", key="g", objects={},
                          index={"name": "cachedContents/x", "model": "m",
                                 "expire_time": time.time() + 600})
    status = cli_json("status", "--root", str(root))
    for key in ("root", "entries", "bytes", "max_bytes", "released", "quarantined", "by_kind",
                "scrub"):
        assert key in status
    assert status["root"] == str(root)
    assert status["entries"] == 7
    assert status["by_kind"]["pytorch"]["entries"] == 6
    assert status["by_kind"]["pytorch"]["released"] == 1
    assert status["released"]["entries"] == 1
    assert status["quarantined"]["items"] == 0
    assert status["genai"]["entries"] == 1 and 0 < status["genai"]["next_expiry_in_s"] <= 600
    assert status["max_bytes"] == 64 << 20 and 0 < status["usage_pct"] < 100

    listing = cli_json("ls", "--root", str(root), "--kind", "pytorch", "--hint", "release")
    assert [e["entry_id"] for e in listing["entries"]] == [ids[0]]
    listing = cli_json("ls", "--root", str(root), "--sort", "size", "--limit", "2")
    assert listing["count"] == 2
    g = cli_json("ls", "--root", str(root), "--kind", "genai")["entries"][0]
    assert g["entry_id"] == genai.entry_id and 0 < g["expires_in_s"] <= 600

    info = cli_json("inspect", ids[1][:10], "--root", str(root))
    assert info["entry_id"] == ids[1] and info["hint"] == "retain"
    assert info["objects"][0]["size"] == 4096 and info["objects"][0]["present"] is True
    assert len(info["objects"][0]["digest"]) == 64

    human = cli("status", "--root", str(root))
    assert human.returncode == 0 and "quarantined" in human.stdout and "\x1b[" not in human.stdout
    # Bare `spoolctl` shows the status of $SPOOLCTL_ROOT.
    bare = cli(env={**ENV, "SPOOLCTL_ROOT": str(root)})
    assert bare.returncode == 0 and str(root) in bare.stdout


def test_bad_arguments_exit_2_with_one_line(root: Path, tmp_path: Path) -> None:
    fill(root, 1)
    missing = str(Path(os.path.realpath(tmp_path)) / "nope")
    cases = [
        ("init", "--root", str(root) + "x", "--max-size", "12XB"),
        ("init", "--root", str(root) + "x", "--max-size", "-5"),
        ("status", "--root", "relative/store"),
        ("status", "--root", missing),
        ("inspect", "not-hex!", "--root", str(root)),
        ("request-auth", "XYZ", "--root", str(root)),
        ("ls", "--root", str(root), "--sort", "sideways"),
        ("ls", "--root", str(root), "--kind", "tensorflow"),
        ("scrub", "--root", str(root), "--rate", "fast"),
        ("clean", "--root", str(root)),  # destructive, stdin not a TTY, no --yes
        ("quarantine", "purge", "--root", str(root)),
        ("quarantine", "show", "../../etc", "--root", str(root)),
        ("config", "vllm", "--root", "rel"),
        ("metrics", "--root", str(root), "--textfile", "metrics.prom"),
    ]
    for args in cases:
        proc = cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr)
        assert len(lines) == 1 and lines[0].startswith("error:"), (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert not Path(str(root) + "x").exists()  # a bad size creates nothing
    # Not found is a finding (exit 1, docs/cli.md), with the same one line.
    for args in (("inspect", "deadbeef", "--root", str(root)),
                 ("inspect", "ab" * 32, "--root", str(root))):
        proc = cli(*args)
        assert proc.returncode == 1, (args, proc.returncode, proc.stderr)
        assert proc.stderr.startswith("error: no entry ") and proc.stderr.count("\n") == 1
    # --debug shows the traceback instead.
    debug = cli("--debug", "status", "--root", "relative/store")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_version_and_help_examples() -> None:
    assert cli("--version").stdout.strip().startswith("spoolctl ")
    commands = [["init"], ["status"], ["ls"], ["inspect"], ["scrub"], ["request-auth"],
                ["clean"], ["quarantine", "ls"], ["quarantine", "show"],
                ["quarantine", "restore"], ["quarantine", "purge"], ["metrics"], ["doctor"],
                ["config", "vllm"]]
    for cmd in commands:
        proc = cli(*cmd, "--help")
        assert proc.returncode == 0 and "Example" in proc.stdout, cmd


# -- corruption, scrub, quarantine, request-auth ----------------------------------------------


def test_corrupt_byte_scrub_quarantine_restore(root: Path) -> None:
    ids = fill(root, 5)
    bad = ids[2]
    obj = object_path(root, bad)
    flip_byte(obj)

    report = cli_json("scrub", "--root", str(root), "--rate", "0", expect=1)
    assert report["quarantined"] == [{"entry_id": bad, "reason": "payload_digest"}]
    assert report["checked"] == 4 and report["cycle_completed"] is True

    items = cli_json("quarantine", "ls", "--root", str(root))["items"]
    assert len(items) == 1
    item = items[0]
    assert item["reason"] == "payload_digest" and item["entry_id"] == bad
    assert bad not in [e["entry_id"] for e in cli_json("ls", "--root", str(root))["entries"]]
    status = cli_json("status", "--root", str(root))
    assert status["quarantined"]["items"] == 1
    assert status["quarantined"]["by_reason"] == {"payload_digest": 1}
    assert status["scrub"]["last_cycle"]["quarantined"] == 1
    assert status["scrub"]["last_findings"][0]["entry_id"] == bad
    assert cli("status", "--root", str(root), "--check").returncode == 1

    # A second scrub finds nothing new: exit 0, and never re-admits the bad entry.
    assert cli_json("scrub", "--root", str(root), "--rate", "0")["quarantined"] == []
    assert cli_json("request-auth", bad, "--root", str(root), expect=1)["result"] == "quarantined"
    by_prefix = cli_json("request-auth", bad[:8], "--root", str(root), expect=1)
    assert by_prefix["result"] == "quarantined" and by_prefix["reason"] == "payload_digest"
    assert cli("inspect", bad[:8], "--root", str(root)).returncode == 1  # a finding, not a typo

    shown = cli_json("quarantine", "show", item["item"], "--root", str(root))
    assert f"{bad}.json" in shown["contents"]
    # Restore re-verifies: still corrupt -> exit 1, nothing moved.
    assert cli("quarantine", "restore", item["item"], "--root", str(root)).returncode == 1
    assert len(cli_json("quarantine", "ls", "--root", str(root))["items"]) == 1
    # Repair the evidence (flip the byte back): now it verifies and is re-admitted.
    evidence = Path(item["path"]) / obj.name
    flip_byte(evidence)
    assert cli_json("quarantine", "restore", item["item"], "--root", str(root))["restored"]
    assert cli_json("request-auth", bad, "--root", str(root))["result"] == "verified"
    assert cli_json("quarantine", "ls", "--root", str(root))["count"] == 0
    with Store.open(root) as store:
        m = store.lookup("pytorch", "model-a", "k2")
        assert m is not None and bytes(store.read(m, "kv")) == payload("k2", 4096)


def test_request_auth_healthy_corrupt_missing(root: Path) -> None:
    ids = fill(root, 3)
    flip_byte(object_path(root, ids[1]))
    ok = cli_json("request-auth", ids[0], "--root", str(root))
    assert ok["result"] == "verified" and ok["via"] == "direct"
    bad = cli_json("request-auth", ids[1][:8], "--root", str(root), expect=1)
    assert bad["result"] == "quarantined" and bad["reason"] == "payload_digest"
    absent = cli_json("request-auth", "0" * 64, "--root", str(root), expect=1)
    assert absent["result"] == "absent"
    human = cli("request-auth", ids[0], "--root", str(root))
    assert human.returncode == 0 and "verified" in human.stdout


OWNER_SCRIPT = textwrap.dedent("""
    import sys, time
    from spoolctl.store import Store
    from spoolctl.store.maintain.maintainer import BackgroundMaintainer
    store = Store.open(sys.argv[1])
    m = BackgroundMaintainer(store, interval_s=0.1, scrub_rate_bytes=1 << 30, role="test-worker")
    m.start()
    assert m.owns_store
    print("ready", flush=True)
    sys.stdin.read()  # run until the test closes stdin
    m.stop()
    print(m.counters.auth_requests, flush=True)
""")


def test_request_auth_queued_for_live_owner(root: Path) -> None:
    ids = fill(root, 3)
    flip_byte(object_path(root, ids[2]))
    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, str(root)], env=ENV,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "ready"
        status = cli_json("status", "--root", str(root))
        assert status["owner"]["role"] == "test-worker" and status["owner"]["pid"] == owner.pid
        queued = cli_json("request-auth", ids[0], "--root", str(root))
        assert queued["result"] == "queued" and queued["request_id"] >= 1
        got = cli_json("request-auth", ids[0], "--root", str(root), "--wait", "--timeout", "60")
        assert got["result"] == "verified" and got["via"] == "owner"
        got = cli_json("request-auth", ids[2], "--root", str(root), "--wait", "--timeout", "60",
                       expect=1)
        assert got["result"] == "quarantined" and got["via"] == "owner"
        # A CLI scrub next to the worker's background scrub: they take turns on the scrub
        # lock and share one cycle, so the bad entry is quarantined exactly once.
        proc = cli("scrub", "--root", str(root), "--rate", "0", "--until-complete", "--json")
        assert proc.returncode in (0, 1), proc.stderr
        assert json.loads(proc.stdout)["cycle_completed"] is True
        items = cli_json("quarantine", "ls", "--root", str(root))["items"]
        assert [(i["entry_id"], i["reason"]) for i in items] == [(ids[2], "payload_digest")]
    finally:
        out, _ = owner.communicate("", timeout=60)
    assert owner.returncode == 0
    assert int(out.split()[-1]) >= 3  # the queued one, and the two waited for
    assert cli_json("status", "--root", str(root))["owner"] is None


# -- kill -9 during scrub ---------------------------------------------------------------------


def _cycle(root: Path) -> tuple:
    db = sqlite3.connect(str(root / "state" / "scrub.sqlite3"))
    try:
        return db.execute("SELECT checked, quarantined, finished FROM cycles "
                          "ORDER BY cycle_id DESC LIMIT 1").fetchone()
    finally:
        db.close()


def test_scrub_killed_at_checkpoint_resumes_to_completion(root: Path) -> None:
    fill(root, 12, size=1024)
    crash = cli("scrub", "--root", str(root), "--rate", "0",
                env={**ENV, "SPOOLCTL_CRASH_AT": "scrub.progress_saved:5"})
    assert crash.returncode == 86  # faults.CRASH_EXIT_CODE: died like kill -9
    assert _cycle(root)[:2] == (5, 0)
    done = cli_json("scrub", "--root", str(root), "--rate", "0")
    assert done["resumed"] is True and done["checked"] == 7 and done["cycle_completed"]
    status = cli_json("status", "--root", str(root))
    assert status["scrub"]["last_cycle"]["checked"] == 12
    assert status["scrub"]["current"] is None


def test_scrub_killed_mid_quarantine_never_readmits(root: Path) -> None:
    ids = fill(root, 4)
    flip_byte(object_path(root, ids[1]))
    crash = cli("scrub", "--root", str(root), "--rate", "0",
                env={**ENV, "SPOOLCTL_CRASH_AT": "quarantine.catalog_deleted"})
    assert crash.returncode == 86
    # The catalog row is gone but the manifest is still in manifests/: an orphan pass
    # could index it again. The resumed scrub re-verifies the in-flight entry first.
    assert (root / "manifests" / ids[1][:2] / f"{ids[1]}.json").exists()
    report = cli_json("scrub", "--root", str(root), "--rate", "0", expect=1)
    assert report["quarantined"] == [{"entry_id": ids[1], "reason": "payload_digest"}]
    assert report["cycle_completed"]
    assert cli_json("clean", "--root", str(root), "--yes", "--orphans", "--min-age", "0")
    listed = [e["entry_id"] for e in cli_json("ls", "--root", str(root))["entries"]]
    assert ids[1] not in listed and len(listed) == 3


def test_scrub_sigkill_midway_then_rerun(root: Path) -> None:
    fill(root, 8, size=32 << 10)  # 256 KiB in total
    proc = subprocess.Popen([SPOOLCTL, "scrub", "--root", str(root), "--rate", "64KiB/s"],
                            env=ENV, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    def progressed() -> bool:
        row = _safe_cycle(root) if (root / "state" / "scrub.sqlite3").exists() else None
        return bool(row and row[0] >= 2)

    try:
        wait_until(progressed, 60, what="two scrubbed entries")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    first = _safe_cycle(root)[0]
    assert 2 <= first < 8
    done = cli_json("scrub", "--root", str(root), "--rate", "0")
    assert done["resumed"] and done["cycle_completed"]
    assert first + done["checked"] in (8, 9)  # the in-flight entry may be verified twice
    assert cli_json("status", "--root", str(root))["scrub"]["last_cycle"]["checked"] in (8, 9)


def _safe_cycle(root: Path):
    try:
        return _cycle(root)
    except sqlite3.Error:
        return None


# -- clean ------------------------------------------------------------------------------------


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        if os.path.basename(dirpath) == "state":
            continue  # sqlite sidecar files may be touched by readers
        for f in files:
            st = os.stat(os.path.join(dirpath, f))
            out[os.path.join(dirpath, f)] = (st.st_size, st.st_mtime_ns)
    return out


def test_clean_dry_run_changes_nothing_then_cleans(root: Path) -> None:
    ids = fill(root, 6)
    with Store.open(root) as store:
        for entry_id in ids[:3]:
            store.release(entry_id)
        old = time.time() - 7200
        orphan = store.layout.object_path("f" * 64)
        orphan.write_bytes(b"orphan bytes")
        os.utime(orphan, (old, old))
        stale = store.layout.tmp / "1-0123456789abcdef.part"
        stale.write_bytes(b"x" * 100)
        os.utime(stale, (old, old))
    before = _snapshot(root)
    before_ls = cli_json("ls", "--root", str(root))
    plan = cli_json("clean", "--root", str(root), "--dry-run")
    assert plan["dry_run"] is True
    assert plan["steps"]["released"]["entries"] == 3
    assert plan["steps"]["orphans"]["objects"] == 1
    assert plan["steps"]["tmp"]["files"] == 1
    assert _snapshot(root) == before
    assert cli_json("ls", "--root", str(root)) == before_ls

    done = cli_json("clean", "--root", str(root), "--yes")
    assert done["steps"]["released"]["entries"] == 3
    assert done["steps"]["orphans"]["objects"] == 1 and not orphan.exists()
    assert done["steps"]["tmp"]["files"] == 1 and not stale.exists()
    assert done["total"]["entries"] == 3
    left = {e["entry_id"] for e in cli_json("ls", "--root", str(root))["entries"]}
    assert left == set(ids[3:])
    with Store.open(root) as store:
        for i in range(3, 6):
            m = store.lookup("pytorch", "model-a", f"k{i}")
            assert m is not None and bytes(store.read(m, "kv")) == payload(f"k{i}", 4096)


def test_clean_capacity_selector(root: Path) -> None:
    fill(root, 10, size=10_000, max_bytes=1 << 20)
    with Store.open(root) as store:
        store.set_max_bytes(50_000)
    plan = cli_json("clean", "--root", str(root), "--capacity", "--dry-run")
    assert set(plan["steps"]) == {"capacity"} and plan["steps"]["capacity"]["entries"] >= 6
    done = cli_json("clean", "--root", str(root), "--capacity", "--yes")
    assert done["steps"]["capacity"]["entries"] == plan["steps"]["capacity"]["entries"]
    assert cli_json("status", "--root", str(root))["bytes"] <= 45_000


CHURN_SCRIPT = textwrap.dedent("""
    import json, os, random, sys, time
    from spoolctl.store import Store, NotFoundError, CorruptionError
    def payload(key, size):
        return random.Random(key).randbytes(size)
    store = Store.open(sys.argv[1])
    stop = sys.argv[2]  # churns until the test creates this file (or 10 minutes pass)
    deadline = time.monotonic() + 600
    hits = misses = wrong = i = 0
    while not os.path.exists(stop) and time.monotonic() < deadline:
        key = f"c{i}"
        m = store.put(kind="pytorch", namespace="churn", key=key,
                      objects={"kv": payload(key, 3000)})
        if i % 2 == 0:
            store.release(m.entry_id)
        probe = f"c{random.randrange(i + 1)}"
        hit = store.lookup("pytorch", "churn", probe)
        if hit is None:
            misses += 1
        else:
            try:
                data = bytes(store.read(hit, "kv"))
            except (NotFoundError, CorruptionError):
                misses += 1
            else:
                hits += 1
                wrong += data != payload(probe, 3000)
        i += 1
    print(json.dumps({"puts": i, "hits": hits, "misses": misses, "wrong": wrong}))
""")


def test_clean_races_commits_and_lookups_without_wrong_answers(root: Path,
                                                              tmp_path: Path) -> None:
    fill(root, 1)
    stop = tmp_path / "stop-churn"
    churn = subprocess.Popen([sys.executable, "-c", CHURN_SCRIPT, str(root), str(stop)],
                             env=ENV, stdout=subprocess.PIPE, text=True)
    cleans = deleted = 0
    try:
        # cleans race the churn until several of them have deleted what it released
        while churn.poll() is None and (cleans < 3 or deleted == 0) and cleans < 200:
            doc = cli_json("clean", "--root", str(root), "--released", "--yes")
            deleted += doc["steps"]["released"]["entries"]
            cleans += 1
    finally:
        stop.touch()
    out, _ = churn.communicate(timeout=120)
    assert churn.returncode == 0
    stats = json.loads(out)
    assert stats["wrong"] == 0
    assert stats["hits"] > 0 and cleans >= 3 and deleted > 0
    # Every retained (odd) key is intact; every released one is gone after a final clean.
    cli_json("clean", "--root", str(root), "--released", "--yes")
    assert cli_json("quarantine", "ls", "--root", str(root))["count"] == 0
    with Store.open(root) as store:
        for i in range(stats["puts"]):
            m = store.lookup("pytorch", "churn", f"c{i}")
            if i % 2:
                assert m is not None and bytes(store.read(m, "kv")) == payload(f"c{i}", 3000)
            else:
                assert m is None


# -- quarantine purge, metrics, doctor, config ---------------------------------------------------


def test_quarantine_purge(root: Path) -> None:
    ids = fill(root, 2)
    flip_byte(object_path(root, ids[0]))
    cli_json("scrub", "--root", str(root), "--rate", "0", expect=1)
    assert cli_json("quarantine", "purge", "--root", str(root), "--older-than", "7d",
                    "--yes")["count"] == 0
    dry = cli_json("quarantine", "purge", "--root", str(root), "--all", "--dry-run")
    assert dry["count"] == 1 and cli_json("quarantine", "ls", "--root", str(root))["count"] == 1
    done = cli_json("quarantine", "purge", "--root", str(root), "--all", "--yes")
    assert done["count"] == 1 and done["bytes"] > 0
    assert cli_json("quarantine", "ls", "--root", str(root))["count"] == 0


def test_metrics_stdout_and_textfile(root: Path, tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    ids = fill(root, 3)
    with Store.open(root) as store:
        store.release(ids[0])
    proc = cli("metrics", "--root", str(root))
    assert proc.returncode == 0
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(proc.stdout) for s in fam.samples}
    assert samples[("spoolctl_store_entries", ())] == 3
    assert samples[("spoolctl_store_released_entries", ())] == 1
    assert samples[("spoolctl_store_kind_entries", (("kind", "pytorch"),))] == 3
    assert all(name.startswith("spoolctl_") for name, _ in samples)
    target = Path(os.path.realpath(tmp_path)) / "spoolctl.prom"
    assert cli("metrics", "--root", str(root), "--textfile", str(target)).returncode == 0
    def steady(text: str) -> list[str]:  # the filesystem's free room moves with other writers
        return [line for line in text.splitlines() if "spoolctl_fs_" not in line]

    assert steady(target.read_text()) == steady(proc.stdout)
    assert [p.name for p in target.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_doctor(root: Path) -> None:
    fill(root, 1)
    doc = cli_json("doctor", "--root", str(root))
    names = {c["name"]: c["status"] for c in doc["checks"]}
    assert doc["ok"] is True
    for name in ("root.marker", "root.permissions", "fs.type", "fs.free", "fs.o_direct",
                 "fs.fsync", "sqlite.catalog.sqlite3"):
        assert name in names
    assert names["sqlite.catalog.sqlite3"] == "ok"
    os.chmod(root / "objects", 0o755)
    doc = cli_json("doctor", "--root", str(root))
    perm = next(c for c in doc["checks"] if c["name"] == "root.permissions")
    assert perm["status"] == "warn" and "objects" in perm["detail"] and perm["fix"]
    (root / ".spoolctl-root").unlink()
    doc = cli_json("doctor", "--root", str(root), expect=1)
    assert doc["ok"] is False


def test_config_vllm(root: Path) -> None:
    proc = cli("config", "vllm", "--root", str(root), "--max-size", "200GiB")
    assert proc.returncode == 0
    assert json.loads(proc.stdout) == {
        "kv_connector": "SpoolConnector",
        "kv_connector_module_path": "spoolctl.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"spoolctl_root": str(root), "spoolctl_max_size": "200GiB"},
    }
    assert cli("config", "vllm", "--root", str(root), "--max-size", "lots").returncode == 2
