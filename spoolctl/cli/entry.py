"""The console script's entry point (``spoolctl`` and ``python -m spoolctl``).

``spoolctl --version`` is answered here, before typer, rich or the store are imported: cron
and scripts ask it often, and the whole CLI costs several times the interpreter's start.

Importing the CLI takes about a second on a cold page cache (typer, rich, the store). A
Ctrl-C (or SIGTERM turned into one) in that second must end the command like one anywhere
else: one line, exit 130, nothing done, never a Python traceback. Everything
else is ``spoolctl.cli.app.main``.
"""

from __future__ import annotations

import sys


def main() -> None:
    try:
        if sys.argv[1:] == ["--version"]:
            sys.exit(_print_version())
        from spoolctl.cli.app import main as run
    except KeyboardInterrupt:
        sys.stderr.write("interrupted (SIGINT): stopped before the command started; nothing "
                         "was done\n")
        sys.exit(130)
    run()


def _print_version() -> int:
    """``spoolctl <version>`` on stdout through the checked write: 0, or the CLI's output
    codes (141 for a reader gone, 3 for stdout that cannot take it)."""
    import errno

    from spoolctl.version import version

    from .output import write_all

    if sys.stdout is None:
        return 3
    try:
        sys.stdout.flush()
        write_all(sys.stdout.fileno(), f"spoolctl {version()}\n".encode())
    except (OSError, ValueError) as exc:
        if getattr(exc, "errno", None) == errno.EPIPE:
            return 141
        sys.stderr.write(f"error: cannot write the output to stdout: {exc}\n")
        return 3
    return 0
