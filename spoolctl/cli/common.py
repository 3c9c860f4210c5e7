"""Shared CLI plumbing: the --root/--json options, exit codes, and the one output sink.

Output: a command's result is one JSON-ready document. ``emit`` prints it as JSON for
scripts (``--json``), or hands it to the command's *view* (document -> rich renderables)
for people. A command prints its result no other way, so both outputs come from the same
data and cannot drift apart.

Text that comes from a store or a client (keys, namespaces, meta, display names, paths,
quarantine details, error messages) is data, never markup: views pass it through
``plain`` (control characters shown escaped, so no terminal escape sequence, OSC 8
hyperlink or bidi override reaches the terminal) and ``esc`` / ``text`` (rich markup
escaped). JSON output is the document itself, unchanged.
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from spoolctl.errors import OutputWriteError
from spoolctl.store import (
    ConfigError,
    CorruptionError,
    NotFoundError,
    RootError,
    SpoolError,
    StoreIOError,
)

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.text import Text

    from spoolctl.store import Store

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
# The output cannot be written whole (stdout, an archive, a metrics textfile: a full disk, an
# I/O error, a closed descriptor): the command stopped; nothing cut was put in place.
# Distinct from 1 (findings) and 2 (usage).
EXIT_OUTPUT = 3
# The reader of stdout went away (`spoolctl status | head -1`): the shells' code for a
# process killed by SIGPIPE (128 + 13), so `set -o pipefail` scripts see what they expect.
EXIT_PIPE = 141
SCHEMA_PREFIX = "spoolctl-cli/"


def error_exit_code(exc: SpoolError) -> int:
    """The one mapping of a store error to an exit code (a whole command's, ``app.main``,
    and one store's of several, ``fanout``): 1 for findings (corruption, an entry not
    found), 2 for usage and configuration (a ConfigError always, whatever else it is), 3 for
    output (stdout, an archive, a textfile) that could not be written whole."""
    if isinstance(exc, ConfigError):
        return EXIT_USAGE
    if isinstance(exc, OutputWriteError):
        return EXIT_OUTPUT
    return EXIT_FINDINGS if isinstance(exc, (CorruptionError, NotFoundError)) else EXIT_USAGE
ENV_ROOT = "SPOOLCTL_ROOT"


def default_root() -> Path:
    """The user's spoolctl cache dir (XDG on Linux, ~/Library/Caches on macOS): the default
    store and the models ``prefill`` fetches live in it. ``$SPOOLCTL_ROOT`` is the default
    ``--root`` (``default_store_root``), never this."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "spoolctl"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spoolctl"


def default_store_root() -> Path:
    """The default ``--root``: ``$SPOOLCTL_ROOT`` (a store, or the connector's base root: the
    same variable the connector reads for ``spoolctl_root``), else the store inside the
    cache dir (models etc. live beside it)."""
    env = os.environ.get(ENV_ROOT)
    if env and ":" in env:
        # Only status, metrics, clean, scrub and export take several roots (drive_roots);
        # the others would take "a:b" for one path and create a store there.
        raise ConfigError(f"${ENV_ROOT} names several roots (separated by ':') and this "
                          "command takes one", path=env,
                          fix=f"pass the one root with --root (or set {ENV_ROOT} to it); "
                              "status, metrics, clean, scrub and export take several")
    return Path(env) if env else default_root() / "store"


def _refuse_several_roots(ctx: typer.Context, value: list[str] | None) -> list[str] | None:
    """A one-root command given ``--root`` more than once is a usage error, not click's
    silent "the last one wins" (``keys rotate --root a --root b`` rotated b only, exit 0)."""
    if value and len(value) > 1:
        raise ConfigError(f"`{ctx.command_path}` takes one --root, and {len(value)} were given",
                          path=" ".join(value),
                          fix="run it once per root; status, metrics, clean, scrub and "
                              "export take several")
    return value


# Text, made a Path by ``resolve_root``: declared through typer's public API only (a repeatable
# text option plus a callback), since typer validates its own parameter types and refuses one
# changed behind its back. Text, not click's Path: that stats the path while parsing.
RootOption = Annotated[
    list[str] | None,
    typer.Option("--root", metavar="<path>", callback=_refuse_several_roots,
                 help=f"Store root (absolute). Default: ${ENV_ROOT}, else "
                 "~/.cache/spoolctl/store.", show_default=False),
]
# Text, made a Path by ``drive_roots`` / ``first_root``: click's Path type stats the path
# while parsing the command line, which blocks forever on a hung mount point, before any
# disk deadline can bound it.
RootsOption = Annotated[
    list[str] | None,
    typer.Option("--root", metavar="<path>", help=f"Store root (absolute); repeat it for a "
                 f"host's several drives (one row per drive, and totals). Default: "
                 f"${ENV_ROOT} (several roots separated by ':'), else "
                 "~/.cache/spoolctl/store.", show_default=False),
]


JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
RankOption = Annotated[int | None, typer.Option(
    "--rank", min=0, max=9999, help="Only this rank's store (when --root is a vLLM base root "
    "or deployment directory).", show_default=False)]
