"""Issue 35: a store's writer cannot attack the operator, the engine or another tenant.

The attacker owns the store (the serving user: here ``nobody``, through
``tests/unprivileged.py``) and can write nothing else; the operator is root, running the
documented maintenance with ``--allow-foreign-owner``. Root ignores mode bits, so where
the machine does not run the tests as root the attacks still run as this user against its
own commands (the descriptors, schema checks and modes are the same code), and only the
"root-only victim" assertions are skipped.

* 35.1: a ``tmp/`` swapped for a symlink between root's listing and its unlinks (made
  deterministic with ``SPOOLCTL_PAUSE_AT=tmp.listed``) deletes nothing outside the store;
  the same for fan-out directories swapped under ``clean --released``, ``doctor``'s probe
  and a symlinked ``quarantine/``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

from spoolctl.store import Store

RUNNER = str(Path(__file__).with_name("unprivileged.py"))
sys.path.insert(0, str(Path(__file__).parent))
from unprivileged import unprivileged_uid  # noqa: E402

UID = unprivileged_uid()
AS_ROOT = os.geteuid() == 0
CLI = "import sys; from spoolctl.cli.app import main; main(sys.argv[1:])"
DEAD_TMP = "999999999-0123456789abcdef.part"  # a temp-file name whose writer is dead


def _env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SPOOLCTL_")} | {
        "COLUMNS": "200", "NO_COLOR": "1"} | extra


def attacker(code: str) -> None:
    """Run ``code`` as the store's owner (``nobody`` when the tests run as root)."""
    proc = subprocess.run([sys.executable, RUNNER, "py", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120, env=_env(), cwd="/tmp")
    assert proc.returncode == 0, proc.stderr


def operator(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``spoolctl ARGS`` as this (root) user, as cron would, on the owner's store."""
    return subprocess.Popen([sys.executable, "-c", CLI, "--allow-foreign-owner", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or _env(), cwd="/tmp")


@pytest.fixture
def base():
    """A directory both users can reach (pytest's tmp_path is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="spool-hostile-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _give(path: Path) -> None:
    if AS_ROOT:
        for p in [path, *path.rglob("*")]:
            os.lchown(p, UID, UID)


def _owned_store(base: Path, n: int = 2, released: int = 0) -> tuple[Path, list]:
    root = base / "store"
    with Store.open(root, create=True) as store:
        made = [store.put(kind="pytorch", namespace="ns", key=f"k{i}",
                          objects={"kv": os.urandom(4000)}) for i in range(n)]
        for m in made[:released]:
            store.release(m.entry_id)
    _give(root)
    return root, made


def _victim(base: Path, name: str) -> Path:
    """A root-only directory holding ``name``: what the attacker wants root to delete."""
    secret = base / "secret"
    secret.mkdir(mode=0o700)
    (secret / name).write_bytes(b"precious\n")
    return secret / name


class Paused:
    """A process stopped at a checkpoint (``SPOOLCTL_PAUSE_AT``) until ``resume``."""

    def __init__(self, base: Path, point: str):
        self.dir = Path(tempfile.mkdtemp(dir=base))
        os.mkfifo(self.dir / "reached")
        os.mkfifo(self.dir / "resume")
        self.env = _env(SPOOLCTL_PAUSE_AT=f"{point}:{self.dir}")

    def wait_reached(self, proc: subprocess.Popen) -> None:
        """Block until ``proc`` is at the checkpoint; fail if it exits first."""
        got: list[str] = []
        reader = threading.Thread(
            target=lambda: got.append((self.dir / "reached").read_text()), daemon=True)
        reader.start()
        while reader.is_alive():
            reader.join(0.1)
            if proc.poll() is not None and reader.is_alive():
                os.close(os.open(self.dir / "reached", os.O_WRONLY | os.O_NONBLOCK))
                reader.join()
                _out, err = proc.communicate()
                pytest.fail(f"exited ({proc.returncode}) before the checkpoint: {err}")
        assert got == ["reached\n"]

    def resume(self) -> None:
        (self.dir / "resume").write_text("go\n")


# -- 35.1: descriptors, not paths -----------------------------------------------------------


def test_tmp_swapped_for_a_symlink_after_the_listing_deletes_nothing_outside(
        base: Path) -> None:
    root, _ = _owned_store(base)
    precious = _victim(base, DEAD_TMP)
    (root / "tmp" / DEAD_TMP).write_bytes(b"bait\n")  # listed by root's clean
    _give(root)
    pause = Paused(base, "tmp.listed")
    proc = operator("clean", "--tmp", "--yes", "--json", "--root", str(root), env=pause.env)
    pause.wait_reached(proc)
    attacker(f"""
        import os
        os.rename({str(root / 'tmp')!r}, {str(root / 'tmp.moved')!r})
        os.symlink({str(precious.parent)!r}, {str(root / 'tmp')!r})
    """)
    pause.resume()
    out, err = proc.communicate(timeout=120)
    assert precious.read_bytes() == b"precious\n", (out, err)
    # the unlink went to the directory root listed, wherever its owner moved it
    assert not (root / "tmp.moved" / DEAD_TMP).exists()
    # and the swap is not reported as a clean pass
    assert proc.returncode != 0, out
    assert f'"{root / "tmp"}": "Too many levels of symbolic links"' in out, out


def test_a_fanout_swapped_mid_clean_deletes_nothing_outside(base: Path) -> None:
    root, made = _owned_store(base, n=1, released=1)
    digest = made[0].objects[0].digest
    precious = _victim(base, f"{digest}.obj")
    pause = Paused(base, "clean.manifest_deleted")
    proc = operator("clean", "--released", "--yes", "--json", "--root", str(root),
                    env=pause.env)
    pause.wait_reached(proc)  # the manifest is gone; the object's unlink comes next
    fan = root / "objects" / digest[:2]
    attacker(f"""
        import os
        os.rename({str(fan)!r}, {str(fan) + '.moved'!r})
        os.symlink({str(precious.parent)!r}, {str(fan)!r})
    """)
    pause.resume()
    out, err = proc.communicate(timeout=120)
    assert precious.read_bytes() == b"precious\n", (out, err)
    assert proc.returncode != 0 and "Too many levels of symbolic links" in out, (out, err)


def test_doctor_reports_a_symlinked_tmp_and_writes_nothing_through_it(base: Path) -> None:
    root, _ = _owned_store(base)
    secret = base / "secret"
    secret.mkdir(mode=0o700)
    os.utime(secret, ns=(1, 1))
    attacker(f"""
        import os
        os.rename({str(root / 'tmp')!r}, {str(root / 'tmp.moved')!r})
        os.symlink({str(secret)!r}, {str(root / 'tmp')!r})
    """)
    proc = operator("doctor", "--json", "--root", str(root))
    out, err = proc.communicate(timeout=120)
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["root.layout"]["status"] == "fail", checks
    assert "tmp (symlink)" in checks["root.layout"]["detail"]
    assert proc.returncode == 1, err
    # the probe files were neither created nor removed in the link's target
    assert os.stat(secret).st_mtime_ns == 1 and not os.listdir(secret)


def test_a_quarantine_swapped_mid_purge_is_not_purged_through(base: Path) -> None:
    root, _ = _owned_store(base)
    item = "20260101T000000Z-payload_digest-0123abcd"
    for where in (root / "quarantine", base / "secret"):
        (where / item).mkdir(parents=True, mode=0o700)
        (where / item / "reason.json").write_text('{"reason": "payload_digest"}')
    (base / "secret" / item / "precious").write_bytes(b"precious\n")
    (base / "secret").chmod(0o700)
    _give(root)
    pause = Paused(base, "quarantine.listed")
    proc = operator("quarantine", "purge", "--yes", "--root", str(root), env=pause.env)
    pause.wait_reached(proc)
    attacker(f"""
        import os
        os.rename({str(root / 'quarantine')!r}, {str(root / 'quarantine.moved')!r})
        os.symlink({str(base / 'secret')!r}, {str(root / 'quarantine')!r})
    """)
    pause.resume()
    out, err = proc.communicate(timeout=120)
    assert (base / "secret" / item / "precious").read_bytes() == b"precious\n", (out, err)
    assert proc.returncode != 0, out
