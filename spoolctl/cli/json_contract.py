"""The ``--json`` contract: what each command's document holds, as data.

docs/json.md is generated from this table (``scripts/gen_cli_docs.py``, with the CLI
reference) and tests/test_cli_contract.py runs the commands and checks each real document
against it: its ``schema`` id, and that its top-level keys are exactly the documented ones.
A new key, a renamed one or a removed one fails CI until it is written down here.

Rules: every document has ``schema`` = ``spoolctl-cli/<command>/v1``; one
name per concept across commands (``bytes`` for a size in bytes, ``entries`` for a count of
entries, ``exit`` for the command's exit code where the document carries it); a renamed key
stays one release as a deprecated alias (``DEPRECATED``), then goes; a change that breaks a
reader bumps ``/v1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Document:
    """One command's document: what it is, its top-level keys (name -> meaning)."""

    command: str
    summary: str
    keys: dict[str, str]
    rows: dict[str, dict[str, str]] = field(default_factory=dict)  # list key -> row keys
    # Keys present only when the case arises (a rule given, a kind of store): name -> when.
    optional: dict[str, str] = field(default_factory=dict)


SCHEMA = "schema id: spoolctl-cli/<command>/v1"

# Keys kept one release for scripts written against them: alias -> (key, where).
DEPRECATED: dict[str, tuple[str, str]] = {
    "size": ("bytes", "`ls` rows and `inspect` (the entry's bytes; `status` always said "
             "`bytes`)"),
}

ERROR = Document("error", "Any command that fails, with --json: the one document on stdout "
                 "(stderr with `export -o -`, whose stdout is the archive).", {
                     "schema": SCHEMA,
                     "ok": "always false",
                     "exit": "the exit code (1 findings, 2 usage or configuration)",
                     "error": "`kind` (the error class, `UsageError` for a bad command line), "
                              "`message`, `path` (or null) and `fix` (or null)",
                 }, optional={"disk_down": "true when the store's disk did not answer within "
                                           "SPOOLCTL_DISK_TIMEOUT (`DiskNotAnsweringError`: "
                                           "a hung mount; the store is down)"})

MULTI = Document("(any, on a vLLM root)", "A command run on a vLLM base root or deployment "
                 "directory: one document for every rank store.", {
                     "schema": SCHEMA,
                     "root": "the --root given",
                     "kind": "`deployment`, `base` or `empty` (a base root before the first engine "
                             "start: no stores)",
                     "stores": "per store: `root`, `deployment`, `rank`, and `result` (the "
                               "single-store document) or `error` (with `disk_down`: true "
                               "when its disk did not answer in time: the store is down)",
                     "exit": "the worst exit code of the stores",
                 })

DRIVES = Document("(status, clean, scrub, export, on several roots)", "A command given several "
                  "drive roots (repeated --root, or SPOOLCTL_ROOT with ':'): "
                  "one document for every drive.", {
                      "schema": SCHEMA,
                      "roots": "the roots given, in order",
                      "drives": "per drive: `root`, `exit`, and `result` (the document the "
                                "command prints for that root alone) or `error` (with "
                                "`disk_down`: true when its disk did not answer in time); "
                                "status: `out_of_service`, the rank stores on it a running "
                                "engine has out of service (absent when none)",
                      "totals": "`drives`, `drives_down` (missing, unreadable or hung), and "
                                "the command's numbers summed over every store that answered "
                                "(status: `stores`, `entries`, `bytes`; export: "
                                "`archives`, `stores`, `entries`, `objects`, `bytes`)",
                      "exit": "the worst exit code of the drives",
                  })