DeploymentOption = Annotated[str | None, typer.Option(
    "--deployment", help="Only this deployment directory (its name, or a unique prefix of "
    "at least 4 characters) under a vLLM base root.", show_default=False)]

class CommandConsole:
    """The rich ``Console`` of the command being run, made at its first use in each command
    (``renew`` drops it), so each command takes ``COLUMNS`` and the terminal as they are then
    and one that prints nothing through rich never imports rich. Every attribute is the
    Console's."""

    def __init__(self, **options: Any):
        self._options = options
        self._console: Console | None = None

    def renew(self) -> None:
        """Drop this command's Console: the next use makes one from the environment then."""
        self._console = None

    def get(self) -> Console:
        if self._console is None:
            from rich.console import Console

            self._console = Console(**self._options)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)

    # Special methods are looked up on the type, not through __getattr__: rich's own
    # objects (Live, Progress) enter their console (``with console:``), so they get the
    # Console itself (``get()``); these two keep a ``with`` on this object working too.
    def __enter__(self) -> Console:
        return self.get().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.get().__exit__(*exc)


# stdout carries results (tables or JSON); stderr carries errors and progress.
console = CommandConsole(highlight=False)
err_console = CommandConsole(stderr=True, highlight=False)


def new_command() -> None:
    """A command starts: both consoles are made again at their first use (``COLUMNS``, the
    terminal and ``NO_COLOR`` as they are for this command)."""
    console.renew()
    err_console.renew()


def deprecated_alias(old: str, new: str, old_value: Any, new_value: Any) -> Any:
    """The value of option ``new``, also given under its deprecated name ``old`` (kept one
    release for scripts): a one-line warning on stderr when ``old`` is used; both at once is
    a usage error."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise ConfigError(f"{old} and {new} are the same option", fix=f"pass only {new}")
    from rich.text import Text

    err_console.print(Text(f"spoolctl: warning: {old} is deprecated: use {new}"),
                      soft_wrap=True)
    return old_value


def first_root(roots: list[str] | None) -> Path | None:
    """The one ``--root`` of a ``RootsOption`` (None: not given) when ``drive_roots`` found
    no several."""
    return Path(roots[0]) if roots else None


def drive_roots(roots: list[str] | None) -> list[Path] | None:
    """The roots of a command that takes several drives (repeated ``--root``, or
    ``$SPOOLCTL_ROOT`` with ':' between roots), or None for one root: the command then
    runs exactly as with a single ``--root`` (or none). A root given twice
    or an empty element is a usage error."""
    if roots:
        if len(roots) == 1:
            return None
        given = [Path(root) for root in roots]
    else:
        env = os.environ.get(ENV_ROOT, "")
        if ":" not in env:
            return None
        if any(not part for part in env.split(":")):
            raise ConfigError(f"${ENV_ROOT} has an empty root between its ':'", path=env,
                              fix=f"separate the drive roots by single ':', e.g. "
                                  f"{ENV_ROOT}=/nvme0/spool:/nvme1/spool")
        given = [Path(part) for part in env.split(":")]
    seen: set[str] = set()
    for root in given:
        norm = os.path.normpath(str(root))
        if norm in seen:
            raise ConfigError("the same root is given twice", path=str(root),
                              fix="name each drive's root once")
        seen.add(norm)
    return given


def resolve_root(root: Path | str | list[str] | None) -> Path:
    """The one root a command acts on: ``--root`` (a ``RootOption`` hands a list of at most
    one), else ``$SPOOLCTL_ROOT``, else the user's store."""
    if isinstance(root, list):
        root = root[0] if root else None
    return Path(root) if root is not None else default_store_root()


def open_store(root: Path | str | list[str] | None, *, create: bool = False,
               max_bytes: int | None = None,
               read_only_ok: bool = False) -> Store:
    """Open the store at ``root``. ``read_only_ok`` (commands that only read): if it cannot
    be opened for writing because of permissions (a read-only or immutable catalog, a
    directory this user cannot write), open it read-only and say so on stderr; a store an
    older spoolctl wrote is opened read-only too (reading never upgrades it)."""
    from spoolctl.store import Store
    path = str(resolve_root(root))
    try:
        return Store.open(path, create=create, max_bytes=max_bytes, upgrade=not read_only_ok)
    except (StoreIOError, ConfigError) as exc:
        if not read_only_ok or create or not permission_problem(exc):
            raise
        why = exc.message
    store = Store.open(path, read_only=True)
    from rich.text import Text

    err_console.print(Text(f"spoolctl: warning: {plain(path)} cannot be written "
                           f"({plain(why)}); read-only view (`spoolctl doctor` says why)"),
                      soft_wrap=True)
    return store


def permission_problem(exc: Exception) -> bool:
    """True if ``exc`` says the store cannot be *written* (permissions, read-only or
    immutable files), as opposed to being absent, foreign-owned or damaged."""
    if isinstance(exc, RootError):
        return False
    if isinstance(exc, StoreIOError):
        return exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
    return isinstance(exc, ConfigError) and exc.message.startswith("permission denied")


