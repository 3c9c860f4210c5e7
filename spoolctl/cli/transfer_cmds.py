"""``spoolctl export`` and ``spoolctl import``: copy verified entries between hosts.

``spoolctl export --root A | ssh host spoolctl import --root B -`` warms a new replica
(docs/runbook.md). Thin: parses options, opens the archive stream, calls
``store.exporter`` / ``store.importer`` / ``store.peer``, renders. Exit codes: 0 done,
1 a defective archive or corrupt source (ArchiveError / CorruptionError), 2 usage,
configuration or capacity refusals.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import io
import os
import re
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer

from spoolctl.errors import ArchiveError
from spoolctl.store import ConfigError, StoreIOError, parse_size

from .common import (
    EXIT_FINDINGS,
    JsonOption,
    JsonState,
    RankOption,
    RootOption,
    RootsOption,
    View,
    console,
    deprecated_alias,
    drive_roots,
    emit_json,
    err_console,
    error_doc,
    esc,
    first_root,
    text,
)
from .disk_deadline import within_disk_timeout
from .fanout import finish, run_per_drive
from .transfer_progress import TransferProgress, want_progress
from .transfer_roots import (
    export_doc,
    export_source,
    export_view,
    import_doc,
    import_target,
    import_view,
    peer_source,
)

if TYPE_CHECKING:
    from spoolctl.store import Selection

# This module's commands: cli/commands.py adds them to the spoolctl app (the one place
# that lists every command).
commands = typer.Typer()


class ExportHint(str, enum.Enum):
    retain = "retain"
    release = "release"
    any = "any"


KindOption = Annotated[list[str] | None, typer.Option(
    "--kind", metavar="<kind>",
    help="Only entries of this kind (vllm, pytorch, mlx, genai); repeatable.",
    show_default=False)]
NamespaceOption = Annotated[list[str] | None, typer.Option(
    "--namespace", metavar="<namespace>",
    help="Only entries of this namespace; repeatable.", show_default=False)]
ProgressOption = Annotated[bool | None, typer.Option(
    "--progress/--no-progress", help="Progress on stderr (default: when stderr is a terminal).",
    show_default=False)]


# `--max-size` of export/import was a selection limit, `--max-size` of init the capacity:
# one name, two meanings. The selection limit is --limit-size; the old name stays one
# release, hidden, with a warning (a renamed option stays one release).
DeprecatedMaxSize = Annotated[str | None, typer.Option(
    "--max-size", hidden=True, help="Deprecated name of --limit-size.", show_default=False)]


def _selection(kind: list[str] | None, namespace: list[str] | None,
               deployment: list[str] | None, hint: str | None,
               max_size: str | None) -> Selection:
    from spoolctl.store import Selection
    return Selection(kinds=frozenset(kind or ()), namespaces=frozenset(namespace or ()),
                     deployments=tuple(deployment or ()), hint=hint,
                     max_bytes=parse_size(max_size) if max_size is not None else None)


def _interrupted(exc: KeyboardInterrupt, what: str) -> None:
    """Stopped by SIGINT/SIGTERM: one line saying what was done, exit 130 / 143."""
    from .interrupt import exit_code, reported, signal_name

    reported()
    err_console.print(text(f"interrupted ({signal_name(exc)}): {what}"), soft_wrap=True)
    raise typer.Exit(exit_code(exc)) from None


# -- export ------------------------------------------------------------------------------


@contextlib.contextmanager
def _archive_sink(output: str, force: bool) -> Iterator[int]:
    """A file descriptor to write the archive to; for a regular file, a temp name in the same
    directory renamed into place only when the archive is complete."""
    if output == "-":
        if sys.stdout.isatty():
            raise ConfigError("refusing to write an archive to a terminal",
                              fix="redirect stdout (> FILE, | ssh ...) or pass -o FILE")
        sys.stdout.flush()
        yield sys.stdout.fileno()
        return
    path = Path(output).expanduser()
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise ConfigError(f"cannot use the output: {os.strerror(exc.errno or 0)}", path=path,
                          fix="pass a writable file path") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError("the output is a directory", path=path,
                              fix="pass a file name, e.g. -o replica.tar")
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))  # a FIFO or device
        try:
            yield fd
        finally:
            os.close(fd)
        return
    if st is not None and not force:
        raise ConfigError("the output file exists", path=path,
                          fix="remove it, choose another name or add --force")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    from .output import sweep_leftovers

    sweep_leftovers(path, ".part")  # an export killed with -9 left its .part: gone now
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     0o600)
    except OSError as exc:
        raise ConfigError(f"cannot create the output: {os.strerror(exc.errno or 0)}",
                          path=path, fix="pass a path in a writable directory") from None
    done = False
    try:
        yield fd
        # No fsync: every import verifies every byte and the end record, so an archive
        # damaged by a crash is refused, never trusted (and tar does not fsync either).
        done = True
    finally:
        os.close(fd)
        if done:
            os.replace(tmp, path)
        else:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@commands.command("export")
def export_cmd(
    root: RootsOption = None,
    output: Annotated[str, typer.Option(
        "--output", "-o", metavar="<file|->",
        help="Archive file to write, or - for stdout; with several --root, a directory "
        "(one archive per drive, <drive>.tar).")] = "-",
    kind: KindOption = None,
    namespace: NamespaceOption = None,
    deployment: Annotated[list[str] | None, typer.Option(
        "--deployment", metavar="<deployment>",
        help="Only this deployment directory under a vLLM base root (its name, or a unique "
        "prefix of at least 4 characters); repeatable.", show_default=False)] = None,
    rank: RankOption = None,
    hint: Annotated[ExportHint, typer.Option(
        "--hint", help="Entries with this hint: retain (live), release or any.")] =
        ExportHint.retain,
    max_size: Annotated[str | None, typer.Option(
        "--limit-size", metavar="<size>",
        help="At most this many bytes, most recently used entries first "
        "(e.g. 50GiB).", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing output file.")]
        = False,
    progress: ProgressOption = None,
    json_output: JsonOption = False,
    old_max_size: DeprecatedMaxSize = None,
    sign_key: Annotated[str | None, typer.Option(
        "--sign-key", help="Sign the archive with this Ed25519 private key (PEM): writes "
        "<output>.sig next to it, or with -o - a signature trailer at the stream's end.",
        show_default=False)] = None,
) -> None:
    """Write selected entries as one streaming, verified archive (tar) to a file or stdout.

    --root may be a store, a vLLM deployment directory or the connector's base root (every
    rank store under it, per-rank results; a vLLM chunk is taken only when every rank
    holds it, unless --rank picks one rank). A rank store that cannot be read is reported
    and the others are exported (exit 2); an empty base root gives an empty archive. The
    archive lists with `tar -tvf`; import it with `spoolctl import`. With -o - (the
    default) the archive goes to stdout and the --json summary to stderr. Several --root
    (a host's drives): -o DIR gets one archive per drive, named after it (nvme0-spool.tar),
    each imported onto the matching drive; a drive that is down is reported, the others
    are exported (exit 2).

    Example: [bold]spoolctl export --root /nvme/spool | ssh new-host spoolctl import
    --root /nvme/spool -[/bold]
    """
    max_size = deprecated_alias("--max-size", "--limit-size", old_max_size, max_size)
    selection = _selection(kind, namespace, None,
                           None if hint is ExportHint.any else hint.value, max_size)
    show = want_progress(progress, json_output)
    drives = drive_roots(root)
    if drives is not None:  # several drives: one archive per drive
        _export_drives(drives, output, force=force, selection=selection, rank=rank,
                       deployment=deployment, sign_key=sign_key, show=show,
                       json_output=json_output)
        return
    # With -o - stdout is the archive: the --json document (an error one too) goes to stderr.
    JsonState.to_stderr = output == "-"
    doc = _export_root(first_root(root), output, force=force, selection=selection, rank=rank,
                       deployment=deployment, sign_key=sign_key, show=show)
    if json_output:
        emit_json(doc)  # on stderr with -o - (JsonState.to_stderr)
    else:
        out = err_console if output == "-" else console
        for renderable in export_view(doc, output):
            out.print(renderable)
    if output != "-":  # the document went to stdout: each failed store on stderr too
        _report_failed_stores(doc)
    if doc["exit"]:
        raise typer.Exit(doc["exit"])


def _report_failed_stores(doc: dict[str, Any]) -> None:
    for s in doc["stores"]:
        if "error" in s:
            err_console.print(text(f"error: {s['place'] or s['root']}: {s['error']}"),
                              soft_wrap=True)


def _export_root(root: Path | None, output: str, *, force: bool, selection: Selection,
                 rank: int | None, deployment: list[str] | None, sign_key: str | None,
                 show: bool, signer: Any = None) -> dict[str, Any]:
    """Export one root to ``output`` (a file, or - for stdout); its document. A SpoolError
    (the root missing or unreadable, the output refused or full) leaves no file behind."""
    from spoolctl.store import FdSink, export

    source = export_source(root, rank, deployment)
    if signer is None and sign_key is not None:
        from spoolctl.store import load_signing_key

        signer = load_signing_key(Path(sign_key).expanduser())
    bar = TransferProgress("export", show)
    try:
        with _archive_sink(output, force) as fd, bar:
            sink: Any = FdSink(fd)
            # a stream has no file beside it for the signature: it goes in a trailer
            if signer is not None and output == "-":
                from spoolctl.store import SigningSink

                sink = SigningSink(sink)
            report = export(source.layout.path, sink, selection, progress=bar,
                            layout=source.layout, quorum=source.quorum)
            if signer is not None and output == "-":
                FdSink(fd)([sink.trailer(signer)])
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: say what is left, 130 / 143
        left = ("the archive on stdout is incomplete (no end record): every import refuses "
                "it" if output == "-" else f"no archive written ({output} not created)")
        _interrupted(exc, f"export stopped after {bar.entries} entries; {left}")
    except BrokenPipeError:
        with contextlib.suppress(OSError):  # no flush error on the dead pipe at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise StoreIOError("the archive's reader closed the pipe before the end",
                           path=output, fix="see the importing side's error") from None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG):
            from .output import output_failed

            where = "stdout" if output == "-" else output
            raise output_failed(exc, where, "free space where the archive is written; no "
                                "archive was put in place") from None
        raise
    doc = export_doc(report.to_json(), source)
    doc["output"] = output
    if signer is not None:
        from spoolctl.store import sign_archive

        doc["signature"] = "-" if output == "-" else \
            str(sign_archive(Path(output).expanduser(), signer))
    return doc


# -- export across drives ------------------------------------------------------------------


def drive_archive_name(root: Path) -> str:
    """The archive's file name for a drive root: its absolute path's components joined by
    '-' (``/nvme0/spool`` -> ``nvme0-spool.tar``), anything but letters, digits, '.', '_'
    and '-' replaced by '_', so an operator sees at a glance which drive it came from."""
    parts = [re.sub(r"[^A-Za-z0-9._-]", "_", part)
             for part in Path(os.path.abspath(root)).parts[1:]]
    return ("-".join(parts) or "root") + ".tar"


def _export_drives(drives: list[Path], output: str, *, force: bool, selection: Selection,
                   rank: int | None, deployment: list[str] | None, sign_key: str | None,
                   show: bool, json_output: bool) -> None:
    """One archive per drive, in the directory ``output``, named after the drive: each one
    imports onto the matching drive of the new host unchanged (the archive format has no
    drive). A drive missing, unreadable or not answering within the disk timeout is its
    own error row; the others are exported; exit 2."""
    if output == "-":
        raise ConfigError("several drive roots write one archive per drive, not one stream",
                          fix="pass -o DIR (an existing directory): DIR/<drive>.tar each, "
                              "or export each drive with its own --root")
    directory = Path(output).expanduser()
    if not directory.is_dir():
        raise ConfigError("with several drive roots -o is a directory (one archive per "
                          "drive is written there)", path=directory,
                          fix=f"mkdir {directory} first, or pass an existing directory")
    names: dict[str, Path] = {}
    for drive in drives:
        name = drive_archive_name(drive)
        if name in names:
            raise ConfigError(f"two drive roots give the same archive name {name}",
                              path=str(drive), fix=f"export {names[name]} and {drive} with "
                              "separate commands and -o FILE each")
        names[name] = drive
        if not force and os.path.lexists(directory / name):  # before any drive is written
            raise ConfigError("the output file exists", path=directory / name,
                              fix="remove it, choose another directory or add --force")
    signer = None
    if sign_key is not None:  # read once, not per drive
        from spoolctl.store import load_signing_key

        signer = load_signing_key(Path(sign_key).expanduser())

    def job(drive: Path) -> tuple[dict[str, Any], int, View]:
        # The drive is scanned first in a child bounded by SPOOLCTL_DISK_TIMEOUT: a hung
        # mount is this drive's row, not a stalled command.
        within_disk_timeout(drive, lambda: _probe_drive(drive, rank, deployment))
        target = str(directory / drive_archive_name(drive))
        doc = _export_root(drive, target, force=force, selection=selection, rank=rank,
                           deployment=deployment, sign_key=None, show=show, signer=signer)
        _report_failed_stores(doc)
        return doc, doc["exit"], lambda d: export_view(d, d["output"])

    finish(run_per_drive(drives, job, json_output=json_output, totals=_export_totals,
                         per_store=lambda doc: [doc]))


def _probe_drive(drive: Path, rank: int | None, deployment: list[str] | None) -> bool:
    """What an export reads of a drive before its first entry: the scan of its stores and
    each store's directory (run in the bounded child)."""
    source = export_source(drive, rank, deployment)
    for store in source.layout.stores:
        if store.path.exists():
            os.listdir(store.path)
    return True


def _export_totals(doc: dict[str, Any]) -> dict[str, int]:
    """One drive's archive, summed over the drives."""
    return {"archives": 1, "stores": sum(1 for s in doc["stores"] if "error" not in s),
            **{k: int(doc.get(k) or 0) for k in ("entries", "objects", "bytes")}}


# -- import ------------------------------------------------------------------------------


@commands.command("import")
def import_cmd(
    source: Annotated[str, typer.Argument(
        metavar="source",
        help="Archive file, - for stdin, or another store root (a peer's root mounted "
        "here, read only).", show_default=False)],
    root: RootOption = None,
    deployment: Annotated[list[str] | None, typer.Option(
        "--deployment", metavar="<deployment>",
        help="Import only this vLLM deployment's chunks (directory name or "
        "unique prefix), also into a root that serves other deployments; repeatable.",
        show_default=False)] = None,
    rank: Annotated[int | None, typer.Option(
        "--rank", min=0, max=9999, show_default=False,
        help="Import only this rank's stores of the source (a host of a multi-host "
        "deployment takes its own ranks).")] = None,
    kind: KindOption = None,
    namespace: NamespaceOption = None,
    max_size: Annotated[str | None, typer.Option(
        "--limit-size", metavar="<size>",
        help="From a store root: at most this many bytes, newest first (the store's "
        "capacity is --store-max-size).", show_default=False)] = None,
    store_max_size: Annotated[str | None, typer.Option(
        "--store-max-size", metavar="<size>",
        help="Max size recorded in stores the import creates.",
        show_default=False)] = None,
    retag: Annotated[bool, typer.Option(
        "--retag", help="With a tag key: tag entries the key does not authenticate "
        "(you vouch for the source) instead of skipping them.")] = False,
    progress: ProgressOption = None,
    json_output: JsonOption = False,
    old_max_size: DeprecatedMaxSize = None,
    require_signed: Annotated[bool, typer.Option(
        "--require-signed", help="Refuse the archive, before importing anything, unless its "
        "<archive>.sig verifies under --verify-key.")] = False,
    verify_key: Annotated[str | None, typer.Option(
        "--verify-key", help="The fleet's Ed25519 public key (PEM) for --require-signed.",
        show_default=False)] = None,
) -> None:
    """Import an archive (or a peer's store root): verify every byte, then publish.

    Every object is checked against its digest and every manifest validated before the
    entry is committed (crash-safe, like any commit); objects and entries already present
    are skipped; the store's capacity is respected (never evicts; what does not fit is
    skipped). vLLM chunks go to the rank store of their own deployment under --root.
    A defective archive stops the import (exit 1); entries verified before the defect stay.
    With a tag key (SPOOLCTL_TAG_KEY_FILE), entries without a tag valid under it are
    skipped (exit 1) unless --retag.

    Example: [bold]ssh old-host spoolctl export --root /nvme/spool | spoolctl import
    --root /nvme/spool -[/bold]
    """
    from spoolctl.store import Importer, Selection

    max_size = deprecated_alias("--max-size", "--limit-size", old_max_size, max_size)
    layout = import_target(root)
    store_max = parse_size(store_max_size) if store_max_size is not None else None
    selection = _selection(kind, namespace, None, None, max_size)
    show = want_progress(progress, json_output)
    is_dir = source != "-" and Path(source).expanduser().is_dir()
    if max_size is not None and not is_dir:
        raise ConfigError("--limit-size selects entries from a store root", fix="limit an "
                          "archive when exporting it (spoolctl export --limit-size)")

    public = None
    if require_signed or verify_key is not None:
        from spoolctl.store import load_verify_key

        if not (require_signed and verify_key is not None):
            raise ConfigError("--require-signed and --verify-key go together",
                              fix="pass both: --require-signed --verify-key fleet.pub")
        if is_dir:
            raise ConfigError("--require-signed needs an archive (a file with its .sig, or a "
                              "signed stream on stdin)", fix="export the store with --sign-key")
        public = load_verify_key(Path(verify_key).expanduser())

    def wants(manifest: Any) -> bool:
        return selection.wants(manifest.kind, manifest.namespace)

    with TransferProgress("import", show) as bar:
        importer = Importer(layout.path, accept=tuple(deployment or ()),
                            store_max_bytes=store_max, progress=bar,
                            wants=None if is_dir else wants, rank=rank, layout=layout,
                            retag=retag)
        try:
            if is_dir:
                from spoolctl.store import import_from_root

                peer = Path(os.path.abspath(Path(source).expanduser()))
                report = import_from_root(importer, peer, Selection(
                    kinds=selection.kinds, namespaces=selection.namespaces,
                    deployments=tuple(deployment or ()), max_bytes=selection.max_bytes),
                    layout=peer_source(peer))
            elif public is not None and source == "-":
                from spoolctl.store import verified_stream_copy

                with _archive_source(source) as raw, \
                        verified_stream_copy(raw, public) as copy, \
                        _archive_source(str(copy)) as stream:
                    report = importer.from_archive(stream, source)
            elif public is not None:
                from spoolctl.store import verified_copy

                with verified_copy(Path(source).expanduser(), public) as copy, \
                        _archive_source(str(copy)) as stream:
                    report = importer.from_archive(stream, source)
            else:
                with _archive_source(source) as stream:
                    report = importer.from_archive(stream, source)
        except KeyboardInterrupt as exc:
            # Entries committed so far stay (each is complete); staged files were removed.
            bar.enabled = False
            _interrupted(exc, f"import stopped: {importer.report.total('imported')} entries "
                              "imported stay (each complete); run it again for the rest")
        except ArchiveError as exc:
            partial = getattr(exc, "report", None)
            bar.enabled = False
            done = import_doc(partial.to_json(), layout) if partial is not None else None
            if json_output:  # one document: the error, with what was imported before it
                emit_json(error_doc(exc.message, code=EXIT_FINDINGS, fix=exc.fix,
                                    path=exc.path, kind=type(exc).__name__, report=done))
            elif done is not None and (done["stores"] or done.get("imported")):
                _render_import(done, json_output)
            err_console.print(f"[red]error:[/red] {esc(str(exc))}", highlight=False,
                              soft_wrap=True)
            raise typer.Exit(EXIT_FINDINGS) from None
    doc = import_doc(report.to_json(), layout)
    _render_import(doc, json_output)
    if doc["skipped_unauthenticated"]:
        raise typer.Exit(EXIT_FINDINGS)


@contextlib.contextmanager
def _archive_source(source: str) -> Iterator[io.BufferedIOBase]:
    if source == "-":
        if sys.stdin.isatty():
            raise ConfigError("stdin is a terminal, not an archive",
                              fix="pipe an archive in (spoolctl export ... | spoolctl import -)"
                                  " or pass a file")
        # a BufferedReader at run time (typeshed types it as BinaryIO, without readinto)
        stdin = cast(io.BufferedIOBase, sys.stdin.buffer)
        # Empty stdin (the exporting side failed, or nothing was piped): say that, once,
        # instead of "nothing to import" and "not a spoolctl archive" together.
        if hasattr(stdin, "peek") and not stdin.peek(1):
            raise ArchiveError("the archive is empty: stdin had no bytes", path="-",
                               fix="pipe `spoolctl export` into it (if the export failed, "
                                   "its own error says why)")
        yield stdin
        return
    path = Path(source).expanduser()
    try:
        f = io.BufferedReader(io.FileIO(path, "r"), buffer_size=1 << 20)  # closed below
    except FileNotFoundError:
        raise ConfigError("archive not found", path=path, fix="check the path") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the archive: {os.strerror(exc.errno or 0)}", path=path,
                          fix="pass a readable file") from None
    with f:
        yield f


def _render_import(doc: dict[str, Any], json_output: bool) -> None:
    if json_output:
        emit_json(doc)
        return
    for renderable in import_view(doc):
        console.print(renderable)
