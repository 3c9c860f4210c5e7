"""The typer application and the console-script entry point.

``main()`` turns every SpoolError into one line on stderr and exit code 2
(usage/configuration) or 1 (findings such as corruption), never a traceback
unless ``--debug`` is given. Usage errors are recognised without importing ``click``:
typer vendors its own copy (``typer._click``) and a base install has no ``click``
package, so exceptions are matched by class name. Log lines carry store text (paths,
file names), so they are printed with control characters escaped too.
"""

from __future__ import annotations

import logging
import os
import sys

import typer
from rich.markup import escape

from spoolctl import __version__
from spoolctl.store.errors import ConfigError, CorruptionError, NotFoundError, SpoolError
from spoolctl.store.root import ALLOW_FOREIGN_ENV

from .common import EXIT_FINDINGS, EXIT_USAGE, err_console, plain
from .interrupt import exit_code, interrupt_of, signal_name, signals_as_interrupts, take

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
    allow_foreign_owner: bool = typer.Option(
        False, "--allow-foreign-owner",
        help=f"Operate on a store root owned by another user (sets {ALLOW_FOREIGN_ENV}=1)."),
) -> None:
    if allow_foreign_owner:
        # The store reads this at every open; one switch for every command.
        os.environ[ALLOW_FOREIGN_ENV] = "1"
    if debug:
        os.environ["SPOOLCTL_DEBUG"] = "1"
        logging.basicConfig(level=logging.DEBUG)
    if ctx.invoked_subcommand is None:
        # Bare `spoolctl` shows the status of the default root (help is `--help`).
        from .store_cmds import status

        status(root=None, json_output=False, check=False, rank=None, deployment=None)


def _register() -> None:
    # Each module adds its commands to ``app``; imported here so the app is complete
    # whichever module is imported first.
    from . import commands, prefill, transfer_cmds, vllm_config  # noqa: F401


_register()


def _one_line(text: str) -> str:
    """Error text safe to print: control characters (newlines, terminal escapes) from user
    input are shown escaped, and rich markup in it is not interpreted."""
    return escape(plain(text))


class _SafeFormatter(logging.Formatter):
    """Log lines with control characters shown escaped (messages name store files)."""

    def format(self, record: logging.LogRecord) -> str:
        return plain(super().format(record))


def _is(exc: BaseException, *names: str) -> bool:
    """True if ``exc`` is an instance of a class named one of ``names`` (click's classes,
    whichever copy of click typer uses)."""
    return any(cls.__name__ in names for cls in type(exc).__mro__)


def _command_line(argv: list[str] | None) -> str:
    """``spoolctl CMD [SUBCMD]`` as typed (the words before the first option)."""
    words = []
    for word in argv if argv is not None else sys.argv[1:]:
        if word.startswith("-") or len(words) == 2:
            break
        words.append(word)
    return " ".join(["spoolctl", *words])


def _interrupted(exc: KeyboardInterrupt) -> None:
    """A command stopped by SIGINT/SIGTERM without its own summary: one line, 130/143
    (decision 2310). A command that has a summary prints it and exits with the same code."""
    err_console.print(f"interrupted ({signal_name(exc)}): stopped; what finished before it "
                      "is kept (every entry is whole or absent); run the command again to "
                      "continue", highlight=False, soft_wrap=True, markup=False)
    sys.exit(exit_code(exc))


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    if not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(_SafeFormatter("spoolctl: %(levelname)s: %(message)s"))
        logging.basicConfig(level=logging.WARNING, handlers=[handler])
    try:
        with signals_as_interrupts():
            code = app(args=argv, standalone_mode=False, prog_name="spoolctl")
        # Without standalone mode click returns (not raises) a command's typer.Exit code;
        # typer returns a KeyboardInterrupt as a silent 130 (whichever signal it was).
        pending = take()
        if pending is not None and code == 130:
            _interrupted(pending)
        if isinstance(code, int) and code:
            sys.exit(code)
    except SpoolError as exc:
        if debug:
            raise
        err_console.print(f"[red]error:[/red] {_one_line(str(exc))}", markup=True,
                          highlight=False, soft_wrap=True)
        code = EXIT_FINDINGS if isinstance(exc, (CorruptionError, NotFoundError)) else EXIT_USAGE
        if isinstance(exc, ConfigError):
            code = EXIT_USAGE
        sys.exit(code)
    except typer.Exit as exc:
        cause = interrupt_of(exc)
        if cause is not None and take() is not None:  # not reported by the command
            _interrupted(cause)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt as exc:  # SIGINT / SIGTERM outside click's own handling
        take()
        _interrupted(exc)
    except typer.Abort as exc:
        cause = interrupt_of(exc)
        if cause is not None and take() is not None:  # click turned an interrupt into Abort
            _interrupted(cause)
        err_console.print("aborted")
        sys.exit(EXIT_USAGE)
    except Exception as exc:  # click usage errors and anything unexpected
        if _is(exc, "ClickException", "TyperException"):
            # One line, like every other error (typer >= 0.2x vendors click, so both bases).
            ctx = getattr(exc, "ctx", None)
            where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            if exc.format_message().strip():  # empty after a bare group printed its help
                err_console.print(f"[red]error:[/red] {_one_line(exc.format_message())}"
                                  f"{_one_line(where)}",
                                  markup=True, highlight=False, soft_wrap=True)
            sys.exit(EXIT_USAGE)
        if _is(exc, "Exit"):
            sys.exit(getattr(exc, "exit_code", 0))
        if debug:
            raise
        from .extras import missing_extra

        needs = missing_extra(exc, _command_line(argv))
        if needs is not None:  # a base install running a framework command: not a bug
            err_console.print(f"[red]error:[/red] {_one_line(needs)}", highlight=False,
                              soft_wrap=True)
            sys.exit(EXIT_USAGE)
        err_console.print(f"[red]error:[/red] unexpected {type(exc).__name__}: "
                          f"{_one_line(str(exc))} "
                          "(rerun with --debug for a traceback and report it)",
                          highlight=False, soft_wrap=True)
        sys.exit(EXIT_USAGE)
