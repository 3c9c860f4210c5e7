"""Benchmark ``spoolctl`` start-up against the interpreter's own; prints one JSON document.

    .venv/bin/python scripts/bench_startup.py [--runs 21]

Each case is a real process, started ``--runs`` times, interleaved with the others (so a
change in the host's load hits every case alike); the median wall time of each is reported,
and its ratio to ``python -c pass`` measured in the same run. The goal (issue 49 item 8):
``spoolctl --version`` and ``spoolctl status`` on an empty root within 2.5x the interpreter.
The floors are printed too: ``import typer`` alone (every command but ``--version`` parses
its options with typer) and typer plus rich (a human view renders with rich).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPOOLCTL = str(Path(sys.executable).parent / "spoolctl")
GOAL = 2.5


def cases(empty: str) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "python -c pass": [py, "-c", "pass"],
        "spoolctl --version": [SPOOLCTL, "--version"],
        "spoolctl status (empty root)": [SPOOLCTL, "status", "--root", empty],
        "spoolctl status --json (empty root)": [SPOOLCTL, "status", "--root", empty, "--json"],
        "floor: python -c 'import typer'": [py, "-c", "import typer"],
        "floor: python -c 'import typer, rich.console'": [py, "-c",
                                                          "import typer, rich.console"],
    }


def measure(runs: int) -> dict[str, float]:
    # Bytecode caches as an install has them: without them every import compiles its source.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SPOOLCTL_") and k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryDirectory(prefix="spool-startup-") as empty:
        todo = cases(empty)
        times: dict[str, list[float]] = {name: [] for name in todo}
        for argv in todo.values():  # warm the page cache once, untimed
            subprocess.run(argv, capture_output=True, env=env, check=False)
        for _ in range(runs):
            for name, argv in todo.items():
                t0 = time.perf_counter()
                proc = subprocess.run(argv, capture_output=True, env=env, check=False)
                times[name].append(time.perf_counter() - t0)
                if proc.returncode != 0:
                    raise SystemExit(f"{name} failed: {proc.stderr.decode()[-400:]}")
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    medians = measure(args.runs)
    base = medians["python -c pass"]
    rows = {name: {"median_s": round(m, 4), "ratio_to_python": round(m / base, 2)}
            for name, m in medians.items()}
    goals = ("spoolctl --version", "spoolctl status (empty root)",
             "spoolctl status --json (empty root)")
    print(json.dumps({
        "runs": args.runs, "python": sys.version.split()[0], "cpus": os.cpu_count(),
        "goal_ratio": GOAL, "cases": rows,
        "met": {name: rows[name]["ratio_to_python"] <= GOAL for name in goals},
    }, indent=2))


if __name__ == "__main__":
    main()
