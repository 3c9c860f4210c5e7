"""Running the spoolctl CLI from the operator-path tests: in-process (``run``: the real
``main(argv)``, fast) or as the installed console script (``script``: a real process, for
what only a process shows, such as hangs and exit codes under cron)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

SPOOLCTL = str(Path(sys.executable).with_name("spoolctl"))
ENV = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLCTL_")} | {
    "COLUMNS": "200", "NO_COLOR": "1"}


def run(*argv: str) -> tuple[int, str, str]:
    """``spoolctl ARGV`` in this process: (exit code, stdout, stderr)."""
    from spoolctl.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SPOOLCTL_")}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(argv))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    finally:
        os.environ.update(saved)
    return code, out.getvalue(), err.getvalue()


def run_json(*argv: str, expect: int = 0) -> dict:
    code, out, err = run(*argv, "--json")
    assert code == expect, (argv, code, out, err)
    return json.loads(out)


def script(*argv: str, timeout: float = 120, env: dict | None = None
           ) -> subprocess.CompletedProcess:
    """The installed console script, stdin not a terminal (like cron)."""
    return subprocess.run([SPOOLCTL, *argv], capture_output=True, text=True, timeout=timeout,
                          env=env or ENV, stdin=subprocess.DEVNULL)
