"""Crash matrix: kill a real process at every durability checkpoint, N times, and check.

    python scripts/crash_matrix.py --repeat 5           # store + batch + scrub + pytorch (+ mlx)
    python scripts/crash_matrix.py --repeat 3 --only pytorch  # one family
    python scripts/crash_matrix.py child ...                  # internal: the process that dies

Families and what one trial does:

* ``store``   -- a store writer (``tests/store_worker.py``) dies at a commit, clean, eviction
  or quarantine checkpoint (``SPOOLCTL_CRASH_AT``, read by the tests' fault seam
  ``tests/faultseam.py``, which every child loads at start-up: spoolctl reads no such variable).
* ``batch``   -- a group commit (``Store.put_many``) of 8 entries, plus one that fails while
  it streams, dies at every commit checkpoint, at its first, a middle and a late pass.
* ``scrub``   -- ``spoolctl scrub --until-complete`` dies at the n-th ``scrub.progress_saved``
  with one corrupt entry in the store; the next scrub must resume the same cycle.
* ``pytorch`` / ``mlx`` -- a process running a real controller ``prepare`` dies at a store
  commit checkpoint; this process then reopens the store, prepares the same params again
  and compares greedy tokens with a cold run.

After every trial the invariants are checked: the interrupted entry is complete or absent (and
present once its manifest was durable; in a batch, exactly the entries whose manifest was
renamed before the crash are present), no committed entry was lost, nothing in the catalog
fails verification, and ``spoolctl clean --min-age 0s --yes`` leaves no temp file and no
unreferenced object. Prints one JSON document: trials, crashes reached, violations per family
(``violations`` must be 0). The tests (``tests/store/test_reliability_crash.py``) run one repetition
of the same trials; this script is the longer run whose figures docs/RELIABILITY.md reports.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STORE_WORKER = REPO / "tests" / "store_worker.py"
FAULT_BOOT = str(REPO / "tests" / "faultboot")  # the tests' fault seam (tests/faultseam.py)
# tests/faultseam.py's CRASH_EXIT_CODE (kept literal: the child has no import)
CRASH_EXIT_CODE = 86

COMMIT_POINTS = (
    "object.tmp_written", "manifest.tmp_written", "catalog.intent", "object.fsynced",
    "manifest.fsynced", "object.published", "object.dir_fsynced",
    "manifest.published", "manifest.dir_fsynced", "catalog.committed",
)  # = spoolctl.store.disk.faults.COMMIT_CHECKPOINTS
# A group commit passes each of these once per batch; the others once per object, manifest or
# directory: batch trials crash at the first, a middle and the last-but-one pass of those.
BATCH_ONCE = ("catalog.intent", "catalog.committed")
BATCH_SIZE = 8
# After these the manifest is durable: the entry must survive the crash.
DURABLE_POINTS = ("manifest.published", "manifest.dir_fsynced", "catalog.committed")
CLEAN_POINTS = ("clean.catalog_deleted", "clean.manifest_deleted", "clean.object_deleted")
EVICT_POINTS = ("evict.manifest_deleted", "evict.catalog_deleted", "evict.object_deleted")
QUARANTINE_POINTS = ("quarantine.catalog_deleted", "quarantine.moved")

SYSTEM_A = "You are a careful assistant for pump maintenance. Use the manual below."
SYSTEM_B = "You are a terse assistant for valve questions. Answer from the notes below."
DOC_A = "Manual: the pump starts when the valve is open and the tank is full. " * 3
DOC_B = "Notes: a valve must be closed slowly; check the gasket every week. " * 3
QUESTION = "Question: when does the pump start?"
SURVIVOR = {"instructions": [SYSTEM_A], "data": [DOC_A]}
VICTIM = {"instructions": [SYSTEM_B], "data": [DOC_B]}
GEN_TOKENS = 6


# -- the child process (it dies at the checkpoint) -----------------------------------------------

def child(framework: str, model: str, root: str, params_json: str) -> None:
    """Prepare ``params`` with a real controller; the crash env var kills it mid-commit."""
    from spoolctl.controllers import CachePrepareParams

    params = CachePrepareParams(**json.loads(params_json))
    ctl = make_controller(framework, model, root)
    handle = ctl.prepare(params)
    ctl.close()
    print(json.dumps({"source": handle.source, "ref": handle.ref}))
    sys.stdout.flush()
    os._exit(0)


def make_controller(framework: str, model: Any, root: str) -> Any:
    if framework == "pytorch":
        from spoolctl.controllers.pytorch import PyTorchCacheController

        return PyTorchCacheController(model, root)
    from spoolctl.controllers.mlx import MlxCacheController

    return MlxCacheController(model, root)


def make_backend(framework: str, model_dir: Path) -> Any:
    if framework == "pytorch":
        from spoolctl.controllers.pytorch import PyTorchBackend

        return PyTorchBackend(model_dir)
    from spoolctl.controllers.mlx import MlxBackend

    return MlxBackend(model_dir)


def _env(crash_at: str | None) -> dict[str, str]:
    """The child's environment: the tests' fault seam loads at its start-up (tests/faultboot)
    and reads the crash point; spoolctl itself reads no such variable."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPOOLCTL_CRASH_AT",
                                                             "SPOOLCTL_FAIL_AT")}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != FAULT_BOOT]
    env["PYTHONPATH"] = os.pathsep.join([FAULT_BOOT, *paths])
    if crash_at:
        env["SPOOLCTL_CRASH_AT"] = crash_at
    return env


