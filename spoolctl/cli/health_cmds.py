"""Watching a store's health: ``metrics`` (Prometheus gauges from the store's facts) and
``doctor`` (checks of the root, filesystem, SQLite files, permissions and rows), on one
store or on every rank store of a vLLM deployment directory or base root.

``metrics`` on several stores writes one exposition with ``deployment`` and ``rank``
labels on every gauge; a rank that cannot be read gets ``spoolctl_store_up 0`` and the
command exits 2 after writing the others (node_exporter keeps getting the healthy ranks).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from spoolctl.store import ConfigError, SpoolError

from .common import (
    EXIT_FINDINGS,
    EXIT_OK,
    EXIT_USAGE,
    DeploymentOption,
    JsonOption,
    RankOption,
    RootOption,
    RootsOption,
    drive_roots,
    emit,
    emit_json,
    err_console,
    esc,
    first_root,
    open_store,
    resolve_root,
    text,
)
from .disk_deadline import within_disk_timeout
from .fanout import finish, multi_doc, multi_view, worst
from .targets import Targets, resolve_targets, targets_from_json, targets_json

if TYPE_CHECKING:
    from rich.table import Table

# This module's commands: cli/commands.py adds them to the spoolctl app (the one place
# that lists every command).
commands = typer.Typer()


@commands.command("metrics")
def metrics_cmd(
    root: RootsOption = None,
    textfile: Annotated[Path | None, typer.Option(
        "--textfile", help="Write atomically to this .prom file (node_exporter textfile "
        "collector) instead of stdout.")] = None,
    rank: RankOption = None,
    deployment: DeploymentOption = None,
    json_output: JsonOption = False,
) -> None:
    """Print store gauges in Prometheus exposition format (or, with --json, as samples).

    On a vLLM base root or deployment directory: the gauges of every rank store, labelled
    `deployment` and `rank`; a rank that cannot be read shows `spoolctl_store_up 0`. With
    `--textfile`, a root that cannot be read at all (gone, unmounted, or a base root with no
    store under it) replaces the file with `spoolctl_store_up 0` alone, then exits 2.

    Example: [bold]spoolctl metrics --textfile /var/lib/node_exporter/textfile/spoolctl.prom[/bold]
    """
    from spoolctl.metrics import down_reason, render_samples, store_unreadable

    if textfile is not None:
        _check_textfile(textfile)
    drives = drive_roots(root)
    if drives is not None:  # several drives: every gauge labelled `drive`
        samples, code = _drive_samples(drives, rank, deployment)
        _emit_samples(samples, code, textfile, json_output)
        return
    try:
        targets = _bounded_targets(first_root(root), rank, deployment)
        if targets.single:
            samples = _gauges_within(targets.given)
    except SpoolError as exc:
        if textfile is None:
            raise
        # The root is gone (unmounted disk, renamed directory) or unreadable: the previous
        # file must not go on saying `store_up 1`. Replace it, then fail.
        _write_atomic(textfile, render_samples(store_unreadable(down_reason(exc))).encode())
        raise
    if textfile is not None and not targets.single and not targets.stores:
        # A base root with no store under it: on a host whose vLLM wrote stores there this
        # is an unmounted disk (the mount point stays, empty). An alert on `store_up == 0`
        # must fire, so the file says so rather than holding no gauge.
        _write_atomic(textfile, render_samples(store_unreadable("missing")).encode())
        raise ConfigError("no spoolctl store under this root (is its disk mounted?); "
                          "wrote spoolctl_store_up 0", path=str(targets.given),
                          fix="mount the store's disk, or run this only once vLLM has "
                              "created its stores there")
    code = EXIT_OK
    if not targets.single:
        samples, code = _rank_samples(targets)
    _emit_samples(samples, code, textfile, json_output)


def _bounded_targets(root: Path | None, rank: int | None, deployment: str | None) -> Targets:
    """``resolve_targets`` read within the disk deadline (``DiskNotAnsweringError``)."""
    return targets_from_json(within_disk_timeout(root or "SPOOLCTL_ROOT", lambda: (
        targets_json(resolve_targets(root, rank=rank, deployment=deployment)))))


def _emit_samples(samples: list[Any], code: int, textfile: Path | None,
                  json_output: bool) -> None:
    from spoolctl.metrics import render_samples

    exposition = render_samples(samples)
    if textfile is not None:
        _write_atomic(textfile, exposition.encode())
    if json_output:  # the samples, and with --textfile where they were written too
        emit_json({**metrics_doc(samples, code), "textfile": textfile and str(textfile)})
    elif textfile is None:
        typer.echo(exposition, nl=False)
    finish(code)


def _drive_samples(drives: list[Path], rank: int | None,
                   deployment: str | None) -> tuple[list[Any], int]:
    """The gauges of every drive, each labelled with its root; a drive that cannot be read
    (missing, unmounted, hung) shows ``spoolctl_store_up{drive=...} 0`` and exits 2."""
    from spoolctl.metrics import (
        check_target,
        down_reason,
        drive_label,
        store_unreadable,
        with_drive,
    )

    samples: list[Any] = []
    code = EXIT_OK
    for one in drives:
        try:
            check_target({"drive": drive_label(str(one))})
        except ValueError:
            raise ConfigError("a drive root must be an absolute path to label its gauges",
                              path=str(one), fix="give its absolute path") from None
    for one in drives:
        try:
            targets = _bounded_targets(one, rank, deployment)
            if targets.single:
                got, got_code = _gauges_within(targets.given), EXIT_OK
            elif not targets.stores:
                raise ConfigError("no spoolctl store under this root (is its disk mounted?)",
                                  path=str(targets.given),
                                  fix="mount the drive, or drop it from the roots")
            else:
                got, got_code = _rank_samples(targets)
        except SpoolError as exc:
            err_console.print(text(f"error: drive {one}: {exc}"), soft_wrap=True)
            got, got_code = store_unreadable(down_reason(exc)), EXIT_USAGE
        samples += with_drive(got, str(one))
        code = max(code, got_code)
    return samples, code


def _gauges_within(root: Path) -> list[Any]:
    """The gauges of the store at ``root``, read in a child bounded by the disk timeout
    (``disk_deadline``: a hung disk raises ``DiskNotAnsweringError``)."""
    from spoolctl.metrics import collect_store_gauges, samples_from_json, samples_json

    def gauges() -> list[Any]:
        with open_store(root, read_only_ok=True) as store:
            return samples_json(collect_store_gauges(store))

    return samples_from_json(within_disk_timeout(root, gauges))


def _rank_samples(targets: Any) -> tuple[list[Any], int]:
    """The gauges of every rank store of a vLLM root, labelled ``deployment`` and ``rank``
    (a rank that cannot be read: ``store_up`` 0), and the exit code."""
    from spoolctl.metrics import down_reason, store_down, with_target

    code = EXIT_OK
    samples = []
    for target in targets.stores:
        assert target.rank is not None and target.deployment is not None
        try:
            store_down(target.deployment, target.rank)  # a name fit for a label?
        except ValueError:
            err_console.print(text(f"error: {target.label}: the deployment directory name "
                                   "cannot be a metric label; its gauges are left out"),
                              soft_wrap=True)
            code = EXIT_USAGE
            continue
        try:
            samples += with_target(_gauges_within(target.root), target.deployment,
                                   target.rank)
        except SpoolError as exc:
            samples += store_down(target.deployment, target.rank, down_reason(exc))
            err_console.print(text(f"error: {target.label}: {exc}"), soft_wrap=True)
            code = EXIT_USAGE
    return samples, code


def metrics_doc(samples: list[Any], code: int) -> dict[str, Any]:
    """The gauges as JSON: one object per sample, its full metric name, labels (the store's
    deployment and rank on a vLLM root) and value, in exposition order."""
    return {"exit": code, "metrics": [
        {"name": s.spec.name, "type": s.spec.type, "labels": dict(s.target + s.labels),
         "value": s.value} for s in samples]}


def _check_textfile(path: Path) -> None:
    if not path.is_absolute():
        raise ConfigError("--textfile must be an absolute path", path=str(path),
                          fix="pass e.g. /var/lib/node_exporter/textfile/spoolctl.prom")
    if path.suffix != ".prom":
        raise ConfigError("--textfile must end in .prom (node_exporter ignores others)",
                          path=path, fix="rename it to *.prom")
    if not path.parent.is_dir():
        raise ConfigError("the --textfile directory does not exist", path=path.parent,
                          fix="create it or point --textfile elsewhere")


def _write_atomic(path: Path, data: bytes) -> None:
    """The metrics file replaced whole (``output.replace_file``), mode 0644 whatever the
    umask: node_exporter runs as another user."""
    from .output import replace_file

    replace_file(path, data, mode=0o644)


@commands.command("doctor")
def doctor_cmd(
    root: RootOption = None,
    rank: RankOption = None,
    deployment: DeploymentOption = None,
    json_output: JsonOption = False,
) -> None:
    """Check the root, the filesystem and SQLite health; print what to fix.

    Root: marker, permissions, owner. Filesystem: type, free space vs max size, the
    full-disk reserve, O_DIRECT, fsync. Catalog: integrity, writability, malformed rows.
    Files: directories and files this user cannot read or write, special files, entries
    the scrub could not read. Exit 1 when a check fails. On a vLLM base root or
    deployment directory: every rank store.

    Example: [bold]spoolctl doctor --root /var/cache/spoolctl[/bold]
    """
    from spoolctl.store import encryption_checks, run_checks

    def one(path: Path) -> tuple[dict[str, Any], int]:
        checks = run_checks(path) + _genai_checks(path) + _model_checks(path) \
            + encryption_checks(path)
        failed = any(c.status == "fail" for c in checks)
        return ({"root": str(path), "ok": not failed, "checks": [c.to_json() for c in checks]},
                EXIT_FINDINGS if failed else EXIT_OK)

    try:
        targets = resolve_targets(root, rank=rank, deployment=deployment)
    except ConfigError:
        if rank is not None or deployment is not None:
            raise
        targets = None  # not a store or vLLM root: the checks say what is wrong with it
    if targets is None or targets.single:
        doc, code = one(resolve_root(root) if targets is None else targets.given)
        emit(doc, json_output=json_output, view=_doctor_view)
        finish(code)
        return
    from .fanout import StoreResult
    from .lifecycle import deployment_uses, siblings, verdicts

    uses = deployment_uses(siblings(targets))
    judged = verdicts(uses)
    results = []
    for target in targets.stores:
        doc, code = one(target.root)
        stale = judged.get(target.deployment or "")
        if stale is not None and stale.stale:  # a warning: stale is not broken
            use = uses[target.deployment or ""]
            doc["checks"].append(_lifecycle_check(stale, use.bytes).to_json())
        results.append(StoreResult(target, code, doc=doc))
    doc = multi_doc(targets, results)
    emit(doc, json_output=json_output, view=multi_view(_doctor_view))
    finish(worst([r.code for r in results]))


def _lifecycle_check(verdict: Any, size: int) -> Any:
    """``deployment.lifecycle``: a deployment that nothing will read again."""
    from spoolctl.store import Check

    from . import render

    return Check("deployment.lifecycle", "warn",
                 f"deployment {verdict.state} ({verdict.reason}"
                 + (f"; replaced by {verdict.successor[:24]}" if verdict.successor else "")
                 + f"): {render.size(size)} no engine will read again",
                 "`spoolctl clean --superseded --yes` reclaims it (or "
                 "`--unused-for 30d`; see docs/runbook.md)")


def _model_checks(path: Path) -> list[Any]:
    """``model.lifecycle``: a controller model of this store nothing will read again: a
    warning per stale namespace, none when there is none or the store does not open (the
    store checks say why)."""
    from spoolctl.store import Check, Store

    from . import render
    from .lifecycle import model_uses, model_verdicts

    try:
        with Store.open(path, read_only=True) as store:
            uses = model_uses(store)
    except (SpoolError, OSError):
        return []
    checks = []
    for name, verdict in sorted(model_verdicts(uses).items()):
        if verdict.stale:
            use = uses[name]
            checks.append(Check(
                "model.lifecycle", "warn",
                f"model {name[:40]} ({str((use.identity or {}).get('model'))[:80]}) "
                f"{verdict.state} ({verdict.reason}): {render.size(use.bytes)} in "
                f"{use.entries} entries no controller will read again",
                "`spoolctl clean --superseded --yes` reclaims it (or `--unused-for 30d`; "
                "see docs/runbook.md)"))
    return checks


def _genai_checks(path: Path) -> list[Any]:
    """``genai.records``: GenAI records whose facts the GenAI helpers cannot read (skipped
    by ``clean --genai`` and the controller). Only when the store opens read-only and holds
    genai records; anything else is the store checks' business."""
    from spoolctl.controllers.genai.records import index_problem
    from spoolctl.store import Check, Store

    bad: list[str] = []
    total = 0
    try:
        with Store.open(path, read_only=True) as store:
            for row in store.entries(kind="genai"):
                total += 1
                problem = index_problem(row.index)
                if problem is not None:
                    bad.append(f"{row.entry_id[:16]}: {problem}")
    except (SpoolError, OSError):
        return []
    if not total:
        return []
    if not bad:
        return [Check("genai.records", "ok", f"{total} GenAI records readable")]
    return [Check("genai.records", "fail",
                  f"{len(bad)} GenAI record(s) with a malformed value, skipped by `clean "
                  f"--genai` and the controller ({'; '.join(bad[:3])})",
                  "`spoolctl clean --genai --yes` re-indexes them from their manifests; a "
                  "record whose manifest is bad too was written by another tool: delete its "
                  "cache on the server by hand")]


_COLORS = {"ok": "green", "warn": "yellow", "fail": "red"}


def _doctor_view(doc: dict[str, Any]) -> Table:
    from rich.table import Table
    t = Table(title=f"doctor {esc(doc['root'])}", title_justify="left")
    for col in ("check", "status", "detail", "fix"):
        t.add_column(col)
    for c in doc["checks"]:
        color = _COLORS[c["status"]]
        t.add_row(c["name"], f"[{color}]{c['status']}[/{color}]", text(c["detail"]),
                  text(c["fix"]))
    return t
