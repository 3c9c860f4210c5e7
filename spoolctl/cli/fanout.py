"""Running one command on every store a ``--root`` names, and reporting per store.

``run_on_targets`` is how an operator command acts on a root (``targets``):

* one store: the command's document, printed as before (errors raise: one line, exit 2
  or 1 from ``app.main``);
* a deployment directory or base root: the command runs on each rank store in turn; a
  store that fails (foreign-owned, corrupt marker, busy...) becomes that rank's error and
  the others still run. One document holds every rank's result or error, the human
  output shows each rank under its own heading, and the exit code is the worst of the
  ranks (2 > 1 > 0);
* an empty base root (no engine has started yet): "nothing to do", exit 0 (cron stays
  quiet until there is something to maintain).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from spoolctl.errors import DiskNotAnsweringError
from spoolctl.store import NotFoundError, SpoolError

from .common import (
    EXIT_OK,
    View,
    emit,
    err_console,
    error_exit_code,
    open_store,
    plain,
    text,
)
from .disk_deadline import within_disk_timeout
from .targets import StoreTarget, Targets

if TYPE_CHECKING:
    from spoolctl.store import Store

# fn(store, target) -> (document, exit code)
StoreJob = Callable[["Store", StoreTarget], tuple[dict[str, Any], int]]


@dataclass(frozen=True)
class StoreResult:
    """One store's outcome: its document, or the one-line error it failed with."""

    target: StoreTarget
    code: int
    doc: dict[str, Any] | None = None
    error: str | None = None
    not_found: bool = False  # the error was NotFoundError (an entry/item not in this store)
    disk_down: bool = False  # the store's disk did not answer in time (``disk_deadline``)

    def to_json(self) -> dict[str, Any]:
        return outcome_json(self.target.to_json(), self.code, self.doc, self.error,
                            disk_down=self.disk_down)


def outcome_json(where: dict[str, Any], code: int, doc: dict[str, Any] | None,
                 error: str | None, *, disk_down: bool) -> dict[str, Any]:
    """One row of a document run on several stores or drives (``StoreResult``,
    ``DriveResult``): ``where`` (what the row is about), ``exit``, then ``error`` (and
    ``disk_down: true`` when the disk did not answer) or ``result`` (json_contract.py's
    ``stores`` and ``drives``)."""
    out: dict[str, Any] = {**where, "exit": code}
    if error is not None:
        out["error"] = error
        if disk_down:
            out["disk_down"] = True
    else:
        out["result"] = doc
    return out


def run_each(targets: Targets, job: StoreJob, *, read_only_ok: bool = False,
             bounded: bool = False) -> list[StoreResult]:
    """Run ``job`` on every store of ``targets``; a SpoolError ends that store's turn only.
    ``bounded`` (a command that only reads, and whose document is JSON: ``status``): each
    store's turn is bounded by ``disk_deadline``, a hung disk reported as the store down."""
    results = []
    for target in targets.stores:
        def one(target: StoreTarget = target) -> tuple[dict[str, Any], int]:
            with open_store(target.root, read_only_ok=read_only_ok) as store:
                return job(store, target)

        try:
            doc, code = within_disk_timeout(target.root, one) if bounded else one()
        except SpoolError as exc:
            results.append(StoreResult(target, error_exit_code(exc), error=str(exc),
                                       not_found=isinstance(exc, NotFoundError),
                                       disk_down=isinstance(exc, DiskNotAnsweringError)))
            continue
        results.append(StoreResult(target, code, doc=doc))
    return results


def worst(codes: list[int]) -> int:
    return max(codes, default=EXIT_OK)


def multi_doc(targets: Targets, results: list[StoreResult], **extra: Any) -> dict[str, Any]:
    """The JSON document of a command run on several stores."""
    return {"root": str(targets.given), "kind": targets.kind,
            "stores": [r.to_json() for r in results],
            "exit": worst([r.code for r in results]), **extra}


