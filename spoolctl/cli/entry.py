"""The console script's entry point (``spoolctl`` and ``python -m spoolctl``).

Importing the CLI takes about a second on a cold page cache (typer, rich, the store). A
Ctrl-C (or SIGTERM turned into one) in that second must end the command like one anywhere
else (decision 2310): one line, exit 130, nothing done, never a Python traceback. Everything
else is ``spoolctl.cli.app.main``.
"""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from spoolctl.cli.app import main as run
    except KeyboardInterrupt:
        sys.stderr.write("interrupted (SIGINT): stopped before the command started; nothing "
                         "was done\n")
        sys.exit(130)
    run()