def _run(argv: list[str], crash_at: str | None, timeout: float = 300) -> int:
    proc = subprocess.run(argv, env=_env(crash_at), capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO))
    if proc.returncode not in (0, 1, CRASH_EXIT_CODE):
        raise RuntimeError(f"{argv[1:3]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.returncode


def spoolctl(*args: str, crash_at: str | None = None) -> int:
    return _run([sys.executable, "-c", "from spoolctl.cli.app import main; main()", *args],
                crash_at)


# -- invariant checks (shared by every family) ---------------------------------------------------

def check_store(root: Path, *, corrupt_keys: frozenset[str] = frozenset()) -> list[str]:
    """Every catalog row committed; every entry either verifies or is absent; returns
    violations (empty = held).

    An interrupted delete (manifest -> row -> objects) can leave a row whose manifest is
    gone: that entry must be a miss (absent), and clean reclaims the rest. ``corrupt_keys``
    were damaged on purpose: reading them must fail verification (then they are quarantined).
    """
    from spoolctl.store import CorruptionError, NotFoundError, SpoolError, Store

    problems: list[str] = []
    with Store.open(root) as store:
        for row in store.entries(include_pending=True):
            if row.state != "committed":
                problems.append(f"pending row {row.entry_id[:12]} after reopen")
                continue
            try:
                manifest = store.manifest(row.entry_id)
                for ref in manifest.objects:
                    store.read(manifest, ref.name)
                if row.key in corrupt_keys:
                    problems.append(f"damaged entry {row.key} read back as healthy")
            except NotFoundError:
                if store.lookup(row.kind, row.namespace, row.key, touch=False) is not None:
                    problems.append(f"entry {row.entry_id[:12]} visible without its manifest")
            except CorruptionError as exc:
                if row.key not in corrupt_keys:
                    problems.append(f"entry {row.entry_id[:12]} fails verification: {exc}")
            except SpoolError as exc:
                problems.append(f"entry {row.entry_id[:12]} unreadable: {exc}")
    return problems


def check_reclaimed(root: Path) -> list[str]:
    """Run the operator's ``spoolctl clean --min-age 0s --yes``; then nothing is left over."""
    from spoolctl.store import Store

    code = spoolctl("clean", "--root", str(root), "--min-age", "0s", "--yes", "--json")
    problems = [] if code == 0 else [f"spoolctl clean exited {code}"]
    with Store.open(root) as store:
        leftovers = list(store.layout.tmp.iterdir())
        if leftovers:
            problems.append(f"temp files left after clean: {[p.name for p in leftovers]}")
        if any(row.hint == "release" for row in store.entries()):
            problems.append("released entries left after clean")
        referenced = {ref.digest for row in store.entries()
                      for ref in store.manifest(row.entry_id).objects}
        on_disk = {p.name[:-4] for p in store.layout.objects.rglob("*.obj")}
        if on_disk != referenced:
            problems.append(f"objects on disk != referenced ({len(on_disk)} vs "
                            f"{len(referenced)})")
    return problems


# -- families --------------------------------------------------------------------------------------

class ControllerTrials:
    """One loaded backend (this process) + children that die at commit checkpoints."""

    def __init__(self, framework: str, model_dir: Path):
        from spoolctl.controllers import CachePrepareParams

        self.framework = framework
        self.model_dir = model_dir
        self.backend = make_backend(framework, model_dir)
        # The controller normalises params.model to the resolved model directory; spelled
        # that way here too, params.key() is the key of the entries the trials look for.
        self.params = {name: CachePrepareParams(model=str(Path(model_dir).resolve()), **p)
                       for name, p in (("survivor", SURVIVOR), ("victim", VICTIM))}
        self.cold = {name: self._generate(None, p) for name, p in self.params.items()}

    def _generate(self, root: Path | None, params: Any) -> tuple[list[int], str]:
        with make_controller(self.framework, self.backend, str(root) if root else None) as ctl:
            handle = ctl.prepare(params)
            result = ctl.generate(params, QUESTION, GEN_TOKENS)
            return result.tokens, handle.source

    def trial(self, root: Path, point: str) -> dict[str, Any]:
        """Commit a survivor, kill a child at ``point`` while it commits the victim, check."""
        from spoolctl.store import Store

        tokens, _ = self._generate(root, self.params["survivor"])
        problems: list[str] = []
        code = _run([sys.executable, __file__, "child", self.framework, str(self.model_dir),
                     str(root), json.dumps(VICTIM)], crash_at=point)
        crashed = code == CRASH_EXIT_CODE
        if not crashed:
            problems.append(f"child did not reach {point} (exit {code})")
        problems += check_store(root)
        with Store.open(root) as store:
            ctl_kind = self.framework
            survivor = [r for r in store.entries(kind=ctl_kind)
                        if r.key == self.params["survivor"].key()]
            victim = [r for r in store.entries(kind=ctl_kind)
                      if r.key == self.params["victim"].key()]
            if not survivor or survivor[0].hint != "retain":
                problems.append("a committed entry was lost (or its hint changed)")
            if point in DURABLE_POINTS and not victim:
                problems.append("entry with a durable manifest was lost")
            if point not in DURABLE_POINTS and victim:
                problems.append("entry visible before its manifest was durable")
        # Prepare again in a fresh controller: a complete entry is a disk hit, an absent one
        # a cold prefill; either way the greedy tokens equal a cold run's.
        victim_tokens, source = self._generate(root, self.params["victim"])
        if victim_tokens != self.cold["victim"][0]:
            problems.append(f"tokens after the crash differ from a cold run ({source})")
        if source != ("disk" if point in DURABLE_POINTS else "cold"):
            problems.append(f"prepare after the crash was {source!r}")
        if tokens != self.cold["survivor"][0]:
            problems.append("survivor tokens differ from a cold run")
        problems += check_reclaimed(root)
        problems += check_store(root)
        return {"point": point, "crashed": crashed, "source_after": source,
                "problems": problems}


def store_trial(root: Path, point: str, rng: random.Random) -> dict[str, Any]:
    """A store writer killed at ``point`` (commit, clean, eviction or quarantine)."""
    from spoolctl.store import Store

    worker = [sys.executable, str(STORE_WORKER), str(root)]
    size = str(rng.randrange(1_000, 60_000))
    problems: list[str] = []
    for key in ("old", "mid", "keep"):  # oldest first: eviction takes old and mid
        _run([*worker, "put", key, "40000"], None)
    if point in COMMIT_POINTS:
        code = _run([*worker, "put", "victim", size], point)
    elif point in CLEAN_POINTS:
        code = _run([*worker, "release-clean", "mid"], point)
    elif point in EVICT_POINTS:
        code = _run([*worker, "evict", "130000"], point)
    else:
        with Store.open(root) as store:
            m = store.lookup("pytorch", "crash", "mid")
            obj = store.layout.object_path(m.object("a").digest)
            raw = bytearray(obj.read_bytes())
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
            obj.write_bytes(bytes(raw))
        code = _run([*worker, "read", "mid"], point)
    crashed = code == CRASH_EXIT_CODE
    if not crashed:
        problems.append(f"worker did not reach {point} (exit {code})")
    problems += check_store(root, corrupt_keys=frozenset(
        {"mid"} if point in QUARANTINE_POINTS else ()))
    with Store.open(root) as store:
        if store.lookup("pytorch", "crash", "keep") is None:
            problems.append("a committed entry was lost")
        victim = store.lookup("pytorch", "crash", "victim")
        if point in DURABLE_POINTS and victim is None:
            problems.append("entry with a durable manifest was lost")
        if point in COMMIT_POINTS and point not in DURABLE_POINTS and victim is not None:
            problems.append("entry visible before its manifest was durable")
        if point in CLEAN_POINTS and store.lookup("pytorch", "crash", "mid") is not None:
            problems.append("a released entry became visible again")
    problems += check_reclaimed(root)
    # An interrupted quarantine may leave the damaged entry's manifest, which clean's
    # reconcile re-indexes: the invariant is that no read ever gets its bytes (the read
    # fails verification and quarantines it), checked here.
    corrupt = frozenset({"mid"} if point in QUARANTINE_POINTS else ())
    problems += check_store(root, corrupt_keys=corrupt)
    if corrupt:
        with Store.open(root) as store:
            if store.lookup("pytorch", "crash", "mid") is not None or not any(
                    i.reason == "payload_digest" for i in store.quarantine_items()):
                problems.append("the damaged entry was not quarantined")
    return {"point": point, "crashed": crashed, "problems": problems}


def batch_trial(root: Path, point: str) -> dict[str, Any]:
    """A group commit killed at ``point`` (``name:n``): every entry of the batch is whole or
    absent, visible exactly when its manifest was renamed before the crash."""
    from spoolctl.store import Store

    sys.path.insert(0, str(STORE_WORKER.parent))
    from store_worker import batch_objects

    worker = [sys.executable, str(STORE_WORKER), str(root)]
    problems: list[str] = []
    _run([*worker, "put", "keep", "30000"], None)
    code = _run([*worker, "put-batch", "v", str(BATCH_SIZE), "20000"], point)
    crashed = code == CRASH_EXIT_CODE
    if not crashed:
        problems.append(f"worker did not reach {point} (exit {code})")
    problems += check_store(root)
    name, _, nth = point.partition(":")
    with Store.open(root) as store:
        if store.lookup("pytorch", "crash", "keep") is None:
            problems.append("a committed entry was lost")
        if store.lookup("pytorch", "crash", "v-bad") is not None:
            problems.append("the entry that failed while streaming is visible")
        visible = []
        for i in range(BATCH_SIZE):
            hit = store.lookup("pytorch", "crash", f"v-{i}")
            if hit is None:
                continue
            visible.append(i)
            want = batch_objects("v", i, 20000)
            if {n: bytes(store.read(hit, n)) for n in want} != want:
                problems.append(f"entry v-{i} has the wrong bytes")
        if name == "manifest.published":
            expect = list(range(int(nth)))
        elif name in ("manifest.dir_fsynced", "catalog.committed"):
            expect = list(range(BATCH_SIZE))
        else:
            expect = []
        if visible != expect:
            problems.append(f"visible entries {visible}, expected {expect}")
    problems += check_reclaimed(root)
    problems += check_store(root)
    return {"point": point, "crashed": crashed, "problems": problems}


def batch_points() -> list[str]:
    """Every commit checkpoint at its first pass, and the repeated ones also mid-step."""
    out = []
    for p in COMMIT_POINTS:
        passes = (1,) if p in BATCH_ONCE else (1, 2, 3) if p.endswith("dir_fsynced") \
            else (1, BATCH_SIZE // 2, BATCH_SIZE - 1)
        out += [f"{p}:{n}" for n in passes]
    return out


def scrub_trial(root: Path, nth: int, rng: random.Random) -> dict[str, Any]:
    """``spoolctl scrub`` killed at its nth progress save; a rerun resumes and finishes the
    cycle: every healthy entry authenticated, the corrupt one quarantined, none lost."""
    from spoolctl.store import Store
    from spoolctl.store.maintain.scrub import ScrubState

    problems: list[str] = []
    with Store.open(root, create=True) as store:
        ids = [store.put(kind="pytorch", namespace="scrub", key=f"k{i}",
                         objects={"kv": rng.randbytes(4096)}).entry_id for i in range(6)]
        bad = ids[rng.randrange(len(ids))]
        path = store.layout.object_path(store.manifest(bad).objects[0].digest)
        raw = bytearray(path.read_bytes())
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(raw))
    args = ("scrub", "--root", str(root), "--rate", "0", "--until-complete", "--json")
    code = spoolctl(*args, crash_at=f"scrub.progress_saved:{nth}")
    crashed = code == CRASH_EXIT_CODE
    if not crashed:
        problems.append(f"scrub did not reach progress save {nth} (exit {code})")
    code = spoolctl(*args)
    with Store.open(root) as store:
        state = ScrubState.of(store)
        try:
            last, current = state.last_finished(), state.current()
            findings = state.findings(last.cycle_id) if last else []
        finally:
            state.close()
        if last is None or current is not None or last.cycle_id != 1:
            problems.append("the interrupted cycle was not resumed and completed")
        elif last.checked + last.quarantined < len(ids) - 0:
            problems.append(f"cycle covered {last.checked + last.quarantined} of {len(ids)}")
        if [f["entry_id"] for f in findings] != [bad] and bad not in \
                {i.entry_id for i in store.quarantine_items()}:
            problems.append("the corrupt entry was not quarantined")
        live = store.live(ids)
        if live != set(ids) - {bad}:
            problems.append(f"healthy entries lost: {sorted(set(ids) - {bad} - live)}")
    problems += check_store(root)
    return {"point": f"scrub.progress_saved:{nth}", "crashed": crashed, "problems": problems}


# -- the matrix ------------------------------------------------------------------------------------

def _family(name: str, trials: list[tuple[str, Callable[[Path], dict]]], repeat: int,
            base: Path) -> dict[str, Any]:
    out = {"trials": 0, "crashed": 0, "violations": 0, "points": {}, "failures": []}
    started = time.monotonic()
    for rep in range(repeat):
        for label, fn in trials:
            root = base / f"{name}-{label.replace(':', '_')}-{rep}"
            result = fn(root)
            out["trials"] += 1
            out["crashed"] += int(result["crashed"])
            point = out["points"].setdefault(label, {"trials": 0, "violations": 0})
            point["trials"] += 1
            if result["problems"]:
                out["violations"] += 1
                point["violations"] += 1
                out["failures"].append({"point": label, "rep": rep,
                                        "problems": result["problems"]})
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(*sys.argv[2:6])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="repetitions of every trial")
    ap.add_argument("--only", action="append",
                    choices=["store", "batch", "scrub", "pytorch", "mlx"],
                    help="families to run")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    families = args.only or ["store", "batch", "scrub", "pytorch", "mlx"]
    rng = random.Random(args.seed)
    report: dict[str, Any] = {"repeat": args.repeat, "seed": args.seed, "families": {}}
    with tempfile.TemporaryDirectory(prefix="spool-crash-") as tmp:
        base = Path(os.path.realpath(tmp))
        models = base / "models"
        if "store" in families:
            points = COMMIT_POINTS + CLEAN_POINTS + EVICT_POINTS + QUARANTINE_POINTS
            report["families"]["store"] = _family(
                "store", [(p, lambda r, p=p: store_trial(r, p, rng)) for p in points],
                args.repeat, base)
        if "batch" in families:
            report["families"]["batch"] = _family(
                "batch", [(p, lambda r, p=p: batch_trial(r, p)) for p in batch_points()],
                args.repeat, base)
        if "scrub" in families:
            report["families"]["scrub"] = _family(
                "scrub", [(f"scrub.progress_saved:{n}", lambda r, n=n: scrub_trial(r, n, rng))
                          for n in (1, 2, 4, 6)], args.repeat, base)
        for fw in ("pytorch", "mlx"):
            if fw not in families:
                continue
            try:
                __import__("torch" if fw == "pytorch" else "mlx_lm")
            except ImportError as exc:
                report["families"][fw] = {"skipped": str(exc)}
                continue
            from spoolctl.demo.tinymodel import build_tiny_model

            model_dir = models / "tiny"
            if not model_dir.exists():
                build_tiny_model(model_dir, "tiny")
            trials = ControllerTrials(fw, model_dir)
            report["families"][fw] = _family(
                fw, [(p, lambda r, p=p, t=trials: t.trial(r, p)) for p in COMMIT_POINTS],
                args.repeat, base)
    report["violations"] = sum(f.get("violations", 0) for f in report["families"].values())
    print(json.dumps(report, indent=2))
    sys.exit(1 if report["violations"] else 0)


if __name__ == "__main__":
    main()
