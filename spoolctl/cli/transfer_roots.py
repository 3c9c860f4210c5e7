"""What ``export`` and ``import`` act on, resolved like every other operator command, and
their per-store reports.

``--root`` goes through ``targets.resolve_targets`` and so through the store's one scanner,
``places.inspect_root``: the same kinds (store, deployment, base,
empty), refusals and ``--rank`` / ``--deployment`` narrowing as ``status``/``clean``/
``scrub``. What is handed to the store's exporter/importer is the scanner's own
``RootContents``, narrowed, so the archive format and the deployment placement rule are
unchanged.

Reports: the JSON document keeps the exporter's/importer's keys and adds, per store, its
``root``, ``deployment``, ``rank`` and ``exit`` (and ``error`` for a store that could not be
read), plus the command's worst ``exit`` and the root's ``kind``, like the other commands'
multi-store documents. Human views print every text that came from a store or a client
through ``plain``/``text`` (store text is data, never markup).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spoolctl.store import ConfigError, format_size

from .common import EXIT_OK, EXIT_USAGE, plain, resolve_root, text
from .targets import StoreTarget, Targets, resolve_targets

if TYPE_CHECKING:
    from spoolctl.store import RootContents


@dataclass
class Source:
    """An export's stores: the root's contents to export, and the stores left out with
    why."""

    targets: Targets
    layout: RootContents
    quorum: bool
    by_place: dict[str, StoreTarget] = field(default_factory=dict)
    bad: list[tuple[StoreTarget, str]] = field(default_factory=list)


def export_source(root: Path | None, rank: int | None,
                  deployments: list[str] | None) -> Source:
    """Resolve an export's ``--root`` with ``--rank`` and (repeatable) ``--deployment``.

    With ``--rank`` one rank's shards are taken as they are (no quorum across ranks: the
    rank is all that was asked for); otherwise a vLLM chunk is taken only when every rank
    holds it (a chunk some rank lacks cannot be restored)."""
    from spoolctl.store import RootContents, StorePlace
    names: list[str | None] = [*dict.fromkeys(deployments or [])] or [None]
    resolved = [resolve_targets(root, rank=rank, deployment=name) for name in names]
    first = resolved[0]
    stores: list[StoreTarget] = []
    for t in resolved:
        stores.extend(s for s in t.stores if s not in stores)
    targets = Targets(first.given, first.kind, tuple(stores), first.contents)
    contents = first.contents
    assert contents is not None
    if targets.kind == "store":
        if not contents.exists:  # one store, as for every command: opening it says why not
            contents = RootContents("store", contents.path, (StorePlace(contents.path),))
        return Source(targets, contents, False,
                      {contents.stores[0].place or "": targets.stores[0]})
    chosen = {s.root for s in targets.stores}
    narrowed = dataclasses.replace(
        contents, stores=tuple(s for s in contents.stores if s.path in chosen))
    good, bad = narrowed.archivable()
    source = Source(targets, good, quorum=rank is None)
    by_path = {s.root: s for s in targets.stores}
    source.by_place = {s.place or "": by_path[s.path] for s in good.stores}
    source.bad = [(by_path[s.path], why) for s, why in bad]
    if source.bad and not good.stores and len(targets.stores) == 1:
        raise ConfigError(source.bad[0][1], path=source.bad[0][0].root.parent,
                          fix="export the connector's own deployment directories")
    return source


def import_target(root: Path | str | list[str] | None) -> RootContents:
    """Classify an import's ``--root`` (``inspect_root``): a path that does not exist yet
    or an empty directory (a fresh root), a store, a deployment directory or a base root;
    the importer creates what is missing. A rank store whose deployment name an archive
    cannot carry is left out (no archive routes there)."""
    from spoolctl.store import inspect_root
    return inspect_root(resolve_root(root)).archivable()[0]


def peer_source(path: Path) -> RootContents:
    """Classify a peer root given as import's source, like any ``--root``."""
    src = export_source(path, None, None)
    if src.bad:
        raise ConfigError(src.bad[0][1])
    if not src.layout.stores:
        raise ConfigError("no spoolctl store under this root yet", path=path,
                          fix="pass a store root, a deployment directory or the connector's "
                              "spoolctl_root")
    return src.layout


# -- reports ------------------------------------------------------------------------------


def export_doc(doc: dict[str, Any], source: Source) -> dict[str, Any]:
    """The exporter's document with per-store ``root``/``deployment``/``rank``/``exit``
    (and the stores that could not be read, with their ``error``) and the worst exit."""
    stores = []
    for s in doc["stores"]:
        target = source.by_place.get(s["place"])
        where = target.to_json() if target is not None else \
            {"root": str(source.targets.given), "rank": None, "deployment": None}
        stores.append({**s, **where, "exit": EXIT_OK})
    failed = dict(doc.pop("failed", {}) or {})
    for place, error in failed.items():
        target = source.by_place[place]
        stores.append({"place": place, **target.to_json(), "exit": EXIT_USAGE, "error": error})
    for target, error in source.bad:
        stores.append({"place": None, **target.to_json(), "exit": EXIT_USAGE, "error": error})
    code = max((s["exit"] for s in stores), default=EXIT_OK)
    return {**doc, "kind": source.targets.kind, "stores": stores, "exit": code}


