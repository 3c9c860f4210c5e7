"""The typer application and the console-script entry point.

``main()`` turns every SpoolError into one line on stderr and exit code 2
(usage/configuration) or 1 (findings such as corruption), never a traceback
unless ``--debug`` is given. With ``--json`` the failure is also one JSON document on stdout
(``common.error_doc``), so a log of ``--json`` output records failures. Output that cannot be
written has its own codes: 141 when the reader of stdout went away (silent,
as for any Unix filter), 3 when stdout cannot take it (full disk, I/O error, closed).
Usage errors are recognised without importing ``click``: typer vendors its own copy
(``typer._click``) and a base install has no ``click`` package, so exceptions are matched
by class name. Log lines carry store text (paths, file names), so they are printed with
control characters escaped too.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
from typing import Any, Protocol, TextIO, cast

import typer

from spoolctl.errors import DiskNotAnsweringError, SpoolError
from spoolctl.store import ALLOW_FOREIGN_ENV

from . import commands
from .common import (
    EXIT_OUTPUT,
    EXIT_PIPE,
    EXIT_USAGE,
    JsonState,
    emit_json,
    err_console,
    error_doc,
    error_exit_code,
    esc,
    new_command,
    plain,
)
from .interrupt import exit_code, interrupt_of, signal_name, signals_as_interrupts, take
from .output import write_all

_app = typer.Typer(
    name="spoolctl",
    help="Operate spoolctl prompt/KV cache stores: see, verify, clean and repair them.",
    no_args_is_help=False,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from spoolctl.version import version

        sys.stdout.write(f"spoolctl {version()}\n")
        raise typer.Exit()


@_app.callback(invoke_without_command=True)
def _root_callback(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks and debug logs."),
    pretty: bool = typer.Option(
        False, "--pretty", help="Indent --json output even when stdout is not a terminal "
        "(it is one line per document there); also accepted after the command."),
    allow_foreign_owner: bool = typer.Option(
        False, "--allow-foreign-owner",
        help=f"Operate on a store root owned by another user (sets {ALLOW_FOREIGN_ENV}=1)."),
) -> None:
    if allow_foreign_owner:
        # The store reads this at every open; one switch for every command.
        os.environ[ALLOW_FOREIGN_ENV] = "1"
    if debug:  # main() reads --debug itself (tracebacks); here only the log level
        logging.basicConfig(level=logging.DEBUG)
    if ctx.invoked_subcommand is None:
        # Bare `spoolctl` shows the status of the default root (help is `--help`).
        from .store_cmds import status

        status(root=None, json_output=False, check=False, rank=None, deployment=None)


_registered: list[bool] = []


def full_app() -> typer.Typer:
    """The spoolctl app with every command (cli/commands.py), registered at the first call:
    a process that runs one command imports only its module (``build_command``)."""
    if not _registered:
        commands.register(_app)
        _registered.append(True)
    return _app


def __getattr__(name: str) -> Any:
    # `from spoolctl.cli.app import app`: the whole app, as before commands loaded lazily.
    if name == "app":
        return full_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _SafeFormatter(logging.Formatter):
    """Log lines with control characters shown escaped (messages name store files)."""

    def format(self, record: logging.LogRecord) -> str:
        return plain(super().format(record))


class _ClickError(Protocol):
    """What the CLI uses of click's exceptions (whichever copy of click typer uses)."""

    def format_message(self) -> str: ...


def _is(exc: BaseException, *names: str) -> bool:
    """True if ``exc`` is an instance of a class named one of ``names`` (click's classes,
    whichever copy of click typer uses)."""
    return any(cls.__name__ in names for cls in type(exc).__mro__)


def _command_line(argv: list[str] | None) -> str:
    """``spoolctl CMD [SUBCMD]`` as typed (the words before the first option)."""
    words: list[str] = []
    for word in argv if argv is not None else sys.argv[1:]:
        if word.startswith("-") or len(words) == 2:
            break
        words.append(word)
    return " ".join(["spoolctl", *words])


