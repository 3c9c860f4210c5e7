#!/usr/bin/env python3
"""Concurrency soak: several real processes on one store for a bounded time.

Roles (each its own process): committers (commit, read back and verify, release a
deterministic subset), a PyTorch prompt-cache controller (prepare / generate / release
on a locally generated tiny model), ``spoolctl clean`` and ``spoolctl scrub`` in loops,
and capacity eviction (the store has a small max size). Afterwards it checks the
invariants and prints JSON:

* the catalog matches the manifests (a reconcile pass indexes and drops nothing),
* no hint was lost (every surviving entry has the hint its writer last gave it),
* no reader ever saw a verification failure on a healthy entry, and nothing was
  quarantined (nothing was corrupted on purpose),
* operations per second and errors per role (errors must be 0).

    python scripts/soak.py --seconds 60 [--committers 2] [--no-controller]
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
from pathlib import Path

from spoolctl.store import BusyError, CorruptionError, NotFoundError, Store, StoreIOError


def payload(key: str) -> bytes:
    rnd = random.Random(key)
    return rnd.randbytes(rnd.randint(1_000, 60_000))


def role_committer(*, root: str, name: str, seconds: float, out: str) -> None:
    store = Store.open(root)
    deadline = time.monotonic() + seconds
    hints: dict[str, str] = {}
    stats = {"commits": 0, "reads": 0, "releases": 0, "verify_failures": 0, "errors": 0,
             "busy": 0}
    i = 0
    while time.monotonic() < deadline:
        key = f"{name}-{i}"
        try:
            store.put(kind="vllm", namespace="soak", key=key, objects={"kv": payload(key)})
            stats["commits"] += 1
            hints[key] = "retain"
            probe = f"{name}-{random.randrange(i + 1)}"
            m = store.lookup("vllm", "soak", probe)
            if m is not None:
                try:
                    if bytes(store.read(m, "kv")) != payload(probe):
                        stats["verify_failures"] += 1
                    stats["reads"] += 1
                except NotFoundError:
                    pass  # evicted or cleaned between lookup and read: a miss
                except CorruptionError:
                    stats["verify_failures"] += 1
            if i % 4 == 1:
                store.release(store.entry_id("vllm", "soak", key))
                hints[key] = "release"
                stats["releases"] += 1
        except BusyError:
            stats["busy"] += 1
        except StoreIOError:
            stats["errors"] += 1
        i += 1
    store.close()
    Path(out).write_text(json.dumps({"hints": hints, "stats": stats}))


def role_controller(*, root: str, model: str, seconds: float, out: str) -> None:
    from spoolctl.controllers import CachePrepareParams, open_local_controller

    stats = {"prepares": 0, "generates": 0, "releases": 0, "errors": 0, "cold_mismatch": 0}
    docs = [f"Reference document {n}: " + "spool cache soak text. " * 40 for n in range(6)]
    deadline = time.monotonic() + seconds
    expected: dict[int, list[int]] = {}
    with open_local_controller("pytorch", model, root) as ctl:
        i = 0
        while time.monotonic() < deadline:
            n = i % len(docs)
            params = CachePrepareParams(model=model, instructions=["You are terse."],
                                        data=docs[: n + 1])
            try:
                handle = ctl.prepare(params)
                stats["prepares"] += 1
                result = ctl.generate(handle, "Question: what is cached?", max_new_tokens=4)
                stats["generates"] += 1
                tokens = list(result.tokens)
                # the same prompt must always give the same greedy tokens, cached or not
                if expected.setdefault(n, tokens) != tokens:
                    stats["cold_mismatch"] += 1
                if i % 5 == 4 and handle:
                    ctl.release(handle.ref)
                    stats["releases"] += 1
            except Exception as exc:  # counted: the soak requires zero
                stats["errors"] += 1
                print(f"controller error: {exc!r}", file=sys.stderr)
            i += 1
    Path(out).write_text(json.dumps({"stats": stats}))


def role_cli(*, root: str, spoolctl: str, seconds: float, out: str, command: list[str]) -> None:
    deadline = time.monotonic() + seconds
    stats = {"runs": 0, "errors": 0, "findings": 0}
    while time.monotonic() < deadline:
        proc = subprocess.run([spoolctl, *command, "--root", root, "--json"],
                              capture_output=True, text=True, timeout=300)
        stats["runs"] += 1
        if proc.returncode == 1:
            stats["findings"] += 1
        elif proc.returncode != 0:
            stats["errors"] += 1
            print(f"{command[0]} failed: {proc.stderr.strip()[:300]}", file=sys.stderr)
        time.sleep(0.2)
    Path(out).write_text(json.dumps({"stats": stats}))


def check(root: str, committer_outputs: list[dict]) -> dict:
    with Store.open(root) as store:
        report = store.collect_orphans(min_age=0)
        rows = {r.key: r for r in store.entries(namespace="soak", include_pending=True)}
        lost_hints = []
        for out in committer_outputs:
            for key, hint in out["hints"].items():
                row = rows.get(key)
                if row is not None and row.hint != hint:
                    lost_hints.append(key)
        return {
            "catalog_matches_manifests": report.indexed == 0 and report.dropped_rows == 0,
            "reconcile": report.to_json(),
            "lost_hints": len(lost_hints),
            "pending_rows": sum(r.state != "committed" for r in rows.values()),
            "quarantined": len(store.quarantine_items()),
            "entries_left": store.totals().entries,
            "bytes_left": store.totals().bytes,
            "max_bytes": store.max_bytes,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--committers", type=int, default=2)
    parser.add_argument("--max-bytes", type=int, default=3 << 20)
    parser.add_argument("--no-controller", action="store_true")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        spec = json.loads(args.spec)
        {"committer": role_committer, "controller": role_controller,
         "cli": role_cli}[args.role](**spec)
        return 0

    spoolctl = str(Path(sys.executable).with_name("spoolctl"))
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(os.path.realpath(tmp))
        root = str(base / "store")
        Store.open(root, create=True, max_bytes=args.max_bytes).close()
        procs: dict[str, tuple[subprocess.Popen, Path]] = {}

        def spawn(label: str, role: str, **spec: object) -> None:
            out = base / f"{label}.json"
            spec.update(root=root, seconds=args.seconds, out=str(out))
            cmd = [sys.executable, __file__, "--role", role, "--spec", json.dumps(spec)]
            procs[label] = (subprocess.Popen(cmd), out)

        for n in range(args.committers):
            spawn(f"committer{n}", "committer", name=f"c{n}")
        if not args.no_controller:
            from spoolctl.demo.tinymodel import build_tiny_model

            spawn("controller", "controller", model=str(build_tiny_model(base / "model", "tiny")))
        spawn("clean", "cli", spoolctl=spoolctl,
              command=["clean", "--yes", "--min-age", "0s"])
        spawn("scrub", "cli", spoolctl=spoolctl,
              command=["scrub", "--max-items", "50", "--rate", "512MiB/s"])
        t0 = time.monotonic()
        results: dict[str, dict] = {}
        for name, (proc, out) in procs.items():
            proc.wait(timeout=args.seconds + 600)
            results[name] = json.loads(out.read_text()) if out.exists() else {
                "stats": {"errors": 1, "exit": proc.returncode}}
        elapsed = time.monotonic() - t0
        committers = [results[n] for n in results if n.startswith("committer")]
        summary = check(root, committers)
    ops = {name: r["stats"] for name, r in results.items()}
    total_errors = sum(s.get("errors", 0) + s.get("verify_failures", 0) + s.get("cold_mismatch", 0)
                       for s in ops.values())
    commits = sum(s.get("commits", 0) for s in ops.values())
    doc = {
        "benchmark": "soak", "seconds": round(elapsed, 1), "roles": ops,
        "commits_per_s": round(commits / elapsed, 1), "errors": total_errors, **summary,
    }
    ok = (total_errors == 0 and summary["lost_hints"] == 0 and summary["quarantined"] == 0
          and summary["catalog_matches_manifests"] and summary["pending_rows"] == 0)
    doc["ok"] = ok
    print(json.dumps(doc, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