def multi_view(view: View, *, empty: str = "nothing to do") -> View:
    """A view of ``multi_doc`` documents: each store's result through ``view`` under a
    heading naming the store, errors as one escaped line, then a one-line summary."""
    from rich.rule import Rule
    from rich.text import Text

    def render(doc: dict[str, Any]) -> list[Any]:
        stores = doc["stores"]
        if not stores:
            return [Text(f"{empty}: no spoolctl store under {plain(doc['root'])} yet "
                         "(no vLLM deployment has started)")]
        out: list[Any] = []
        for s in stores:
            where = f"{s['deployment']}/" if s.get("deployment") else ""
            name = f"rank-{s['rank']:04d}" if s.get("rank") is not None else s["root"]
            out.append(Rule(text(f"{where}{name}"), align="left"))
            if "error" in s:
                out.append(Text.assemble(("error: ", "red"), plain(s["error"])))
                continue
            shown = view(s["result"])
            out.extend(shown if isinstance(shown, list) else [shown])
        failed = sum(1 for s in stores if "error" in s)
        out.append(Text(f"{len(stores)} stores under {plain(doc['root'])}"
                        + (f", {failed} failed" if failed else "")))
        return out
    return render


def run_on_targets(targets: Targets, job: StoreJob, *, json_output: bool, view: View,
                   read_only_ok: bool = False, empty: str = "nothing to do") -> int:
    """Run ``job`` on ``targets`` and emit the result (see the module docstring); return
    the exit code (the caller raises ``typer.Exit`` with it, or use ``finish``)."""
    doc, code, shown, results = on_targets(targets, job, view=view,
                                           read_only_ok=read_only_ok, empty=empty)
    emit(doc, json_output=json_output, view=shown)
    report_errors(results)
    return code


def on_targets(targets: Targets, job: StoreJob, *, view: View, read_only_ok: bool = False,
               empty: str = "nothing to do",
               ) -> tuple[dict[str, Any], int, View, list[StoreResult]]:
    """``run_on_targets`` without the printing: the document, its exit code, the view that
    shows it and the per-store results (none for one store, whose errors raise)."""
    if targets.single:
        target = targets.stores[0]
        with open_store(target.root, read_only_ok=read_only_ok) as store:
            doc, code = job(store, target)
        return doc, code, view, []
    results = run_each(targets, job, read_only_ok=read_only_ok)
    doc = multi_doc(targets, results)
    return doc, doc["exit"], multi_view(view, empty=empty), results


# -- several drives ------------------------------------------------------------------------


def on_drive(targets: Targets, job: StoreJob, *, view: View, read_only_ok: bool = False,
             ) -> tuple[dict[str, Any], int, View]:
    """``on_targets`` for one drive of several: its stores' errors go to stderr at once."""
    doc, code, shown, results = on_targets(targets, job, view=view, read_only_ok=read_only_ok)
    report_errors(results)
    return doc, code, shown

# fn(one drive's root) -> (the document the command prints for that root alone, its exit
# code, the view that shows it); a SpoolError makes the drive's row an error.
DriveJob = Callable[[Path], tuple[dict[str, Any], int, View]]
# one store's document -> the numbers summed over every store of every drive
StoreTotals = Callable[[dict[str, Any]], dict[str, int]]


@dataclass(frozen=True)
class DriveResult:
    """One drive root's outcome: the command's document for it, or its one-line error."""

    root: Path
    code: int
    doc: dict[str, Any] | None = None
    view: View | None = None
    error: str | None = None
    disk_down: bool = False
    # the rank stores on it a running engine has out of service (``status``)
    taken_out: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        row = outcome_json({"root": str(self.root)}, self.code, self.doc, self.error,
                           disk_down=self.disk_down)
        if self.taken_out:
            row["out_of_service"] = list(self.taken_out)
        return row