def _interrupted(exc: KeyboardInterrupt, json_mode: bool) -> int:
    """A command stopped by SIGINT/SIGTERM without its own summary: one line, 130/143,
    and with --json the error document. A command that has a summary
    prints it and exits with the same code."""
    line = (f"interrupted ({signal_name(exc)}): stopped; what finished before it is kept "
            "(every entry is whole or absent); run the command again to continue")
    err_console.print(line, highlight=False, soft_wrap=True, markup=False)
    return _fail(line, code=exit_code(exc), fix="run the command again to continue",
                 path=None, kind="interrupted", json_mode=json_mode)


class OutputError(Exception):
    """stdout could not take the command's output (``errno`` says why)."""

    def __init__(self, exc: OSError | ValueError):
        super().__init__(str(exc))
        self.errno = getattr(exc, "errno", None)


class _GuardedStdout:
    """sys.stdout for one command: a write or flush that fails raises ``OutputError``, so a
    closed pipe or a full disk under ``> FILE`` is told apart from the store's own I/O
    (which is always a SpoolError) instead of surfacing as an unexpected OSError. Text goes
    to the descriptor through the one checked write (``output.write_all``): Python's
    unbuffered stdout drops the rest of a short write, and a full disk cut the output."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        try:
            self._fd: int | None = stream.fileno()
        except (OSError, ValueError, AttributeError):  # a StringIO (an in-process caller)
            self._fd = None

    def write(self, data: str) -> int:
        try:
            if self._fd is None:
                return self._stream.write(data)
            self._stream.flush()  # what was written to the stream itself goes first
            write_all(self._fd, data.encode(self._stream.encoding or "utf-8",
                                            self._stream.errors or "strict"))
            return len(data)
        except (OSError, ValueError) as exc:
            raise OutputError(exc) from exc

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError) as exc:
            raise OutputError(exc) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null so the interpreter's final flush of what is still buffered
    does not fail again (Python documents this for SIGPIPE), and drop the buffer."""
    try:
        fd = sys.__stdout__.fileno() if sys.__stdout__ is not None else None
    except (AttributeError, ValueError, OSError):
        fd = None
    if fd is None:
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:
        pass


# The root callback's own options: they may come before a command, nothing else may.
_GLOBAL_FLAGS = ("--debug", "--allow-foreign-owner", "--version", "--help", "-h")
# kubectl/restic habit: `spoolctl --root X status`. These options belong to the commands;
# written before the command they are moved after it.
_MOVABLE = ("--root", "--json")


def _normalise_argv(argv: list[str]) -> list[str]:
    """``--root X`` / ``--root=X`` / ``--json`` before the command moved after the command
    path, where every command defines them; with no command at all, ``status`` (what a bare
    ``spoolctl`` runs)."""
    moved: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _GLOBAL_FLAGS:
            rest.append(arg)
        elif arg in _MOVABLE:
            moved.append(arg)
            if arg == "--root" and i + 1 < len(argv):
                moved.append(argv[i + 1])
                i += 1
        elif arg.startswith("--root="):
            moved.append(arg)
        else:
            break
        i += 1
    if not moved:
        return argv
    tail = argv[i:]
    if not tail:
        return [*rest, "status", *moved]
    if "--" in tail:  # after `--` everything is an argument: insert before it
        cut = tail.index("--")
        return [*rest, *tail[:cut], *moved, *tail[cut:]]
    return [*rest, *tail, *moved]


