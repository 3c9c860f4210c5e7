"""Decision 2831's v2 marker on stores owned by another user than the one running the
command: root's ``--allow-foreign-owner`` rewrite keeps the marker the owner's, and an owner
who cannot write the root directory gets a read-only view, not a crash. These need the
``crypto`` extra (a random-id key is what makes a store v2), so they run in the full venv,
not with the base-install operator modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from operator_cli import run, script
from testpaths import TESTS_DIR

from spoolctl.store import Store

pytest.importorskip("cryptography")
pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="another user's store needs root to set up")

RUNNER = str(TESTS_DIR.joinpath("unprivileged.py"))
sys.path.insert(0, str(TESTS_DIR))
from owned_stores import give, shared_dir  # noqa: E402
from unprivileged import unprivileged_uid  # noqa: E402


def py(code: str) -> subprocess.CompletedProcess:
    """A Python snippet as the unprivileged user (tests/unprivileged.py)."""
    return script(RUNNER, "py", textwrap.dedent(code), program=sys.executable, cwd="/tmp")


@pytest.fixture
def base():
    """A directory the unprivileged user can reach (pytest's tmp_path is root-only)."""
    yield from shared_dir("spool-marker-")


def test_root_marking_another_users_store_v2_leaves_the_marker_the_owners(
        base: Path) -> None:
    """Decision 2831: a store whose random-id key predates its v2 marker gets the marker at
    its next writable open, also root's ``--allow-foreign-owner status``. Before, that
    rewrite left ``.spoolctl-root`` root's, mode 0600: the owner's every command then failed
    with "unreadable store marker" (``give_back`` covers state/, tmp/ and quarantine/)."""
    import secrets

    from spoolctl.store.sealing import FILE_ENV, MasterKey

    key = base / "master.key"  # root's copy of the key: a key file must be the user's
    key.write_text(secrets.token_hex(32) + "\n")
    key.chmod(0o600)
    env = {FILE_ENV: str(key)}
    root = base / "store"
    with Store.open(root, create=True, master_key=MasterKey.from_environment(env)) as store:
        store.put(kind="pytorch", namespace="ns", key="k", objects={"kv": b"x" * 99},
                  tenant="t")
    marker = root / ".spoolctl-root"
    doc = json.loads(marker.read_text())
    assert doc["requires"] == ["hints-log", "sealed-v2", "sealed-v3"]
    # the key made before 2831 (a store of this format otherwise: status opens it writable)
    marker.write_text(json.dumps(doc | {"requires": ["hints-log"]}))
    give(root)
    code, _, err = run("--allow-foreign-owner", "status", "--root", str(root), env=env)
    assert code == 0, err
    assert json.loads(marker.read_text())["requires"] == ["hints-log", "sealed-v2"]
    uid = unprivileged_uid()
    assert (marker.stat().st_uid, marker.stat().st_gid) == (uid, uid)  # still the owner's


def test_a_v2_marking_the_owner_cannot_write_gives_a_read_only_view_not_a_crash(
        base: Path) -> None:
    """Decision 2831 marks a store whose random-id key predates its v2 marker at the next
    writable open. The owner's root directory read-only (chmod 500): that rewrite cannot
    happen. Before, every command ended in "unexpected PermissionError" (status with a
    traceback) and left the marker's draft in tmp/; now read commands show a read-only view
    and a writing one is one line naming the marker and the fix."""
    import secrets

    from spoolctl.store.sealing import FILE_ENV, MasterKey

    key = base / "master.key"
    key.write_text(secrets.token_hex(32) + "\n")
    key.chmod(0o600)
    root = base / "store"
    with Store.open(root, create=True,
                    master_key=MasterKey.from_environment({FILE_ENV: str(key)})) as store:
        store.put(kind="pytorch", namespace="ns", key="k", objects={"kv": b"x" * 99},
                  tenant="t")
    marker = root / ".spoolctl-root"
    doc = json.loads(marker.read_text())
    v1 = json.dumps(doc | {"requires": ["hints-log"]})  # the key was made before 2831
    marker.write_text(v1)
    give(root)
    give(key)
    root.chmod(0o500)
    proc = py(f"""
        import contextlib, io, json, os
        os.environ[{FILE_ENV!r}] = {str(key)!r}
        from spoolctl.cli.app import main
        said = {{}}
        for argv in (["ls", "--json"], ["keys", "rotate"]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    main([*argv, "--root", {str(root)!r}])
                    code = 0
                except SystemExit as exc:
                    code = exc.code
            said[argv[0]] = [code, err.getvalue()]
        print(json.dumps(said))
    """)
    said = json.loads(proc.stdout)
    code, err = said["ls"]
    assert code == 0 and "read-only view" in err and err.count("\n") == 1, err
    code, err = said["keys"]
    assert code == 2 and err.count("\n") == 1 and "unexpected" not in err, err
    assert "writing the store marker failed" in err and str(marker) in err
    assert marker.read_text() == v1 and os.listdir(root / "tmp") == []  # nothing changed
