"""A bounded run of the concurrency soak (scripts/soak.py): committers, `spoolctl clean`
and `spoolctl scrub` in loops and capacity eviction on one store; every invariant holds."""

from __future__ import annotations

import json
import subprocess
import sys

from testpaths import REPO_DIR

SOAK = REPO_DIR / "scripts" / "soak.py"


def test_short_soak_holds_every_invariant() -> None:
    proc = subprocess.run([sys.executable, str(SOAK), "--seconds", "6", "--no-controller"],
                          capture_output=True, text=True, timeout=600)
    doc = json.loads(proc.stdout)
    assert doc["ok"], proc.stdout + proc.stderr
    assert doc["errors"] == 0 and doc["lost_hints"] == 0 and doc["quarantined"] == 0
    assert doc["catalog_matches_manifests"] and doc["pending_rows"] == 0
    assert sum(r.get("commits", 0) for r in doc["roles"].values()) > 20
    assert doc["roles"]["clean"]["runs"] >= 1 and doc["roles"]["scrub"]["runs"] >= 1
    assert doc["bytes_left"] <= doc["max_bytes"]
    assert proc.returncode == 0