DOCUMENTS: tuple[Document, ...] = (
    Document("init", "The store created or updated.", {
        "schema": SCHEMA, "root": "store root", "store_id": "the store's id",
        "created": "true if this run created it", "max_bytes": "max size (null: unbounded)",
        "previous_max_bytes": "max size before this run", "bytes": "bytes stored",
        "over_max": "true if bytes exceed the new max size",
        "changed": "true if this run created the store or changed its max size",
        "default_max_bytes": "the default max size given to a new store without --max-size "
                             "(null when --max-size was given or the store existed)"}),
    Document("status", "The store's facts.", {
        "schema": SCHEMA, "root": "store root", "store_id": "the store's id",
        "entries": "entries", "bytes": "bytes of entries", "objects": "objects",
        "by_kind": "per kind: `entries`, `bytes`", "max_bytes": "max size (null: unbounded)",
        "usage_pct": "bytes / max_bytes in percent (null: unbounded)",
        "released": "`entries`, `bytes` waiting for `clean --released`",
        "quarantined": "`items`, `bytes`, `by_reason`",
        "tmp": "temp files: `files`, `bytes`, `at_least` (true: the count stopped at 10,000; "
               "`spoolctl clean --tmp` reclaims them)",
        "orphans": "orphans reclaimed by the last scrub", "scrub": "last and current cycle",
        "scrub_unreadable": "files the last scrub could not read",
        "unknown_files": "files the store does not know", "owner": "the owner lease holder",
        "read_only": "true if opened read-only", "malformed_rows": "catalog rows skipped",
        "genai": "GenAI records: `entries`, `expired`, `malformed`, `next_expiry_in_s`",
        "filesystem": "the store's filesystem: free bytes, inodes and free inodes",
        "models": "per PyTorch/MLX model namespace: model, weights, last use, entries, bytes, "
                  "verdict (`current`, `unused`, `superseded`)"},
        optional={"encryption": "an encrypted store: `master_key` (`key_id`, "
                                "`matches_keyring`; null: none configured), `tenants`, "
                                "`entries_by_version`, `unreadable_entries`, `imported_keys` "
                                "(per tenant id, the live key versions an import brought)",
                  "out_of_service": "a vLLM rank store its engine's worker took out of "
                                    "service (its disk stopped answering): `since`, "
                                    "`reason`, `pid`, `host`, `started`, and `stale` (true: "
                                    "that process is gone, by the lock it held; null: "
                                    "cannot tell, a record of an older writer from another "
                                    "host), "
                                    "or `error`; absent while the store is in service"}),
    Document("ls", "Entries, newest access first by default.", {
        "schema": SCHEMA, "entries": "the entries (rows)", "count": "number of rows",
        "being_deleted": "entries an interrupted clean is deleting (not listed; the next "
                         "clean finishes them)"},
        rows={"entries": {
            "entry_id": "full 64-hex id", "kind": "vllm, pytorch, mlx or genai",
            "namespace": "model namespace", "bytes": "payload bytes",
            "size": "deprecated alias of `bytes`", "hint": "retain or release",
            "state": "catalog state", "created": "Unix time", "last_access": "Unix time",
            "supersedes": "entry id this one extends (or null)"}}),
    Document("inspect", "One entry: manifest, catalog row, objects.", {
        "schema": SCHEMA, "entry_id": "full id", "kind": "kind", "namespace": "namespace",
        "key": "the entry's key", "created": "Unix time", "supersedes": "entry id or null",
        "hint": "retain or release", "last_access": "Unix time", "bytes": "payload bytes",
        "size": "deprecated alias of `bytes`",
        "objects": "`name`, `digest`, `size` (the manifest's field), `present`",
        "meta": "the manifest's meta", "index": "the manifest's index"}),
    Document("scrub", "One scrub step (or a whole cycle with --until-complete).", {
        "schema": SCHEMA, "cycle_id": "scrub cycle", "resumed": "true if it continued a cycle",
        "cycle_completed": "true if this run finished the cycle",
        "checked": "entries checked (the human view's `checked`)", "bytes": "bytes checked",
        "proves": "`integrity` (digests) or `origin` (tags, with a tag key)",
        "quarantined": "entries quarantined by this run", "absent": "entries gone meanwhile",
        "unreadable": "files that could not be read", "orphans": "orphans reclaimed",
        "tmp": "temp files reclaimed", "seconds": "run time"}),
    Document("request-auth", "One entry checked now.", {
        "schema": SCHEMA, "entry_id": "full id", "result": "authenticated, verified, "
        "absent, quarantined or queued", "proves": "integrity or origin",
        "reason": "quarantine reason (or null)", "detail": "one line",
        "request_id": "queue id (or null)", "via": "how it was checked"}),
    Document("clean", "What was (or, with --dry-run, would be) deleted, per step.", {
        "schema": SCHEMA, "dry_run": "true for a plan", "steps": "per step: counts, bytes",
        "total": "totals over the steps", "errors": "per-file errors", "failed": "true if "
        "a step failed", "genai": "GenAI records cleaned", "malformed_rows": "rows skipped"},
        optional={"deployment_lifecycle": "with --superseded/--unused-for on a vLLM root: "
                                          "the deployment reclaimed and why",
                  "model_lifecycle": "with --superseded/--unused-for on one store: the "
                                     "controller models released and why"}),
    Document("doctor", "Checks of the root, filesystem, files and permissions.", {
        "schema": SCHEMA, "root": "store root", "ok": "true if every check passed",
        "checks": "per check: `name`, `status`, `detail`, `fix`"}),
    Document("metrics", "The store gauges, as `spoolctl metrics` exposes them.", {
        "schema": SCHEMA, "exit": "exit code", "textfile": "the .prom file written (or null)",
        "metrics": "per sample: `name` (spoolctl_...), `type`, `labels`, `value`"}),
    Document("quarantine-ls", "Quarantined items.", {
        "schema": SCHEMA, "items": "per item: `item`, `reason`, `entry_id`, `bytes`, ...",
        "count": "items", "bytes": "bytes in quarantine"}),
    Document("quarantine-show", "One quarantined item.", {
        "schema": SCHEMA, "item": "item id", "reason": "quarantine reason",
        "detail": "one line", "time": "Unix time it was quarantined",
        "entry_id": "the entry (or null)", "kind": "entry kind (or null)",
        "files": "files kept as evidence", "bytes": "bytes kept", "path": "item directory",
        "contents": "file names in it"}),
    Document("quarantine-purge", "Items deleted (or, with --dry-run, that would be).", {
        "schema": SCHEMA, "dry_run": "true for a plan", "purged": "item ids",
        "count": "items", "bytes": "bytes freed",
        "skipped": "items left partly in place (a planted directory tree too deep to walk): "
                   "`item`, `path`, `kept` (up to 10 of the deepest kept directories), "
                   "`reason`, `fix`; exit 1 when any"}),
    Document("export", "The archive written (to stderr with -o -).", {
        "schema": SCHEMA, "root": "source root",
        "kind": "store, deployment, base or empty (`places.inspect_root`)",
        "output": "file or -", "entries": "entries exported", "objects": "objects exported",
        "bytes": "payload bytes", "archive_bytes": "archive bytes", "seconds": "run time",
        "bytes_per_second": "rate", "left_out": "entries not taken (and why)",
        "stores": "per source store", "exit": "exit code"},
        optional={"signature": "with --sign-key: the `.sig` file written next to the archive, "
                               "or `-` for a stream signed by its trailer"}),
    Document("keys-ls", "The encryption facts of a store: ids and counts, never "
             "key material.", {
                 "schema": SCHEMA,
                 "encrypted": "true if a master key is configured or encrypted entries exist",
                 "master_key": "`key_id` (an HKDF-derived id, not the key) and `matches_keyring` "
                               "(false: another master key, every encrypted entry a miss); null "
                               "when none is configured",
                 "keyring": "path of state/keyring.json (null without a master key)",
                 "tenants": "per tenant id (opaque; never the name): `tenant_id`, `current` "
                            "version (or null), `revoked`, `versions`",
                 "unreadable_entries": "entries under revoked, retired or unknown keys"},
             rows={"tenants": {"tenant_id": "16-hex opaque id", "current": "current version "
                               "(null: none live)", "revoked": "true once `keys revoke` erased "
                               "it (no import brings its keys back)",
                               "versions": "per version: `version` (a random 63-bit id, "
                               "a decimal string when beyond 2^53 - 1; small "
                               "counters in stores from before, numbers), `key` "
                               "(`live` or `unavailable`), `origin` (`here` or `imported`), "
                               "`entries`, `bytes`"}}),
    *(Document(f"keys-{action}", what, {
        "schema": SCHEMA, "action": f"`{action}`",
        "dry_run": "true for a plan (nothing changed)",
        "tenants": "per tenant id: `tenant_id`, `versions` (the versions " + verb + ")",
        "released_entries": "entries released by this run (`clean --released` reclaims them; "
                            "0 for rotate)",
        "released_bytes": "their bytes"},
        rows={"tenants": {"tenant_id": "16-hex opaque id", "versions": "key versions " + verb}})
      for action, what, verb in (
          ("rotate", "The new key version of each tenant.", "started"),
          ("revoke", "A tenant crypto-erased: every key version deleted, its entries released.",
           "erased"),
          ("retire", "Key versions older than the current one erased, their entries released.",
           "erased"))),
    Document("import", "What was imported.", {
        "schema": SCHEMA, "source": "archive, - or peer root", "target": "--root",
        "kind": "store, deployment, base or empty (a path not there yet, too)",
        "imported": "entries committed",
        "present": "entries already there", "filtered": "entries not selected",
        "skipped_capacity": "entries over the max size", "skipped_corrupt": "entries that "
        "failed verification", "skipped_unauthenticated": "entries without a valid tag",
        "skipped_key": "encrypted entries whose data key this host cannot use (a tenant "
        "revoked here, or a key the archive did not carry)",
        "skipped_vanished": "peer entries gone meanwhile", "objects_written": "objects",
        "objects_present": "objects already there", "bytes_written": "bytes",
        "source_bytes": "bytes read", "seconds": "run time", "bytes_per_second": "rate",
        "complete": "true if the archive ended properly", "error": "why not (or null)",
        "stores": "per target store",
        "released": "entries that arrived released, as the source had them"}),
)


