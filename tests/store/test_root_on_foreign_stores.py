"""Root's maintenance on a store another user owns never acts through a link that user
planted: every path operation root makes under the store's root goes through a directory
descriptor (one name, no link followed), and what root creates there is the owner's from
its creation, never chowned later by name.

The owner (``nobody``) can swap any directory of its store for a symlink at any moment.
Each command that takes ``--allow-foreign-owner`` runs as root under ``tests/root_audit.py``:
an audit hook sees every ``open``, ``os.remove``, ``os.rename``, ``os.chown``... the command
(and its forked children) makes, fails it on any one that names a path under the root from
``/`` or crosses a directory by name, and -- the owner's race -- before each one flips
``tmp/``, ``state/`` or ``quarantine/`` between the real directory and a symlink to a
root-only directory outside the store. Nothing in that directory may change owner, vanish,
be renamed, be written or appear.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from testpaths import TESTS_DIR

pytest.importorskip("cryptography")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the attack needs root as victim")

sys.path.insert(0, str(TESTS_DIR))
from operator_cli import ENV  # noqa: E402
from owned_stores import give, shared_dir  # noqa: E402

from spoolctl.errors import QuarantineReason  # noqa: E402
from spoolctl.store import Store  # noqa: E402
from spoolctl.store.sealing import FILE_ENV, MasterKey  # noqa: E402

AUDIT = str(TESTS_DIR.joinpath("root_audit.py"))
DEAD_TMP = "999999999-0123456789abcdef.part"
# Names root's commands use in tmp/, state/ and quarantine/: the bait in the victim directory.
BAIT = ("catalog.sqlite3", "catalog.sqlite3-wal", "scrub.sqlite3", "scrub.lock",
        "maintenance.lock", "maintenance.gate", "owner.lock", DEAD_TMP,
        "precious")


class Template:
    """A store with plain, released, sealed, corrupt (quarantined) entries, a dead temp
    file, and an archive of it; copied and given to ``nobody`` for each run."""

    def __init__(self, base: Path):
        self.base = base
        self.key = base / "master.key"  # root's copy of the key, outside every store
        self.key.write_text(secrets.token_hex(32) + "\n")
        self.key.chmod(0o600)
        self.env = ENV | {FILE_ENV: str(self.key)}
        self.store = base / "template"
        with Store.open(self.store, create=True,
                        master_key=MasterKey.from_environment(self.env)) as store:
            made = [store.put(kind="pytorch", namespace="ns", key=f"k{i}",
                              objects={"kv": os.urandom(3000)}) for i in range(4)]
            store.put(kind="pytorch", namespace="ns", key="t", objects={"kv": b"x" * 500},
                      tenant="t")
            store.release(made[0].entry_id)
            store.quarantine_entry(made[1].entry_id, QuarantineReason.PAYLOAD_DIGEST, "planted")
        self.entry = made[2].entry_id
        (self.item,) = os.listdir(self.store / "quarantine")
        (self.store / "tmp" / DEAD_TMP).write_bytes(b"bait\n")
        os.utime(self.store / "tmp" / DEAD_TMP, (1, 1))
        self.archive = base / "archive.spool"
        proc = subprocess.run([sys.executable, "-m", "spoolctl", "export", "--root",
                               str(self.store), "-o", str(self.archive)],
                              capture_output=True, text=True, env=self.env, timeout=120)
        assert proc.returncode == 0, proc.stderr

    def copy(self, name: str) -> Path:
        root = self.base / name
        shutil.copytree(self.store, root, symlinks=True)
        give(root)
        return root


@pytest.fixture(scope="module")
def template() -> Iterator[Template]:
    for base in shared_dir("spool-rootfd-"):
        yield Template(base)


def _victim(base: Path) -> Path:
    """A root-only directory outside the store, full of root's files named like the
    store's: what the owner points a swapped directory at."""
    victim = base / "victim"
    victim.mkdir(mode=0o700)
    for name in BAIT:
        (victim / name).write_bytes(b"root's own\n")
    (victim / "item").mkdir(mode=0o700)
    (victim / "item" / "reason.json").write_text('{"reason": "payload_digest"}')
    return victim