def _take_pretty(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--pretty`` (a switch of the output, valid anywhere before ``--``),
    and whether it was given."""
    end = argv.index("--") if "--" in argv else len(argv)
    kept = [arg for arg in argv[:end] if arg != "--pretty"]
    return kept + argv[end:], len(kept) != end


def _json_requested(argv: list[str]) -> bool:
    return "--json" in (argv[:argv.index("--")] if "--" in argv else argv)


_CHOICES = re.compile(r"^(?:Value error, )?('.*') is not one of (.*?)\.?$")
_PYDANTIC = (
    (re.compile(r"^Input should be greater than or equal to (\S+)$"), "must be at least {}"),
    (re.compile(r"^Input should be less than or equal to (\S+)$"), "must be at most {}"),
    (re.compile(r"^Input should be greater than (\S+)$"), "must be more than {}"),
    (re.compile(r"^Input should be less than (\S+)$"), "must be less than {}"),
    (re.compile(r"^Input should be a valid integer.*$"), "must be a whole number"),
    (re.compile(r"^Input should be a valid number.*$"), "must be a number"),
    # click's wording (typer <= 0.28 validates with its vendored click)
    (re.compile(r"^\S+ is not in the range x>=(\S+?)\.?$"), "must be at least {}"),
    (re.compile(r"^\S+ is not in the range x<=(\S+?)\.?$"), "must be at most {}"),
    (re.compile(r"^\S+ is not in the range x>(\S+?)\.?$"), "must be more than {}"),
    (re.compile(r"^\S+ is not in the range x<(\S+?)\.?$"), "must be less than {}"),
    (re.compile(r"^\S+ is not in the range (\S+?)<=x<=(\S+?)\.?$"), "must be from {} to {}"),
    (re.compile(r"^.* is not a valid int(?:eger)?(?: range)?\.?$"), "must be a whole number"),
    (re.compile(r"^.* is not a valid float(?: range)?\.?$"), "must be a number"),
)


def usage_message(exc: BaseException) -> tuple[str, str]:
    """A click/typer usage error as the tool's (cause, fix): the library's validation
    wording (pydantic's "Input should be...", "Value error, ...") replaced by ours, the fix
    naming the command's --help."""
    ctx = getattr(exc, "ctx", None)
    path = ctx.command_path if ctx is not None else "spoolctl"
    fix = f"see `{path} --help`"
    message = exc.format_message().strip() if hasattr(exc, "format_message") else str(exc)
    param = getattr(exc, "param", None)
    if _is(exc, "BadParameter") and param is not None:
        raw = str(getattr(exc, "message", message)).strip()
        raw = raw.removeprefix("Value error, ")
        opts = getattr(param, "opts", None) or [getattr(param, "name", "value")]
        hint = "/".join(opts) if getattr(param, "param_type_name", "") == "option" \
            else getattr(param, "human_readable_name", opts[0])
        choices = _CHOICES.match(raw)
        if choices:
            allowed = ", ".join(c.strip().strip("'") for c in choices.group(2).split(","))
            return (f"invalid value for {hint}: {choices.group(1)} is not one of {allowed}",
                    f"use one of {allowed}")
        for pattern, words in _PYDANTIC:
            hit = pattern.match(raw)
            if hit:
                raw = words.format(*hit.groups())
                break
        return f"invalid value for {hint}: {raw}", fix
    if _is(exc, "NoSuchOption"):
        name = getattr(exc, "option_name", "")
        where = ctx.command_path if ctx is not None else "spoolctl"
        possible = getattr(exc, "possibilities", None) or []
        if possible:
            fix = f"did you mean {' or '.join(sorted(possible))}? ({fix})"
        elif ctx is not None and ctx.parent is None and not ctx.invoked_subcommand:
            fix = f"options go after the command, e.g. `spoolctl status {name} ...` ({fix})"
        return f"no such option for `{where}`: {name}", fix
    message = message[:1].lower() + message[1:] if message[:2] != message[:2].upper() \
        else message
    return message.rstrip("."), fix


def build_command(argv: list[str] | None = None) -> Any:
    """The click command tree of ``app`` with what typer's help gets wrong fixed: a boolean
    flag shows no ``<bool>`` placeholder (it takes no value), and an option's placeholder
    names what it takes (the same name for the same thing in every command).

    With ``argv`` whose command word names a command (``status``, ``quarantine``), the tree
    holds only that command (typer builds every command's click form each time it is asked,
    and a process runs one). Anything else (no command, a typo, a completion request) gets
    the whole tree, so ``--help`` and "did you mean" see every command."""
    import typer.main

    from .placeholders import polish

    name = next((word for word in argv or () if not word.startswith("-")), None)
    if argv == []:  # bare `spoolctl` runs `status` (the root callback)
        name = "status"
    command = typer.main.get_command(_only(name) if name else full_app())
    polish(command)
    return command


def _only(name: str) -> typer.Typer:
    """The spoolctl app with only the top-level command or group ``name``, whose module
    alone is imported (``commands.module_of``); the whole app if no command has that name.
    The command modules' Typers are added without a name (``commands.register``), so their
    commands and groups are the top level."""
    import copy

    from typer.models import DefaultPlaceholder

    def named(value: Any) -> Any:  # typer keeps an unset name as a placeholder object
        return value.value if isinstance(value, DefaultPlaceholder) else value

    module = commands.module_of(name)
    if module is None:
        return full_app()
    found = [c for c in module.commands.registered_commands if named(c.name) == name]
    groups = [g for g in module.commands.registered_groups if named(g.name) == name]
    if not found and not groups:  # commands.COMMANDS out of date: the whole tree
        return full_app()
    slim = copy.copy(module.commands)
    slim.registered_commands, slim.registered_groups = found, groups
    only = copy.copy(_app)
    only.registered_groups = []
    only.add_typer(slim)
    return only


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    json_mode = _json_requested(args)
    JsonState.reset()
    args, JsonState.pretty = _take_pretty(args)
    new_command()  # this command's consoles take COLUMNS and the terminal as they are now
    if not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(_SafeFormatter("spoolctl: %(levelname)s: %(message)s"))
        logging.basicConfig(level=logging.WARNING, handlers=[handler])
    if sys.stdout is None:  # started with fd 1 closed (`spoolctl ... >&-`): nothing is done
        if sys.stderr is not None:
            sys.stderr.write("error: stdout is closed: nothing was done: give the command an "
                             "output (> FILE, > /dev/null or a pipe)\n")
        sys.exit(EXIT_OUTPUT)
    saved_stdout = sys.stdout
    sys.stdout = _GuardedStdout(saved_stdout)
    try:
        code = _run(_normalise_argv(args), debug=debug, json_mode=json_mode)
    except OutputError as exc:
        sys.stdout = saved_stdout
        _silence_stdout()
        if exc.errno == errno.EPIPE:
            sys.exit(EXIT_PIPE)
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        err_console.print(f"[red]error:[/red] cannot write the output to stdout: "
                          f"{esc(reason)}: free space where stdout goes, or redirect it "
                          "(> FILE, > /dev/null)", highlight=False, soft_wrap=True)
        sys.exit(EXIT_OUTPUT)
    finally:
        if isinstance(sys.stdout, _GuardedStdout):
            sys.stdout = saved_stdout
    if code:
        sys.exit(code)


def _fail(message: str, *, code: int, fix: str | None, path: str | None, kind: str,
          json_mode: bool, human: str | None = None, **extra: Any) -> int:
    """Report a failure: one line on stderr; with --json also the error document (unless the
    command already printed its one document). Returns the exit code."""
    if human is not None:
        err_console.print(human, markup=True, highlight=False, soft_wrap=True)
    if json_mode and not JsonState.emitted:
        emit_json(error_doc(plain(message), code=code, fix=fix, path=path, kind=kind,
                            **extra))
    return code


def _run(argv: list[str], *, debug: bool, json_mode: bool) -> int:
    try:
        with signals_as_interrupts():
            code = build_command(argv).main(args=argv, standalone_mode=False,
                                              prog_name="spoolctl")
        # Without standalone mode click returns (not raises) a command's typer.Exit code;
        # typer returns a KeyboardInterrupt as a silent 130 (whichever signal it was).
        pending = take()
        if pending is not None and code == 130:
            return _interrupted(pending, json_mode)
        if isinstance(code, int) and code:
            return _exit_code(code, json_mode)
        return 0
    except OutputError:
        raise
    except SpoolError as exc:
        if debug:
            raise
        return _fail(exc.message, code=error_exit_code(exc), fix=exc.fix, path=exc.path,
                     kind=type(exc).__name__, json_mode=json_mode,
                     human=f"[red]error:[/red] {esc(str(exc))}",
                     **({"disk_down": True} if isinstance(exc, DiskNotAnsweringError) else {}))
    except typer.Exit as exc:
        cause = interrupt_of(exc)
        if cause is not None and take() is not None:  # not reported by the command
            return _interrupted(cause, json_mode)
        return _exit_code(exc.exit_code, json_mode)
    except PermissionError as exc:  # a path this user may not read: the usual error line
        if debug:
            raise
        from spoolctl.errors import from_os_permission

        denied = from_os_permission(exc)
        return _fail(denied.message, code=error_exit_code(denied), fix=denied.fix,
                     path=denied.path, kind=type(denied).__name__, json_mode=json_mode,
                     human=f"[red]error:[/red] {esc(str(denied))}")
    except KeyboardInterrupt as exc:  # SIGINT / SIGTERM outside click's own handling
        take()
        return _interrupted(exc, json_mode)
    except typer.Abort as exc:
        cause = interrupt_of(exc)
        if cause is not None and take() is not None:  # click turned an interrupt into Abort
            return _interrupted(cause, json_mode)
        return _fail("aborted", code=EXIT_USAGE, fix=None, path=None, kind="Abort",
                     json_mode=json_mode, human="aborted")
    except Exception as exc:  # click usage errors and anything unexpected
        if _is(exc, "ClickException", "TyperException"):
            # empty after a bare group printed its help
            if not cast("_ClickError", exc).format_message().strip():
                return EXIT_USAGE
            reason, fix = usage_message(exc)
            # One line, like every other error: `error: cause: fix`.
            return _fail(reason, code=EXIT_USAGE, fix=fix, path=None, kind="UsageError",
                         json_mode=json_mode,
                         human=f"[red]error:[/red] {esc(reason)}: {esc(fix)}")
        if _is(exc, "Exit"):
            return _exit_code(getattr(exc, "exit_code", 0), json_mode)
        if _is(exc, "Abort"):
            return _fail("aborted", code=EXIT_USAGE, fix=None, path=None, kind="Abort",
                         json_mode=json_mode, human="aborted")
        if debug:
            raise
        from .extras import missing_extra

        needs = missing_extra(exc, _command_line(argv))
        if needs is not None:  # a base install running a framework command: not a bug
            return _fail(needs, code=EXIT_USAGE, fix=None, path=None, kind="MissingExtra",
                         json_mode=json_mode, human=f"[red]error:[/red] {esc(needs)}")
        return _fail(f"unexpected {type(exc).__name__}: {exc}", code=EXIT_USAGE,
                     fix="rerun with --debug for a traceback and report it", path=None,
                     kind="unexpected", json_mode=json_mode,
                     human=f"[red]error:[/red] unexpected {type(exc).__name__}: "
                           f"{esc(str(exc))} "
                           "(rerun with --debug for a traceback and report it)")


def _exit_code(code: int, json_mode: bool) -> int:
    """A command's own non-zero exit: with --json and no document printed yet (a command
    that failed after saying why on stderr), the error document says so on stdout."""
    if code and json_mode and not JsonState.emitted:
        emit_json(error_doc(f"the command failed with exit code {code} (stderr says why)",
                            code=code, fix=None, kind="exit"))
    return code