def by_command() -> dict[str, Document]:
    return {d.command: d for d in (*DOCUMENTS, ERROR)}


def render_markdown() -> str:
    """docs/json.md (pure)."""
    out = ["# JSON output", "",
           "<!-- Generated by scripts/gen_cli_docs.py from spoolctl/cli/json_contract.py. "
           "Do not edit by hand. -->", "",
           "With `--json` every command prints exactly one JSON document on stdout, whatever "
           "the outcome: its result, or an error document when it fails (exit code in both). "
           "Each document names its schema in `schema` (`spoolctl-cli/<command>/v1`; a "
           "change that breaks a reader bumps the version). CI runs the commands and checks "
           "every document below against its real output.", "",
           "Layout: one document per line when stdout is not a terminal (a log gets one "
           "line per run), indented on a terminal or with `--pretty`. Numbers: an integer "
           "beyond 2^53 - 1 in absolute value (a random 63-bit key version) is printed as "
           "its decimal string, since jq and JavaScript read JSON numbers as doubles and "
           "would round it; smaller integers stay numbers.", "",
           "One name per concept: `bytes` is a size in bytes, `entries` a count of entries "
           "(or the list of them), `exit` the exit code. Renamed keys stay one release as "
           "deprecated aliases:", ""]
    out_tail = ["", "`prefill`, `demo` and `quarantine restore` documents carry their schema "
                "id too but are not yet under the contract check; `config vllm` prints vLLM's "
                "`kv_transfer_config`, not a spoolctl document."]
    out += [f"- `{alias}`: use `{key}` ({where})." for alias, (key, where) in
            sorted(DEPRECATED.items())]
    out += out_tail
    out.append("")
    for doc in (ERROR, MULTI, DRIVES, *DOCUMENTS):
        name = doc.command if doc.command.startswith("(") else f"`{doc.command}`"
        schema = f"spoolctl-cli/{doc.command}/v1" if not doc.command.startswith("(") \
            else "the command's own"
        out += [f"## {name}", "", f"{doc.summary} Schema: `{schema}`.", "",
                "| key | meaning |", "|---|---|"]
        out += [f"| `{k}` | {v.replace('|', '/')} |" for k, v in doc.keys.items()
                if k != "schema"]
        out += [f"| `{k}` (only {v.replace('|', '/')}) | |" for k, v in doc.optional.items()]
        out.append("")
        for key, row in doc.rows.items():
            out += [f"Each of `{key}`:", "", "| key | meaning |", "|---|---|"]
            out += [f"| `{k}` | {v} |" for k, v in row.items()]
            out.append("")
    return "\n".join(out).rstrip() + "\n"
