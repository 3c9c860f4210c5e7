"""What a ``spoolctl`` process loads before its first byte of work (decision 2940): the
store's public names are imported on first use, the CLI imports a store subsystem only in the
commands that use it, and rich only when something is rendered. Each test looks at a fresh
interpreter's ``sys.modules`` (no timing: what is not imported costs nothing)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import spoolctl.store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

# Operator subsystems no command needs before it runs (and `status` never needs at all).
SUBSYSTEMS = ("spoolctl.store.transfer.exporter", "spoolctl.store.transfer.importer",
              "spoolctl.store.transfer.archive_sign", "spoolctl.store.transfer.peer",
              "spoolctl.store.maintain.doctor", "spoolctl.store.maintain.scrub",
              "spoolctl.store.maintain.auth_requests")


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code`` (stdout is the code's)."""
    script = (f"import json, sys\n{code}\n"
              "sys.stderr.write('\\nMODULES ' + json.dumps(sorted(sys.modules)) + '\\n')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLCTL_")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stderr.rsplit("MODULES ", 1)[1]))


def test_importing_the_cli_loads_neither_rich_nor_the_store_subsystems() -> None:
    loaded = _modules_after("import spoolctl.cli.app")
    assert not {m for m in loaded if m == "rich" or m.startswith("rich.")}
    assert not loaded & {*SUBSYSTEMS, "spoolctl.store.store", "spoolctl.store.catalog.index",
                         "spoolctl.store.tenant_keys", "sqlite3"}


def test_a_json_status_renders_nothing_and_loads_only_what_it_uses(store_root: Path) -> None:
    from spoolctl.store import Store

    Store.open(store_root, create=True).close()
    loaded = _modules_after(
        "from spoolctl.cli.app import main\n"
        f"try:\n    main(['status', '--root', {str(store_root)!r}, '--json'])\n"
        "except SystemExit as exc:\n    assert not exc.code, exc.code\n")
    # the store is opened in the bounded child (disk_deadline): this process never loads it
    assert "spoolctl.store.store" not in loaded and "sqlite3" not in loaded
    assert "rich.console" not in loaded
    assert not loaded & set(SUBSYSTEMS)


def test_every_public_store_name_resolves_to_its_module() -> None:
    """``spoolctl.store`` loads its names lazily from ``_LAZY``: every name of ``__all__`` is
    there (or an error class), each is the object its module defines, and the import
    statements kept for type checkers and the layer contracts name exactly the same."""
    lazy = spoolctl.store._LAZY
    for name in spoolctl.store.__all__:
        value = getattr(spoolctl.store, name)
        module = spoolctl.store._MODULE_OF.get(name)
        if module is None:
            assert value.__module__ == "spoolctl.errors", name
        else:
            defined = sys.modules[f"spoolctl.store{module}"]
            assert getattr(defined, name) is value, name
    assert set(dir(spoolctl.store)) >= set(spoolctl.store.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        spoolctl.store.nothing_here  # noqa: B018
    source = ast.parse(Path(spoolctl.store.__file__).read_text(encoding="utf-8"))
    typed = {("." + node.module, a.name) for node in ast.walk(source)
             if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
             for a in node.names}
    assert typed == {(module, name) for module, names in lazy.items() for name in names}


def test_a_command_builds_only_its_own_click_command() -> None:
    """typer builds the click form of every command it is given; a process runs one, so
    ``build_command(argv)`` gives it only the command argv names. No command, or a word
    that names none, gets the whole tree (``--help`` lists all, a typo gets "did you mean")."""
    from spoolctl.cli.app import build_command

    everything = set(build_command().commands)
    assert {"status", "quarantine", "export", "keys"} <= everything
    only = build_command(["--debug", "quarantine", "ls", "--root", "/x"])
    assert set(only.commands) == {"quarantine"}
    assert {"ls", "show"} <= set(only.commands["quarantine"].commands)
    assert set(build_command(["statu"]).commands) == everything
    assert set(build_command(["--version"]).commands) == everything