_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e"
                     "\u2060-\u2069\ufeff]")


def plain(value: Any) -> str:
    """``value`` as text safe for a terminal: control characters (C0, DEL, C1: escape
    sequences, OSC 8 hyperlinks, clear-screen...), zero-width and bidi-override characters
    are shown as ``\\x1b`` / ``\\u202e`` escapes instead of acting on the terminal."""
    text = value if isinstance(value, str) else str(value)
    return _UNSAFE.sub(lambda m: repr(m.group())[1:-1] if ord(m.group()) < 0x100
                       else f"\\u{ord(m.group()):04x}", text)


def esc(value: Any) -> str:
    """``plain(value)`` with rich markup escaped, to embed store text in a markup string."""
    from rich.markup import escape

    return escape(plain(value))


def text(value: Any, style: str | None = None) -> Text:
    """``plain(value)`` as a rich Text (never parsed as markup)."""
    from rich.text import Text

    return Text(plain(value), style=style or "")


class JsonState:
    """What this invocation's ``--json`` output has done so far (one process, one command).

    ``emitted``: a document was printed, so an error after it adds no second one.
    ``to_stderr``: stdout carries something else (``export -o -`` writes the archive there),
    so the document, an error one included, goes to stderr."""

    emitted = False
    to_stderr = False
    pretty = False  # --pretty: indented even when the stream is not a terminal

    @classmethod
    def reset(cls) -> None:
        cls.emitted = False
        cls.to_stderr = False
        cls.pretty = False


def schema_id(command: str | None = None) -> str:
    """The schema id of a command's JSON document: ``spoolctl-cli/<command>/v1``, the
    command path joined by ``-`` (``quarantine ls`` -> ``spoolctl-cli/quarantine-ls/v1``).
    ``command`` defaults to the command being run (click's current context)."""
    if command is None:
        ctx = _current_context()
        words = ctx.command_path.split()[1:] if ctx is not None else []
        command = "-".join(words) or "spoolctl"
    return f"{SCHEMA_PREFIX}{command.replace(' ', '-')}/v1"


def _current_context() -> Any:
    # typer vendors click (typer._click); a base install has no `click` package.
    try:
        from typer._click.globals import get_current_context
    except ImportError:  # an older typer that uses click itself
        from click import get_current_context  # type: ignore[no-redef]  # same function
    return get_current_context(silent=True)


def emit_json(doc: Any, *, command: str | None = None) -> None:
    """Print ``doc`` as the command's one JSON document, with its schema id (``schema``, a
    key no command uses for anything else) first-class: documented in docs/json.md."""
    if isinstance(doc, dict) and not str(doc.get("schema", "")).startswith(SCHEMA_PREFIX):
        doc = {**doc, "schema": schema_id(command)}  # the CLI's id, whatever a part carried
    stream = sys.stderr if JsonState.to_stderr else sys.stdout
    # One line per document for logs and pipes (cron appends them); indented for people.
    indent = 2 if JsonState.pretty or _is_terminal(stream) else None
    stream.write(json.dumps(exact_ints(doc), indent=indent, sort_keys=True, default=str)
                 + "\n")
    stream.flush()
    JsonState.emitted = True


# The largest integer a double holds exactly: jq and JavaScript read JSON numbers as doubles.
MAX_EXACT_INT = 2**53 - 1


def exact_ints(value: Any) -> Any:
    """``value`` with every integer beyond +-(2**53 - 1) as its decimal string (random 63-bit
    ids, byte counts past 8 PiB): a reader that parses numbers as doubles would round it."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value) if abs(value) > MAX_EXACT_INT else value
    if isinstance(value, dict):
        return {k: exact_ints(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [exact_ints(v) for v in value]
    return value


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def error_doc(message: str, *, code: int, fix: str | None = None, path: str | None = None,
              kind: str = "error", **extra: Any) -> dict[str, Any]:
    """The JSON document of a failed command (``spoolctl-cli/error/v1``): what went wrong,
    where, the fix and the exit code, so a log of ``--json`` output records failures too."""
    return {"schema": schema_id("error"), "ok": False, "exit": code,
            "error": {"kind": kind, "message": message, "path": path, "fix": fix}, **extra}


View = Callable[[Any], "RenderableType | list[RenderableType]"]


def emit(doc: Any, *, json_output: bool, view: View) -> None:
    """Print ``doc`` as JSON (``json_output``) or as what ``view(doc)`` renders, on stdout.

    A view returns one renderable or a list of them; a ``str`` is rich markup, a
    ``rich.text.Text`` is printed as is (use it for text that came from the store).
    """
    if json_output:
        emit_json(doc)
        return
    from rich.text import Text

    shown = view(doc)
    for renderable in shown if isinstance(shown, list) else [shown]:
        # Plain text is never wrapped at the console width on a pipe (rich assumes 80
        # columns there): a line of `ls | grep` output must hold whole ids.
        console.print(renderable, soft_wrap=isinstance(renderable, Text)
                      and not console.is_terminal)
