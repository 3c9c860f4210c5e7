"""Every command that takes ``--root`` accepts it, on whatever typer the install resolved.

typer 0.29 validates its own parameter types: an option changed behind its back was refused
("Input is not a valid path"), for every one-root command, while the constrained CI install
(typer 0.28) passed. This module runs each command once with ``--root``; the dependency lanes
(``bash scripts/run.sh test-newest`` / ``test-lowest``) run it on the newest and the oldest
versions ``pyproject.toml`` allows.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spoolctl.store import Store
from tests.operator_cli import run

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

# command -> (arguments, expected exit code, a word the outcome shows); {entry} / {tmp} filled in
SMOKE: dict[str, tuple[tuple[str, ...], int, str]] = {
    "init": ((), 0, ""),
    "status": ((), 0, ""),
    "ls": ((), 0, ""),
    "inspect": (("{entry}",), 0, ""),
    "clean": (("--dry-run",), 0, ""),
    "metrics": ((), 0, ""),
    "doctor": ((), 0, ""),
    "scrub": ((), 0, ""),
    "request-auth": (("{entry}",), 0, ""),
    "quarantine ls": ((), 0, ""),
    "quarantine show": (("abcd",), 1, "no quarantine item abcd"),
    "quarantine restore": (("abcd",), 1, "no quarantine item abcd"),
    "quarantine purge": (("abcd", "--yes"), 1, "no quarantine item abcd"),
    "keys ls": ((), 0, "not encrypted"),
    "keys rotate": (("--dry-run",), 2, "no encryption configured"),
    "keys revoke": (("--tenant", "acme", "--yes"), 2, "no encryption configured"),
    "keys retire": (("--yes",), 2, "no encryption configured"),
    "export": (("-o", "{tmp}/out.tar"), 0, ""),
    "import": (("{tmp}/out.tar",), 0, ""),
    "config vllm": (("--max-size", "1GiB"), 0, "kv_connector"),
    # these run a model: a usage error past the parsed --root shows the root was taken
    "prefill": ((), 2, "--model is required"),
    "demo": (("--preset", "nope"), 2, "unknown preset 'nope'"),
}


def _commands_with_root() -> set[str]:
    from spoolctl.cli.app import build_command

    found: set[str] = set()

    def walk(command, path: tuple[str, ...]) -> None:
        subs = getattr(command, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, (*path, name))
        elif any("--root" in getattr(p, "opts", ()) for p in command.params):
            found.add(" ".join(path))

    walk(build_command(), ())
    return found


def test_the_smoke_table_names_every_command_that_takes_root() -> None:
    assert _commands_with_root() == set(SMOKE)


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("every-root")
    with Store.open(str(tmp / "store"), create=True) as store:
        entry = store.put(kind="pytorch", namespace="ns", key="k",
                          objects={"kv": os.urandom(256)}).entry_id
    return tmp, entry


@pytest.mark.parametrize("command", sorted(SMOKE))
def test_each_command_accepts_one_root(command: str, filled: tuple[Path, str]) -> None:
    tmp, entry = filled
    args, expect, shows = SMOKE[command]
    argv = [*command.split(), *(a.format(entry=entry, tmp=tmp) for a in args),
            "--root", str(tmp / "store")]
    code, out, err = run(*argv)
    assert "Invalid value for '--root'" not in err and "not a valid path" not in err, err
    assert code == expect, (argv, code, out, err)
    assert shows in out + err, (argv, out, err)


@pytest.mark.parametrize("command", sorted(c for c in SMOKE if c not in {
    "status", "metrics", "clean", "scrub", "export", "prefill", "demo"}))
def test_a_one_root_command_refuses_a_second_root(command: str, tmp_path: Path) -> None:
    args, _, _ = SMOKE[command]
    argv = [*command.split(), *(a.format(entry="abcd", tmp=tmp_path) for a in args),
            "--root", str(tmp_path / "a"), "--root", str(tmp_path / "b")]
    code, _, err = run(*argv)
    assert code == 2 and "takes one --root, and 2 were given" in err, (argv, code, err)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
