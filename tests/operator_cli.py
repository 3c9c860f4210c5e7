"""The one way the tests run the spoolctl CLI: in-process (``run``: the real ``main(argv)``,
fast) or as the installed console script (``script``: a real process, for what only a process
shows, such as hangs, signals and exit codes under cron). Both see the same environment:
none of the developer's ``SPOOLCTL_*`` variables (a root, a crash point), a wide terminal, no
colour, unbuffered output."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

SPOOLCTL = str(Path(sys.executable).with_name("spoolctl"))
ENV = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLCTL_")} | {
    "COLUMNS": "200", "NO_COLOR": "1", "PYTHONUNBUFFERED": "1"}


def run(*argv: str, env: Mapping[str, str] | None = None) -> tuple[int, str, str]:
    """``spoolctl ARGV`` in this process: (exit code, stdout, stderr). ``env``: variables
    set for the command only (e.g. a ``SPOOLCTL_*`` key source)."""
    from spoolctl.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SPOOLCTL_")}
    try:
        os.environ.update(env or {})
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(argv))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    finally:
        # A command may set SPOOLCTL_* for its own process (`--allow-foreign-owner` does):
        # in this process it must not outlive the command and leak into later tests.
        for key in [k for k in os.environ if k.startswith("SPOOLCTL_")]:
            del os.environ[key]
        os.environ.update(saved)
    return code, out.getvalue(), err.getvalue()


def run_json(*argv: str, expect: int = 0, env: Mapping[str, str] | None = None) -> dict:
    code, out, err = run(*argv, "--json", env=env)
    assert code == expect, (argv, code, out, err)
    return json.loads(out)


def script(*argv: str, timeout: float = 120, env: Mapping[str, str] | None = None,
           stdin: bytes | str | None = None, text: bool = True, program: str = SPOOLCTL,
           cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess:
    """``program ARGV`` (the installed console script) in a real process. ``env`` adds to (or
    overrides) ``ENV``; ``stdin`` is fed to it, else stdin is not a terminal (like cron);
    ``text=False`` gives bytes (archives on stdout)."""
    feed: dict = {"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}
    return subprocess.run([program, *argv], capture_output=True, text=text, timeout=timeout,
                          env={**ENV, **(env or {})}, cwd=cwd, **feed)


def script_json(*argv: str, expect: int = 0, stdin: bytes | str | None = None,
                timeout: float = 120) -> dict:
    """``script(ARGV, --json)``, its exit code checked, its stdout parsed."""
    proc = script(*argv, "--json", stdin=stdin, timeout=timeout)
    assert proc.returncode == expect, (argv, proc.returncode, proc.stdout, proc.stderr)
    return json.loads(proc.stdout)