def taken_out(docs: list[dict[str, Any]]) -> tuple[str, ...]:
    """The stores among ``docs`` (``status`` documents) whose engine has them out of service
    now: a record that is not known to be stale (``out_of_service``)."""
    facts = [d.get("status", d) for d in docs]  # a rank store's are under ``status``
    return tuple(str(d.get("root")) for d in facts
                 if isinstance(out := d.get("out_of_service"), dict)
                 and "error" not in out and out.get("stale") is not True)


def store_docs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-store documents inside one root's document (``multi_doc``'s results, or the
    document itself for one store)."""
    if isinstance(doc.get("stores"), list) and "kind" in doc:
        return [s["result"] for s in doc["stores"] if isinstance(s.get("result"), dict)]
    return [doc]


def run_per_drive(roots: list[Path], job: DriveJob, *, json_output: bool,
                  totals: StoreTotals,
                  per_store: Callable[[dict[str, Any]], list[dict[str, Any]]] = store_docs,
                  ) -> int:
    """Run ``job`` on each drive root in turn and emit one document: a row per drive (its
    document or its error: a drive missing, unreadable or hung costs only its own row) and
    ``totals`` over every store that answered (``per_store`` splits a drive's document into
    the documents ``totals`` counts; ``export`` counts its one archive per drive). Returns
    the worst drive's exit code."""
    results: list[DriveResult] = []
    for root in roots:
        try:
            doc, code, view = job(root)
        except SpoolError as exc:
            results.append(DriveResult(root, error_exit_code(exc), error=str(exc),
                                       disk_down=isinstance(exc, DiskNotAnsweringError)))
            continue
        results.append(DriveResult(root, code, doc=doc, view=view,
                                   taken_out=taken_out(per_store(doc))))
    summed: dict[str, int] = {}
    for r in results:
        for one in per_store(r.doc) if r.doc is not None else ():
            for key, value in totals(one).items():
                summed[key] = summed.get(key, 0) + value
    down = [r for r in results if r.error is not None]
    code = worst([r.code for r in results])
    doc = {"roots": [str(r) for r in roots], "drives": [r.to_json() for r in results],
           "totals": {"drives": len(results), "drives_down": len(down), **summed},
           "exit": code}
    emit(doc, json_output=json_output, view=lambda d: _drives_view(results, d))
    for r in down:  # on stderr too: cron mails it
        err_console.print(text(f"error: drive {r.root}: {r.error}"), soft_wrap=True)
    return code


def _drives_view(results: list[DriveResult], doc: dict[str, Any]) -> list[Any]:
    from rich.text import Text

    out: list[Any] = []
    for r in results:
        # the whole path, never shortened to the terminal's width (a Rule would)
        head = Text.assemble(("drive ", "bold"), (plain(str(r.root)), "bold"))
        if r.taken_out:  # the engine bypasses it: said on the drive's own line
            head.append(f"  out of service for its engine ({len(r.taken_out)} rank "
                        f"store{'s' if len(r.taken_out) > 1 else ''})", style="red")
        out.append(head)
        if r.error is not None:
            state = "down (its disk did not answer)" if r.disk_down else "error"
            out.append(Text.assemble((f"{state}: ", "red"), plain(r.error)))
            continue
        assert r.view is not None
        shown = r.view(r.doc)
        out.extend(shown if isinstance(shown, list) else [shown])
    totals = doc["totals"]
    parts = [f"{k} {v:,}" for k, v in totals.items() if k not in ("drives", "drives_down")]
    out.append(Text(f"{totals['drives']} drives" + (
        f", {totals['drives_down']} down or unreadable" if totals["drives_down"] else "")
        + (": " + ", ".join(parts) if parts else "")))
    return out


def report_errors(results: list[StoreResult]) -> None:
    """One line on stderr per store that failed (cron mails stderr; the JSON on stdout goes
    to a log nobody reads until something is wrong)."""
    for r in results:
        if r.error is not None and not r.not_found:
            err_console.print(text(f"error: {r.target.label}: {r.error}"), soft_wrap=True)


def finish(code: int) -> None:
    """Exit with ``code`` unless it is 0 (a command's normal return)."""
    if code:
        raise typer.Exit(code)
