"""Issue 28.5: the CLI is wired one way. Every command is registered in ``cli/commands.py``
and no command module imports ``cli.app`` back (no import circle); one function maps a
store error to an exit code; ``SPOOLCTL_ROOT`` means one root to the CLI and the connector
(decision 2501)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

import spoolctl.cli
from spoolctl.cli import commands, common, fanout
from spoolctl.cli.app import build_command
from spoolctl.connector.deployment.settings import parse_settings
from spoolctl.errors import (
    ArchiveError,
    BusyError,
    CapacityError,
    ConfigError,
    CorruptionError,
    InvalidIdError,
    ManifestError,
    NotFoundError,
    QuarantineReason,
    ReadOnlyError,
    RootError,
    SpoolError,
    StoreIOError,
)
from spoolctl.store import Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

CLI_DIR = Path(spoolctl.cli.__file__).parent


def _imports_app(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (
                node.module in ("app", "spoolctl.cli.app") or
                (node.module in (None, "spoolctl.cli") and
                 any(a.name == "app" for a in node.names))):
            return True
        if isinstance(node, ast.Import) and any(a.name == "spoolctl.cli.app"
                                                for a in node.names):
            return True
    return False


def _defines_commands(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "commands"
                                                 for t in n.targets) for n in tree.body)


def test_every_command_is_registered_in_one_place_and_nothing_imports_app_back() -> None:
    importers, defining = [], []
    for path in sorted(CLI_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        if path.stem not in ("entry",) and _imports_app(tree):  # entry.py starts the app
            importers.append(path.stem)
        if _defines_commands(tree):
            defining.append(path.stem)
    assert importers == [], f"modules that import cli.app back: {importers}"
    assert sorted(defining) == sorted(commands.MODULE_NAMES)
    names = list(build_command().commands)
    # the table that imports one command's module alone names what each module defines
    assert {name: commands.COMMANDS[name] for name in names} == commands.COMMANDS
    for name in names:
        assert set(build_command([name]).commands) == {name}
    assert names == ["init", "status", "ls", "inspect", "clean", "metrics", "doctor", "scrub",
                     "request-auth", "quarantine", "keys", "prefill", "demo", "export", "import",
                     "config"]


@pytest.mark.parametrize("exc, code", [
    (CorruptionError("x", reason=QuarantineReason.PAYLOAD_DIGEST), 1),
    (ManifestError("x", reason=QuarantineReason.MANIFEST_IO), 1), (NotFoundError("x"), 1),
    (ConfigError("x"), 2), (RootError("x"), 2), (InvalidIdError("x"), 2),
    (ReadOnlyError("x"), 2), (BusyError("x"), 2), (StoreIOError("x"), 2),
    (CapacityError("x"), 2), (ArchiveError("x"), 2), (SpoolError("x"), 2)])
def test_one_exit_code_for_a_store_error(exc: SpoolError, code: int) -> None:
    # A whole command (app.main) and one store of several (fanout) use the same function.
    assert fanout.error_exit_code is common.error_exit_code
    assert common.error_exit_code(exc) == code


def test_connector_refuses_a_single_store_as_its_base_root(tmp_path: Path) -> None:
    store = Path(os.path.realpath(tmp_path)) / "store"
    Store.open(store, create=True).close()
    with pytest.raises(ConfigError, match="SPOOLCTL_ROOT is a single store") as exc:
        parse_settings({}, block_size=32, env={"SPOOLCTL_ROOT": str(store)})
    assert "spoolctl_root" in (exc.value.fix or "")
    with pytest.raises(ConfigError, match="spoolctl_root is a single store"):
        parse_settings({"spoolctl_root": str(store)}, block_size=32, env={})
    base = store.parent / "base"
    assert parse_settings({}, block_size=32, env={"SPOOLCTL_ROOT": str(base)}).root == str(base)
    # the CLI's list of drive roots (decision 2712) is the connector's drives (2732), never
    # one directory named with a ':'
    got = parse_settings({}, block_size=32, env={"SPOOLCTL_ROOT": f"{base}:{store.parent}"})
    assert got.roots == (str(base), str(store.parent))
    assert not os.path.lexists(f"{base}:{store.parent}")
