"""Issue 30.11: files with names spoolctl never writes -- not UTF-8, or not an object /
manifest name in a fan-out directory -- are reported by ``doctor`` wherever they are, named
with their odd bytes escaped. Before: only the top level was reported (by ``status``)."""

from __future__ import annotations

import os
from pathlib import Path

from operator_cli import run, run_json
from transfer_support import fill


def test_doctor_names_odd_files_in_every_store_directory(tmp_path: Path) -> None:
    root = tmp_path / "s"
    fill(root, 2, size=1000)
    obj_fan = sorted(os.listdir(root / "objects"))[0]
    man_fan = sorted(os.listdir(root / "manifests"))[0]
    places = [f"objects/{obj_fan}", f"manifests/{man_fan}", "state", "quarantine"]
    for where in places:
        with open(os.fsencode(root / where) + b"/odd\xff\xfe", "wb") as f:
            f.write(b"x")
    (root / "objects" / obj_fan / "notes.txt").write_text("x")  # UTF-8, but no object name
    doc = run_json("doctor", "--root", str(root))
    check = {c["name"]: c for c in doc["checks"]}["store.names"]
    assert check["status"] == "warn" and "5 files" in check["detail"]
    for where in places:
        assert f"{root / where}/odd\\xff\\xfe" in check["detail"], where
    assert "move them out of the store" in check["fix"]
    code, out, err = run("doctor", "--root", str(root))  # the table prints without a crash
    assert code == 0 and "store.names" in out and "Traceback" not in err
    for where in places:  # the files are left where they are
        assert os.path.exists(os.fsencode(root / where) + b"/odd\xff\xfe")


def test_a_clean_store_has_no_odd_names(tmp_path: Path) -> None:
    root = tmp_path / "s"
    fill(root, 2, size=1000)
    doc = run_json("doctor", "--root", str(root))
    assert {c["name"]: c for c in doc["checks"]}["store.names"]["status"] == "ok"
