"""The typer application and the console-script entry point.

``main()`` turns every SpoolError into one line on stderr and exit code 2
(usage/configuration) or 1 (findings such as corruption), never a traceback
unless ``--debug`` is given.
"""

from __future__ import annotations

import logging
import os
import sys

import typer

from spoolctl import __version__
from spoolctl.store.errors import ConfigError, CorruptionError, NotFoundError, SpoolError

from .common import EXIT_FINDINGS, EXIT_USAGE, err_console

app = typer.Typer(
    name="spoolctl",
    help="Operate spoolctl prompt/KV cache stores: see, verify, clean and repair them.",
    no_args_is_help=False,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"spoolctl {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def _root_callback(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks and debug logs."),
) -> None:
    if debug:
        os.environ["SPOOLCTL_DEBUG"] = "1"
        logging.basicConfig(level=logging.DEBUG)
    if ctx.invoked_subcommand is None:
        # Bare `spoolctl` shows the status of the default root (help is `--help`).
        from .store_cmds import status

        status(root=None, json_output=False, check=False)


def _register() -> None:
    # Each module adds its commands to ``app``; imported here so the app is complete
    # whichever module is imported first.
    from . import commands, prefill, vllm_config  # noqa: F401


_register()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    logging.basicConfig(level=logging.WARNING, format="spoolctl: %(levelname)s: %(message)s")
    try:
        code = app(args=argv, standalone_mode=False, prog_name="spoolctl")
        # Without standalone mode click returns (not raises) a command's typer.Exit code.
        if isinstance(code, int) and code:
            sys.exit(code)
    except SpoolError as exc:
        if debug:
            raise
        err_console.print(f"[red]error:[/red] {exc}", markup=True, highlight=False, soft_wrap=True)
        code = EXIT_FINDINGS if isinstance(exc, (CorruptionError, NotFoundError)) else EXIT_USAGE
        if isinstance(exc, ConfigError):
            code = EXIT_USAGE
        sys.exit(code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(EXIT_USAGE)
    except Exception as exc:  # click usage errors and anything unexpected
        import click

        usage_errors = (click.exceptions.ClickException, getattr(typer, "TyperException", ()))
        if isinstance(exc, usage_errors):
            # One line, like every other error (typer >= 0.2x vendors click, so both bases).
            ctx = getattr(exc, "ctx", None)
            where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            if exc.format_message().strip():  # empty after a bare group printed its help
                err_console.print(f"[red]error:[/red] {exc.format_message()}{where}",
                                  markup=True, highlight=False, soft_wrap=True)
            sys.exit(EXIT_USAGE)
        if isinstance(exc, click.exceptions.Exit):
            sys.exit(exc.exit_code)
        if debug:
            raise
        err_console.print(f"[red]error:[/red] unexpected {type(exc).__name__}: {exc} "
                          "(rerun with --debug for a traceback and report it)")
        sys.exit(EXIT_USAGE)
