"""Run spoolctl as an unprivileged user, for tests of permissions (root ignores mode bits).

    python tests/unprivileged.py cli ARGS...   # ``spoolctl ARGS`` as that user
    python tests/unprivileged.py py CODE       # exec CODE as that user

``SPOOLCTL_TEST_PRELOAD=mod1,mod2`` loads more modules before the drop (the connector's).

Started as root, it loads every module spoolctl may need, then drops to ``nobody``
(``os.setgid``/``os.setuid``; the interpreter itself may live where ``nobody`` cannot
read, so nothing is imported after the drop), or to ``SPOOLCTL_TEST_AS`` (uid, gid,
groups). Started as another user, it runs as that user. ``unprivileged_uid()`` says which
uid the work runs as, so a test can give it the files it owns.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
from pathlib import Path

NOBODY = 65534
PRELOAD_ENV = "SPOOLCTL_TEST_PRELOAD"


AS_ENV = "SPOOLCTL_TEST_AS"  # "UID:GID[:GROUP,...]": another user than nobody, with groups


def _identity() -> tuple[int, int, list[int]]:
    """The (uid, gid, supplementary groups) to drop to: ``nobody`` with no groups, or what
    ``SPOOLCTL_TEST_AS`` names."""
    given = os.environ.get(AS_ENV)
    if not given:
        return NOBODY, NOBODY, []
    uid, gid, *rest = given.split(":")
    groups = [int(g) for g in rest[0].split(",") if g] if rest else []
    return int(uid), int(gid), groups


def unprivileged_uid() -> int:
    return NOBODY if os.geteuid() == 0 else os.geteuid()


def _preload() -> None:
    import spoolctl

    for mod in pkgutil.walk_packages(spoolctl.__path__, "spoolctl."):
        if mod.name.startswith(("spoolctl.connector.", "spoolctl.controllers.")) and \
                mod.name not in ("spoolctl.connector.deployment.topology",
                                 "spoolctl.controllers.genai.records",
                                 "spoolctl.controllers.contract"):
            continue  # framework adapters: not used by the store or the CLI
        if mod.name in ("spoolctl.demo.tinymodel", "spoolctl.demo.tinyvlm", "spoolctl.demo",
                        "spoolctl.demo.run", "spoolctl.connector_plugin"):
            continue
        importlib.import_module(mod.name)
    for name in _lazy_imports():
        importlib.import_module(name)
    for name in ("rich.json", "rich.progress", "rich.panel", "rich.rule", "rich.table",
                 "rich.text", "rich.markup", "rich.console", "rich.highlighter",
                 "rich.syntax", "rich.pretty", "rich.traceback", "rich.live",
                 "prometheus_client", "sqlite3", "json", "urllib.parse", "shutil",
                 "concurrent.futures", "textwrap", "encodings.idna", "unicodedata",
                 "typer.rich_utils", "typer.completion"):
        importlib.import_module(name)
    _rehearse()


def _lazy_imports() -> list[str]:
    """What the CLI and the store import inside functions that the preload above leaves out:
    the connector modules the CLI reads, and the optional ``cryptography`` (encrypted
    stores). Read from their source, so a new lazy import is loaded before the drop without
    editing a list here; a module that is not installed is skipped."""
    import ast

    import spoolctl

    package = Path(spoolctl.__file__).parent
    names: set[str] = set()
    wanted = ("spoolctl.connector", "cryptography")
    for path in [*package.joinpath("cli").rglob("*.py"), *package.joinpath("store").rglob("*.py")]:
        text = path.read_text(encoding="utf-8")
        if not any(name in text for name in wanted):
            continue  # parse only the few files that name one: every runner start pays it
        for node in ast.walk(ast.parse(text)):
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            if module.startswith(wanted):
                names.add(module)
                names.update(f"{module}.{a.name}" for a in node.names)
    return sorted(n for n in names if _is_module(n))


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ModuleNotFoundError, ValueError):  # a name in a module, not a module itself
        return False


def _rehearse() -> None:
    """Run the commands once, as root, on a throwaway store: whatever they import lazily
    (rich renderables, typer's parameter checks...) is loaded before the drop."""
    import contextlib
    import io
    import shutil
    import tempfile

    from spoolctl.cli.app import main as cli
    from spoolctl.store import Store

    # on tmpfs when there is one: the rehearsal's fsyncs are then free
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    base = tempfile.mkdtemp(prefix="spool-rehearse-", dir=shm)
    try:
        root = os.path.join(base, "store")
        with Store.open(root, create=True) as store:
            m = store.put(kind="pytorch", namespace="ns", key="k", objects={"kv": b"x"},
                          meta={"a": [1, "b"]})
        runs = [["status"], ["ls"], ["inspect", m.entry_id], ["doctor"], ["scrub"],
                ["quarantine", "ls"], ["clean", "--dry-run", "--yes"], ["metrics"],
                ["request-auth", m.entry_id], ["inspect", "beef"], ["status", "--nope"]]
        for args in runs:
            for extra in ([], ["--json"]):
                with contextlib.redirect_stdout(io.StringIO()), \
                        contextlib.redirect_stderr(io.StringIO()), \
                        contextlib.suppress(SystemExit):
                    cli([*args, "--root", root, *extra])
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    _preload()
    # A test's own modules, loaded before the drop too (comma-separated): e.g. the
    # connector's, which the preload leaves out.
    for name in filter(None, os.environ.get(PRELOAD_ENV, "").split(",")):
        importlib.import_module(name)
    if os.geteuid() == 0:
        uid, gid, groups = _identity()
        os.setgroups(groups)
        os.setgid(gid)
        os.setuid(uid)
        os.environ["HOME"] = "/tmp"
    if mode == "cli":
        from spoolctl.cli.app import main as cli

        cli(args)
    else:
        exec(compile(args[0], "<unprivileged>", "exec"), {"__name__": "__main__"})


if __name__ == "__main__":
    main()
