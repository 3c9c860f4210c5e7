"""A tenant's name (vLLM: its cache_salt) is a secret: `spoolctl keys` never takes it as an
argument, where every local user reads it in ``/proc/*/cmdline`` and the shell keeps it in
its history (issue 47, item 9). ``--tenant`` takes the tenant's opaque id; the name comes
from a file, stdin or an environment variable. Real processes, a real encrypted store."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import pytest
from operator_cli import script

pytest.importorskip("cryptography")

from spoolctl.store import MasterKey, Store

SALT = "acme-salt-7f3e91c2"
OTHER = "globex-salt-04aa"


@pytest.fixture
def keyed(tmp_path: Path) -> tuple[Path, dict[str, str], str]:
    """An encrypted store with entries of two tenants; (root, env, SALT's tenant id)."""
    root = Path(os.path.realpath(tmp_path)) / "store"
    hex_key = secrets.token_hex(32)
    with Store.open(root, create=True, master_key=MasterKey.from_hex(hex_key, "test")) as store:
        for tenant in (SALT, OTHER):
            store.put(kind="pytorch", namespace="m", key="k", objects={"kv": b"x" * 64},
                      tenant=tenant)
        assert store.sealer is not None
        tid = store.sealer.tenant_id(SALT)
    # a revoke records the keys it erases in a ledger outside the store
    return root, {"SPOOLCTL_MASTER_KEY": hex_key,
                  "SPOOLCTL_KEY_LEDGER": str(tmp_path / "erased-keys.json")}, tid


def script_json(*argv: str, env: dict[str, str], stdin: str | None = None) -> dict:
    proc = script(*argv, "--json", env=env, stdin=stdin)
    assert proc.returncode == 0, (argv, proc.stdout, proc.stderr)
    return json.loads(proc.stdout)


def _live(root: Path, env: dict[str, str]) -> dict[str, bool]:
    doc = script_json("keys", "ls", "--root", str(root), env=env)
    return {t["tenant_id"]: not t["revoked"] for t in doc["tenants"]}


@pytest.mark.parametrize("command", [("revoke", "--yes"), ("retire", "--yes"), ("rotate",)])
def test_a_salt_on_the_command_line_is_refused_and_nothing_changes(keyed, command):
    root, env, _tid = keyed
    before = script_json("keys", "ls", "--root", str(root), env=env)
    proc = script("keys", command[0], "--tenant", SALT, *command[1:], "--root", str(root),
                  env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--tenant-file" in proc.stderr and "secret" in proc.stderr
    assert SALT not in proc.stderr + proc.stdout  # the refusal does not repeat it either
    assert script_json("keys", "ls", "--root", str(root), env=env) == before


def test_a_name_that_is_not_an_id_is_refused_too(keyed):
    root, env, _tid = keyed
    proc = script("keys", "revoke", "--tenant", "never-seen-salt", "--yes", "--root", str(root),
                  env=env)
    assert proc.returncode == 2 and "--tenant takes a tenant id" in proc.stderr
    assert "never-seen-salt" not in proc.stderr


def test_the_tenant_id_revokes(keyed):
    root, env, tid = keyed
    doc = script_json("keys", "revoke", "--tenant", tid, "--yes", "--root", str(root), env=env)
    assert [t["tenant_id"] for t in doc["tenants"]] == [tid] and doc["released_entries"] == 1
    assert _live(root, env)[tid] is False and list(_live(root, env).values()).count(True) == 1


@pytest.mark.parametrize("how", ["stdin", "file", "env"])
def test_the_name_comes_from_a_file_stdin_or_the_environment(keyed, tmp_path, how):
    root, env, tid = keyed
    argv: tuple[str, ...] = ()
    stdin = None
    if how == "stdin":
        argv, stdin = ("--tenant-file", "-"), SALT + "\n"
    elif how == "file":
        secret = tmp_path / "salt"
        secret.write_text(SALT + "\n")
        argv = ("--tenant-file", str(secret))
    else:
        argv, env = ("--tenant-env", "ACME_SALT"), {**env, "ACME_SALT": SALT}
    doc = script_json("keys", "revoke", *argv, "--yes", "--root", str(root), env=env,
                      stdin=stdin)
    assert [t["tenant_id"] for t in doc["tenants"]] == [tid] and doc["released_entries"] == 1


def test_bad_name_sources_are_one_line_each(keyed, tmp_path):
    root, env, _tid = keyed
    empty = tmp_path / "empty"
    empty.write_text("")
    for argv, words in [
        (("--tenant-file", str(tmp_path / "missing")), "cannot read the tenant's name"),
        (("--tenant-file", str(empty)), "one line of 1 to 1024 characters"),
        (("--tenant-env", "NO_SUCH_VARIABLE_HERE"), "is not set"),
        (("--tenant", "0123456789abcdef", "--tenant-env", "X"), "give one of them"),
    ]:
        proc = script("keys", "revoke", *argv, "--yes", "--root", str(root), env=env)
        assert proc.returncode == 2 and words in proc.stderr, (argv, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
