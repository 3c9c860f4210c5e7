"""What ``status`` reports of one store: its JSON document and its view for people."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import render
from .common import plain, text

if TYPE_CHECKING:
    from rich.table import Table
    from rich.text import Text

    from spoolctl.store import Store, StoreFacts


def status_doc(store: Store, facts: StoreFacts | None = None) -> dict[str, Any]:
    """Everything ``status`` reports for one store: its facts snapshot (``Store.facts``)
    plus the expiry of its GenAI records."""
    from spoolctl.controllers.genai.records import expiry_summary

    facts = facts if facts is not None else store.facts()
    genai = store.entries(kind="genai") if "genai" in facts.by_kind else []
    doc = {**facts.to_json(), "genai": expiry_summary(genai, time.time()).to_json()}
    if (out := out_of_service_doc(store.root)) is not None:
        doc["out_of_service"] = out
    return doc


def out_of_service_doc(store_root: Path) -> dict[str, Any] | None:
    """The record a vLLM worker keeps beside its rank store while its guard has that store
    out of service (``connector/deployment/out_of_service.py``), None without one;
    ``{"error": ...}`` when it cannot be read."""
    from spoolctl.connector.deployment import out_of_service

    try:
        return out_of_service.read(store_root)
    except out_of_service.DescriptionError as exc:
        return {"error": str(exc)}


def out_of_service_line(name: str, out: dict[str, Any]) -> Text:
    """One line saying that ``name`` (a store, a rank) is out of service for its engine."""
    from rich.text import Text
    if "error" in out:
        return Text(f"{name}: out-of-service record unreadable: {plain(out['error'])}",
                    style="yellow")
    who = f"pid {out['pid']} on {plain(out['host'])}"
    if out["stale"]:
        return Text(f"{name}: a stale out-of-service record (its engine, {who}, is gone; "
                    f"it said since {render.past_time(out['since'], time.time())}: "
                    f"{plain(out['reason'])}); the next engine start removes it",
                    style="yellow")
    return Text(f"{name}: taken out of service by its engine ({who}) "
                f"{render.past_time(out['since'], time.time())}: {plain(out['reason'])}; "
                "lookups and restores skip it and its writes go to the other drives until "
                "the engine's probe reads it again", style="red")


def models_doc(store: Store) -> dict[str, Any]:
    """``models`` of ``status --json``: each controller model namespace of the store with its
    last use, bytes and lifecycle verdict."""
    from .lifecycle import model_json, model_uses, model_verdicts

    uses = model_uses(store)
    judged = model_verdicts(uses)
    return {name: model_json(uses[name], judged[name]) for name in sorted(uses)}


def _model_lines(models: dict[str, Any]) -> list[Text]:
    """One line per controller model, below the table (wrapped, never cut): what it is, its
    last use and size, and whether a newer generation replaced it."""
    from rich.text import Text
    out, now = [], time.time()
    for name, m in models.items():
        # hour granularity: the lifecycle rules work in days, and the view stays the same
        # from one run to the next (`spoolctl` and `spoolctl status` show one view)
        last = m.get("last_used")
        used = "never" if not last else render.past_time(last, now) \
            if abs(now - last) >= 3600 else "within the last hour"
        line = Text(f"model {plain(name)}: {_model_identity(m)}; last used {used}; "
                    f"{m['entries']} entries, {render.size(m['bytes'])}")
        if m["state"] != "current":
            line.append(f"\n  {m['state']} ({m['reason']}): nothing will read it again; "
                        "`spoolctl clean --superseded --yes` reclaims it", style="yellow")
        out.append(line)
    return out


def _model_identity(m: dict[str, Any]) -> str:
    """What a controller namespace holds (model, framework, weights), each part that its
    entries do not record said to be unknown, and why, never a bare ``?`` or ``None``."""
    model, framework, weights = m.get("model"), m.get("framework"), m.get("weights")
    if not (model or framework or weights):
        return "unknown (its entries record no model, framework or weights)"
    return (f"{plain(str(model)) if model else 'unknown model'} "
            f"({plain(str(framework)) if framework else 'framework unknown'}, weights "
            f"{plain(str(weights)[:24]) if weights else 'not recorded'})")


def status_view(doc: dict[str, Any]) -> Table | list[Any]:
    from rich.table import Table
    from rich.text import Text
    t = Table(title="spoolctl status" + (" (read-only view)" if doc.get("read_only") else ""),
              show_header=False, title_justify="left")
    t.add_column("what", style="bold", no_wrap=True)
    t.add_column("value")
    t.add_row("root", text(doc["root"]))
    usage = f" ({doc['usage_pct']:.1f}% of {render.size(doc['max_bytes'])})" \
        if doc["max_bytes"] else " (unbounded)"  # one word for it, as `init` says
    t.add_row("entries", f"{doc['entries']}  {render.size(doc['bytes'])}{usage}")
    for kind, slot in sorted(doc["by_kind"].items()):
        t.add_row(text(f"  {kind}"), f"{slot['entries']}  {render.size(slot['bytes'])}"
                  f"  ({slot['released']} released)")
    t.add_row("released", f"{doc['released']['entries']} waiting for cleanup  "
              f"{render.size(doc['released']['bytes'])}")
    if (enc := doc.get("encryption")) is not None:
        mk = enc["master_key"]
        key = "no master key configured: encrypted entries are misses" if mk is None else \
            f"master key {mk['key_id']}" + ("" if mk["matches_keyring"] else " (NOT this "
                                           "store's: encrypted entries are misses)")
        by = ", ".join(f"v{v} {n}" for v, n in sorted(enc["entries_by_version"].items()))
        imported = ", ".join(f"{tid}: " + ", ".join(f"v{v}" for v in vs)
                             for tid, vs in sorted(enc.get("imported_keys", {}).items()))
        t.add_row("encryption", f"{key}; {enc['tenants']} tenants; entries by key version: "
                  f"{by or 'none'}; {enc['unreadable_entries']} unreadable"
                  + (f"; imported keys: {imported}" if imported else ""))
    q = doc["quarantined"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(q["by_reason"].items()))
    shown = f"{q['items']} items  {render.size(q['bytes'])}" + (f"  ({reasons})" if reasons else "")
    t.add_row("quarantined", text(shown, "red" if q["items"] else None))
    tmp = doc["tmp"]
    if tmp.get("at_least"):  # a listing bounded on purpose: the disk answered, tmp/ is huge
        t.add_row("temp files", Text(
            f"at least {tmp['files']} (counting stopped there)  {render.size(tmp['bytes'])}+: "
            "abandoned writes fill tmp/; `spoolctl clean --tmp --yes` reclaims them",
            style="yellow"))
    else:
        t.add_row("temp files", f"{tmp['files']}  {render.size(tmp['bytes'])}")
    if doc.get("malformed_rows"):
        t.add_row("malformed rows", Text(f"{doc['malformed_rows']} skipped by clean and status "
                                         "(`spoolctl doctor`)", style="red"))
    if doc["genai"]["entries"]:
        nxt = doc["genai"]["next_expiry_in_s"]
        t.add_row("genai caches", f"{doc['genai']['entries']} ({doc['genai']['expired']} expired"
                  f"{', next expiry ' + render.expiry_text(nxt) if nxt else ''})")
    if doc["genai"].get("malformed"):
        t.add_row("malformed genai", Text(f"{doc['genai']['malformed']} record(s) the GenAI "
                                          "helpers skip (`spoolctl doctor`)", style="red"))
    scrub = doc["scrub"]
    last = scrub["last_cycle"]
    if last:
        t.add_row("last scrub", f"finished {render.past_time(last['finished'])}: "
                  f"{last['checked']} entries / {render.size(last['bytes'])} checked, "
                  f"{last['quarantined']} quarantined, "
                  f"{render.size(last['orphan_bytes'])} orphans reclaimed")
    else:
        t.add_row("last scrub", "never completed")
    cur = scrub["current"]
    if cur:
        t.add_row("scrub progress", f"{100 * cur['progress']:.1f}% (cycle started "
                  f"{render.past_time(cur['started'])}, updated "
                  f"{render.past_time(cur['updated'])})")
    if doc.get("scrub_unreadable"):
        t.add_row("unreadable", Text(f"{doc['scrub_unreadable']} entries the scrub could not "
                                     "read (`spoolctl doctor`)", style="red"))
    owner = doc["owner"]
    t.add_row("owner", text(f"{owner['role']} pid {owner['pid']} on {owner['host']} since "
                            f"{render.past_time(owner['since'])}") if owner else "none")
    if doc["unknown_files"]:
        t.add_row("unknown files", text(", ".join(doc["unknown_files"][:5])))
    models = doc.get("models") or {}
    out = [*_model_lines(models)]
    if (off := doc.get("out_of_service")) is not None:
        out.insert(0, out_of_service_line("this store", off))
    return [t, *out] if out else t