def _snapshot(directory: Path) -> dict[str, tuple[int, int, int, int, int]]:
    """Owner, mode, size, inode and mtime of everything under ``directory``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in [*dirnames, *filenames]:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.join(dirpath, name)] = (st.st_uid, st.st_mode, st.st_size,
                                                st.st_ino, st.st_mtime_ns)
    st = os.lstat(directory)
    out[str(directory)] = (st.st_uid, st.st_mode, 0, st.st_ino, st.st_mtime_ns)
    return out


def _commands(t: Template, root: Path) -> dict[str, list[str]]:
    """Every command that acts on a store, as cron or an operator runs it as root."""
    r = ["--root", str(root)]
    return {
        "init": ["init", *r, "--max-size", "1GiB"],
        "status": ["status", *r],
        "ls": ["ls", *r],
        "inspect": ["inspect", t.entry, *r],
        "metrics": ["metrics", *r],
        "doctor": ["doctor", *r],
        "scrub": ["scrub", *r],
        "request-auth": ["request-auth", t.entry, *r],
        "clean": ["clean", "--released", "--orphans", "--tmp", "--capacity", "--min-age",
                  "0s", "--yes", *r],
        "quarantine-ls": ["quarantine", "ls", *r],
        "quarantine-show": ["quarantine", "show", t.item, *r],
        "quarantine-restore": ["quarantine", "restore", t.item, *r],
        "quarantine-purge": ["quarantine", "purge", "--all", "--yes", *r],
        "keys-ls": ["keys", "ls", *r],
        "keys-rotate": ["keys", "rotate", "--tenant", "t", *r],
        "keys-retire": ["keys", "retire", "--tenant", "t", "--yes", *r],
        "keys-revoke": ["keys", "revoke", "--tenant", "t", "--yes", *r],
        "export": ["export", *r, "-o", str(root.parent / f"{root.name}.spool")],
        "import": ["import", str(t.archive), *r],
    }


COMMANDS = [
    "init", "status", "ls", "inspect", "metrics", "doctor", "scrub", "request-auth", "clean",
    "quarantine-ls", "quarantine-show", "quarantine-restore", "quarantine-purge", "keys-ls",
    "keys-rotate", "keys-retire", "keys-revoke", "export", "import"]


def _run(t: Template, root: Path, argv: list[str], swap: str | None,
         victim: Path, mode: str = "flip") -> dict:
    report = root.parent / f"{root.name}.report.json"
    swapping = [swap, str(victim), mode] if swap else []
    proc = subprocess.run(
        [sys.executable, AUDIT, str(report), str(root), *swapping, "--",
         "--allow-foreign-owner", *argv, "--json"],
        capture_output=True, text=True, env=t.env, timeout=300, cwd="/")
    assert report.exists(), proc.stderr[-3000:]
    doc = json.loads(report.read_text())
    doc["stderr"] = proc.stderr[-2000:]
    doc["stdout"] = proc.stdout[-2000:]
    return doc


def test_the_command_list_is_every_store_command() -> None:
    """Every command that takes ``--root`` and acts on a store is in the list (prefill
    and demo act through the controllers' same Store: they need a model; config vllm only
    checks a path)."""
    from spoolctl.cli import commands

    names = set()
    for module in commands.modules():
        for info in module.commands.registered_commands:
            names.add(info.name)
        for group in module.commands.registered_groups:
            for info in group.typer_instance.registered_commands:
                names.add(f"{group.name}-{info.name}")
    assert names - set(COMMANDS) == {"prefill", "demo", "config-vllm"}


@pytest.mark.parametrize("swap", ["tmp", "state", "quarantine"])
def test_a_swapped_directory_never_makes_root_chown_outside_the_store(
        template: Template, swap: str, tmp_path: Path) -> None:
    """The reported attack: a scrub as root on ``nobody``'s store while the owner swaps
    ``SWAP/`` for a symlink to a root-owned directory whenever root names a path through
    it. Before, ``Store.close`` chowned every root-owned file it listed there (by name) to
    ``nobody``."""
    base = tempfile_dir(template, f"attack-{swap}")
    victim = _victim(base)
    before = _snapshot(victim)
    root = template.copy(f"attack-{swap}/store")
    doc = _run(template, root, ["scrub", "--root", str(root)], swap, victim, "through")
    assert _snapshot(victim) == before, doc


def tempfile_dir(t: Template, name: str) -> Path:
    path = t.base / name
    path.mkdir(mode=0o755)
    return path


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_acts_by_descriptor_and_changes_nothing_outside(
        template: Template, command: str) -> None:
    """Every store command as root: no path operation under the root by name (the audit
    hook's list is empty), and with ``tmp/``, ``state/`` and ``quarantine/`` each flipping
    to a symlink before each operation, nothing in the directory they point to changes."""
    base = tempfile_dir(template, command)
    victim = _victim(base)
    before = _snapshot(victim)
    root = template.copy(f"{command}/store")
    doc = _run(template, root, _commands(template, root)[command], "tmp,state,quarantine",
               victim)
    assert doc["violations"] == [], json.dumps(doc, indent=1)[:6000]
    assert _snapshot(victim) == before, doc
    assert doc["flips"] > 0, doc