def export_view(doc: dict[str, Any], output: str) -> list[Any]:
    """Per-store rows (for rank stores: which ranks, and how each went), then the summary."""
    from rich.table import Table
    from rich.text import Text
    out: list[Any] = []
    stores = doc["stores"]
    if not stores:
        out.append(Text(f"nothing to export: no spoolctl store under {plain(doc['root'])} "
                        "yet (no vLLM deployment has started); the archive is empty"))
    elif doc["kind"] != "store":  # rank stores: which ones, and how each went
        t = Table(title="spoolctl export", title_justify="left")
        for col in ("store", "entries", "objects", "size", "result"):
            t.add_column(col, justify="left" if col in ("store", "result") else "right",
                         overflow="fold")
        for s in stores:
            label = StoreTarget(Path(s["root"]), s["rank"], s["deployment"]).label
            if "error" in s:
                t.add_row(text(label), "-", "-", "-", text(f"error: {s['error']}", "red"))
            else:
                t.add_row(text(label), str(s["entries"]), str(s["objects"]),
                          format_size(s["bytes"]), "ok")
        out.append(t)
    failed = sum(1 for s in stores if "error" in s)
    out.append(Text(
        f"exported {doc['entries']} entries ({format_size(doc['bytes'])}, {doc['objects']} "
        f"objects) from {len(stores) - failed} store(s) in {doc['seconds']:.2f}s "
        f"({format_size(doc['bytes_per_second'] or 0)}/s)"
        + (f" to {plain(output)}" if output != "-" else "")
        + (f"; {failed} store(s) failed" if failed else "")))
    skipped = {k: v for k, v in doc["left_out"].items() if v}
    if skipped:
        out.append(Text("left out: " + ", ".join(f"{k.replace('_', ' ')} {v}"
                                                  for k, v in skipped.items())))
    return out


def import_doc(doc: dict[str, Any], layout: RootContents) -> dict[str, Any]:
    """The importer's document with each store's ``deployment``/``rank`` and the root's
    ``kind`` and ``exit`` (like the other commands' multi-store documents)."""
    from spoolctl.store import deployment_of, rank_of
    stores = [{**p, "deployment": deployment_of(p["place"]), "rank": rank_of(p["place"])}
              for p in doc["stores"]]
    return {**doc, "kind": layout.kind, "stores": stores}


def import_view(doc: dict[str, Any]) -> list[Any]:
    from rich.table import Table
    from rich.text import Text
    t = Table(title="spoolctl import" + ("" if doc["complete"] else " (stopped)"),
              title_justify="left")
    for col in ("store", "imported", "present", "skipped", "written", "target"):
        t.add_column(col, justify="left" if col in ("store", "target") else "right",
                     overflow="fold")
    for p in doc["stores"]:
        skipped = p["skipped_capacity"] + p["skipped_vanished"] + p["skipped_corrupt"] + \
            p["filtered"] + p.get("skipped_unauthenticated", 0) + p.get("skipped_key", 0)
        t.add_row(text(p["place"] or "(store)"), str(p["imported"]), str(p["present"]),
                  str(skipped), format_size(p["bytes_written"]),
                  text(p["root"] or "- (not selected)"))
    rate = doc["bytes_per_second"]
    if not doc["stores"]:
        return [Text("nothing to import: the archive holds no store (exported from a root "
                     "where no vLLM deployment had started yet)")]
    out: list[Any] = [t, Text(
        f"{doc['imported']} entries imported, {doc['present']} already present, "
        f"{format_size(doc['bytes_written'])} written in {doc['seconds']:.2f}s"
        + (f" ({format_size(rate)}/s read)" if rate else ""))]
    notes = [(doc["skipped_capacity"], "skipped: the store is full (low watermark)"),
             (doc["skipped_vanished"], "skipped: deleted in the source meanwhile"),
             (doc["skipped_corrupt"], "skipped: corrupt in the source"),
             (doc.get("skipped_unauthenticated", 0), "skipped: not authenticated by this "
              "store's tag key (`--retag` if you vouch for the source)"),
             (doc.get("skipped_key", 0), "skipped: encrypted under a data key this host "
              "cannot use (a tenant revoked here, or a key the archive does not carry)"),
             (sum(p.get("keys_added", 0) for p in doc["stores"]),
              "wrapped data key(s) added to the keyring (`spoolctl keys ls`)"),
             (sum(p.get("keys_refused", 0) for p in doc["stores"]),
              "data key(s) not taken: erased or revoked here"),
             (doc["filtered"], "not selected")]
    out.extend(Text(f"{n} {what}") for n, what in notes if n)
    return out
