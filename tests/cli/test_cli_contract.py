"""The CLI's contract with scripts and people (issue 30 item 10, issue 36 items 4, 5, 7).

- With ``--json`` every outcome is one JSON document on stdout, failures included (an error
  document: message, path, fix, exit code), so ``clean --yes --json >> log`` records them.
- Output that cannot be written has its own exit codes (decision 2410): 141 when the reader
  went away, 3 when stdout cannot take the output; never "unexpected ... report it".
- Help and usage errors are exact: no ``<bool>`` after a flag, one placeholder per option
  name, ``-h``, parser errors as ``error: cause: fix``, ``--root`` before the command works.

In-process (``operator_cli.run``) except where only a real process shows the behaviour
(a closed pipe, /dev/full, a closed stdout).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from testpaths import REPO_DIR

from spoolctl.store import Store
from tests.operator_cli import ENV, SPOOLCTL, run

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

ERROR_SCHEMA = "spoolctl-cli/error/v1"


def _one_error_document(out: str, code: int) -> dict:
    doc = json.loads(out)  # exactly one document: json.loads refuses trailing data
    assert doc["schema"] == ERROR_SCHEMA and doc["ok"] is False and doc["exit"] == code, doc
    assert doc["error"]["message"] and doc["error"]["fix"], doc
    return doc


def _filled(root: Path, n: int = 3) -> list[str]:
    with Store.open(str(root), create=True) as store:
        return [store.put(kind="pytorch", namespace="ns", key=f"k{i}",
                          objects={"kv": os.urandom(512)}).entry_id for i in range(n)]


@pytest.mark.parametrize("argv", [
    ("status",), ("ls",), ("scrub",), ("clean", "--tmp", "--yes"),
    ("export", "-o", "{tmp}/out.tar"), ("quarantine", "ls"), ("metrics",),
])
def test_json_failure_on_a_missing_root_is_an_error_document(tmp_path: Path, argv) -> None:
    argv = tuple(a.replace("{tmp}", str(tmp_path)) for a in argv)
    missing = tmp_path / "gone"
    code, out, err = run(*argv, "--root", str(missing), "--json")
    assert code == 2, (code, out, err)
    doc = _one_error_document(out, 2)
    assert doc["error"]["path"] == str(missing) and "does not exist" in doc["error"]["message"]
    assert err.startswith("error: ") and err.count("\n") == 1  # the one line for people stays


def test_json_failures_of_ids_usage_and_archives_are_error_documents(store_root: Path,
                                                                     tmp_path: Path) -> None:
    _filled(store_root)
    code, out, _ = run("inspect", "ffff", "--root", str(store_root), "--json")
    assert _one_error_document(out, code)["error"]["kind"] in ("NotFoundError",
                                                               "InvalidIdError", "ConfigError")
    code, out, _ = run("request-auth", "ffff", "--root", str(store_root), "--json")
    _one_error_document(out, code)
    code, out, _ = run("ls", "--sort", "name", "--root", str(store_root), "--json")
    doc = _one_error_document(out, 2)
    assert doc["error"]["kind"] == "UsageError" and "--sort" in doc["error"]["message"]
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not an archive" * 100)
    code, out, err = run("import", str(junk), "--root", str(store_root), "--json")
    doc = _one_error_document(out, 1)
    assert doc["error"]["kind"] == "ArchiveError" and err.count("\n") == 1, err


def test_json_error_of_export_to_stdout_goes_to_stderr(tmp_path: Path) -> None:
    """With -o - stdout is the archive: the error document goes where the summary goes."""
    code, out, err = run("export", "--root", str(tmp_path / "gone"), "-o", "-", "--json")
    assert code == 2 and out == ""
    _one_error_document(err[err.index("{"):], 2)


def test_success_documents_carry_their_schema_id(store_root: Path) -> None:
    _filled(store_root)
    for argv, schema in ((("status",), "status"), (("ls",), "ls"), (("metrics",), "metrics"),
                         (("quarantine", "ls"), "quarantine-ls"), (("doctor",), "doctor")):
        code, out, err = run(*argv, "--root", str(store_root), "--json")
        assert code in (0, 1), (argv, out, err)
        assert json.loads(out)["schema"] == f"spoolctl-cli/{schema}/v1", argv


def test_metrics_json_has_every_gauge_of_the_exposition(store_root: Path) -> None:
    _filled(store_root, 2)
    code, exposition, _ = run("metrics", "--root", str(store_root))
    assert code == 0
    doc = json.loads(run("metrics", "--root", str(store_root), "--json")[1])
    by_name = {m["name"]: m["value"] for m in doc["metrics"] if not m["labels"]}
    assert by_name["spoolctl_store_entries"] == 2 and by_name["spoolctl_store_up"] == 1
    shown = {line.split("{")[0].split()[0] for line in exposition.splitlines()
             if line and not line.startswith("#")}
    assert shown == {m["name"] for m in doc["metrics"]}


def _process(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([SPOOLCTL, *argv], env=ENV, stderr=subprocess.PIPE, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, **kw)


def test_output_that_cannot_be_written_has_its_own_exit_codes(store_root: Path) -> None:
    """`status | head -0` (closed pipe) exits 141 silently; `ls > /dev/full` and a closed
    stdout exit 3 with one line naming stdout, never an "unexpected ... report it"."""
    _filled(store_root)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes anything
    try:
        proc = _process(["status", "--root", str(store_root)], stdout=write)
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr
    if os.path.exists("/dev/full"):
        with open("/dev/full", "w") as full:
            proc = _process(["ls", "--root", str(store_root), "--json"], stdout=full)
        assert proc.returncode == 3, proc.stderr
        assert proc.stderr.count("\n") == 1 and "cannot write the output to stdout" in \
            proc.stderr and "unexpected" not in proc.stderr, proc.stderr
    proc = subprocess.run(["/bin/sh", "-c", 'exec "$0" "$@" >&-', SPOOLCTL, "export",
                           "--root", str(store_root), "-o", "-"],
                          env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and "stdout is closed" in proc.stderr, proc.stderr
    assert "unexpected" not in proc.stderr and proc.stderr.count("\n") == 1


# -- help and usage errors (issue 36 item 7) ----------------------------------------------


def _options() -> dict[str, set[str]]:
    """Every option of every command with the placeholders --help shows for it."""
    from typer._click import Context

    from spoolctl.cli.app import build_command

    found: dict[str, set[str]] = {}

    def walk(cmd, parent) -> None:
        ctx = Context(cmd, info_name=cmd.name, parent=parent, **(cmd.context_settings or {}))
        for param in cmd.get_params(ctx):
            if param.param_type_name == "option" and not param.hidden:
                # what typer's rich help prints beside the option (a flag shows none):
                # make_metavar up to typer 0.28, display_type_rich from 0.29
                shown = "" if param.is_flag else (_placeholder(param, ctx) or "")
                choices = "|" in shown and shown.startswith("<") and "file" not in shown
                name = max(param.opts, key=len)
                found.setdefault(name, set()).add("<choice>" if choices else shown)
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub, ctx)

    walk(build_command(), None)
    return found


def _placeholder(param, ctx) -> str | None:
    show = getattr(param, "display_type_rich", None)
    return show(ctx) if show is not None else param.make_metavar(ctx=ctx)


def test_help_placeholders_are_exact_and_one_per_option() -> None:
    options = _options()
    flags = [o for o, shown in options.items() if shown == {""}]
    assert {"--json", "--yes", "--dry-run", "--help"} <= set(flags)
    for option, shown in options.items():
        assert "<bool>" not in shown and "<str>" not in shown, (option, shown)
        if option != "--rate":  # scrub's bytes/s and prefill's requests/s: not one thing
            assert len(shown) == 1, (option, shown)  # the same thing: one name everywhere
    code, out, _ = run("ls", "--help")
    assert code == 0 and "<bool>" not in out and "-h" in out
    assert run("quarantine", "ls", "-h")[1] == run("quarantine", "ls", "--help")[1]


@pytest.mark.parametrize(("argv", "cause", "fix"), [
    (("ls", "--sort", "name"), "invalid value for --sort: 'name' is not one of size, age, "
     "access", "use one of size, age, access"),
    (("ls", "--limit", "0"), "invalid value for --limit: must be at least 1",
     "see `spoolctl ls --help`"),
    (("ls", "--limit", "many"), "invalid value for --limit: must be a whole number",
     "see `spoolctl ls --help`"),
    (("ls", "--jsn"), "no such option for `spoolctl ls`: --jsn", "did you mean --json?"),
    (("scrub", "--rate", "fast"), "invalid rate 'fast'", "e.g. 64MiB/s"),
])
def test_parser_errors_are_the_tools_one_line(store_root: Path, argv, cause, fix) -> None:
    code, out, err = run(*argv, "--root", str(store_root))
    assert code == 2 and out == "", (out, err)
    assert err.startswith(f"error: {cause}") and fix in err and err.count("\n") == 1, err
    assert "Value error" not in err and "Input should" not in err


def test_root_before_the_command_is_accepted(store_root: Path) -> None:
    """kubectl/restic habit: `spoolctl --root X status` is `spoolctl status --root X`."""
    _filled(store_root, 2)
    code, out, err = run("--root", str(store_root), "--json", "status")
    assert code == 0 and json.loads(out)["entries"] == 2, (out, err)
    code, out, err = run(f"--root={store_root}", "ls", "--json")
    assert code == 0 and len(json.loads(out)["entries"]) == 2, err
    code, out, err = run("--root", str(store_root), "--json")  # no command: status
    assert code == 0 and json.loads(out)["schema"] == "spoolctl-cli/status/v1", err


def test_import_of_empty_stdin_says_one_thing(store_root: Path, monkeypatch) -> None:
    _filled(store_root, 1)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(b""))))
    code, out, err = run("import", "-", "--root", str(store_root))
    assert code == 1 and out == "", out
    assert err.count("\n") == 1 and "the archive is empty: stdin had no bytes" in err, err


# -- the JSON contract (issue 36 item 5) ---------------------------------------------------


def test_every_documented_document_matches_the_real_output(tmp_path: Path) -> None:
    """Each command's real --json document has the documented schema id and exactly the
    documented top-level keys (docs/json.md, from spoolctl/cli/json_contract.py)."""
    from spoolctl.cli.json_contract import by_command

    docs = by_command()
    root = tmp_path / "store"
    ids = _filled(root)
    items = _quarantined(root, 2)
    archive = tmp_path / "a.tar"
    runs = {
        "init": ("init", "--max-size", "1GiB"), "status": ("status",), "ls": ("ls",),
        "inspect": ("inspect", ids[0]), "scrub": ("scrub",),
        "request-auth": ("request-auth", ids[0][:12]), "clean": ("clean", "--tmp", "--yes"),
        "doctor": ("doctor",), "metrics": ("metrics",), "quarantine-ls": ("quarantine", "ls"),
        "quarantine-show": ("quarantine", "show", items[0]),
        "quarantine-purge": ("quarantine", "purge", items[1], "--yes"),
        "export": ("export", "-o", str(archive)), "error": ("inspect", "0" * 64),
    }
    keys = {"keys-ls": ("keys", "ls"), "keys-rotate": ("keys", "rotate"),
            "keys-retire": ("keys", "retire", "--yes"),
            "keys-revoke": ("keys", "revoke", "--tenant-env", "SPOOLCTL_TENANT", "--yes")}
    assert set(runs) | set(keys) | {"import"} == set(docs)  # every document is checked
    try:
        import cryptography  # noqa: F401  (the crypto extra: a base install has no keys)
    except ImportError:
        keys = {}
    sealed_root = tmp_path / "sealed"  # the keys documents, on an encrypted store
    sealed_env = {"SPOOLCTL_MASTER_KEY": "ab" * 32, "SPOOLCTL_TENANT": "t",
                  # a revoke records erased keys outside the store
                  "SPOOLCTL_KEY_LEDGER": str(tmp_path / "erased-keys.json")}
    if keys:
        from spoolctl.store.sealing import MasterKey
        with Store.open(sealed_root, create=True,
                        master_key=MasterKey.from_hex("ab" * 32, "test")) as sealed:
            sealed.put(kind="pytorch", namespace="m", key="k", objects={"kv": b"x"},
                       tenant="t")
    for name, argv in [*runs.items(), *keys.items()]:
        where, env = (sealed_root, sealed_env) if name in keys else (root, None)
        code, out, err = run(*argv, "--root", str(where), "--json", env=env)
        real = json.loads(out)
        assert real["schema"] == f"spoolctl-cli/{name}/v1", (name, real["schema"])
        documented, optional = set(docs[name].keys), set(docs[name].optional)
        assert documented <= set(real) <= documented | optional, \
            (name, set(real) ^ documented)
        for key, row_keys in docs[name].rows.items():
            assert all(set(r) == set(row_keys) for r in real[key]), (name, key)
    code, out, err = run("import", str(archive), "--root", str(tmp_path / "b"), "--json")
    real = json.loads(out)
    assert code == 0 and real["imported"] == 3 and set(real) == set(docs["import"].keys), err


def test_json_reference_is_generated_from_the_contract() -> None:
    from spoolctl.cli.json_contract import render_markdown

    committed = (REPO_DIR / "docs" / "json.md").read_text()
    assert committed == render_markdown(), "run `python scripts/gen_cli_docs.py`"


def test_renamed_keys_keep_their_alias_one_release(store_root: Path) -> None:
    """`ls` rows and `inspect` say `bytes` like `status`; `size` stays as a deprecated alias."""
    (entry,) = _filled(store_root, 1)
    row = json.loads(run("ls", "--root", str(store_root), "--json")[1])["entries"][0]
    info = json.loads(run("inspect", entry, "--root", str(store_root), "--json")[1])
    assert row["bytes"] == row["size"] == info["bytes"] == info["size"] > 512


# -- output that survives pipes and narrow terminals (issue 36 item 4) -----------------------


def _quarantined(root: Path, n: int) -> list[str]:
    """``n`` entries with bit rot in their object, read once so each is quarantined."""
    from spoolctl.store import SpoolError

    with Store.open(str(root), create=True) as store:
        for i in range(n):
            m = store.put(kind="pytorch", namespace="ns", key=f"bad{i}",
                          objects={"kv": os.urandom(256)})
            store.layout.object_path(m.object("kv").digest).write_bytes(b"\0" * 256)
            with pytest.raises(SpoolError):
                store.read(m, "kv")
        return [i.item_id for i in store.quarantine_items()]


def test_piped_listings_at_80_columns_hold_every_id_whole(store_root: Path) -> None:
    """`ls | ...` and `quarantine ls | ...` on an 80-column pipe: plain columns, every entry
    id, namespace and item id whole on its line (the table cut them: `195.7 K…`, `creat…`)."""
    namespace = "org/a-rather-long-model-namespace-for-a-narrow-terminal-v2"
    with Store.open(str(store_root), create=True) as store:
        ids = [store.put(kind="pytorch", namespace=namespace, key=f"k{i}",
                         objects={"kv": os.urandom(200_000)}).entry_id for i in range(3)]
    items = _quarantined(store_root, 2)
    from tests.operator_cli import script

    listed = script("ls", "--root", str(store_root), env={"COLUMNS": "80"})
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["ID", "KIND", "NAMESPACE", "SIZE", "HINT", "CREATED",
                                "LAST_ACCESS", "EXPIRES"]
    for entry_id in ids:
        (line,) = [ln for ln in lines if ln.startswith(entry_id)]
        assert namespace in line and "KiB" in line and "…" not in line, line
    quarantine = script("quarantine", "ls", "--root", str(store_root), env={"COLUMNS": "80"})
    for item in items:
        assert any(ln.startswith(item + " ") for ln in quarantine.stdout.splitlines()), \
            quarantine.stdout


def test_quarantine_commands_accept_a_unique_prefix(store_root: Path) -> None:
    items = sorted(_quarantined(store_root, 2))
    shared = next(i for i, (a, b) in enumerate(zip(*items, strict=True)) if a != b)
    common, unique = items[0][:shared], items[0][:shared + 1]  # unique: one char further
    code, out, err = run("quarantine", "show", unique, "--root", str(store_root), "--json")
    assert code == 0 and json.loads(out)["item"] == items[0], err
    code, out, err = run("quarantine", "show", common, "--root", str(store_root))
    assert code == 2 and "matches 2 items" in err and err.count("\n") == 1, err
    code, out, err = run("quarantine", "purge", unique, "--yes", "--root", str(store_root))
    assert code == 0 and "purged 1 item," in out, (out, err)
    left = json.loads(run("quarantine", "ls", "--root", str(store_root), "--json")[1])
    assert [i["item"] for i in left["items"]] == items[1:]


# -- one name per option meaning (issue 36 item 7) ------------------------------------------


def test_selection_limit_is_limit_size_and_max_size_stays_a_deprecated_alias(
        store_root: Path, tmp_path: Path) -> None:
    """init's --max-size is the capacity; export/import's selection limit is --limit-size.
    The old --max-size of export/import still works for one release, with a warning."""
    _filled(store_root, 3)
    for option, warned in (("--limit-size", False), ("--max-size", True)):
        out = tmp_path / f"{option[2:]}.tar"
        code, stdout, err = run("export", "--root", str(store_root), "-o", str(out),
                                option, "1000", "--json")
        assert code == 0 and json.loads(stdout)["entries"] == 1, err
        assert ("--max-size is deprecated: use --limit-size" in err) is warned, err
    code, _, err = run("export", "--root", str(store_root), "-o", str(tmp_path / "x.tar"),
                       "--max-size", "1", "--limit-size", "1")
    assert code == 2 and "pass only --limit-size" in err
    for command in ("export", "import"):
        help_text = run(command, "--help")[1]
        assert "--limit-size" in help_text and "--max-size" not in help_text, command


def test_prompt_list_is_the_name_and_prompts_file_a_deprecated_alias() -> None:
    help_text = run("prefill", "--help")[1]
    assert "--prompt-list" in help_text and "--prompts-file" not in help_text
    code, _, err = run("prefill", "--prompts-file", "p.jsonl", "--model", "m")
    assert code == 2 and "--prompts-file is deprecated: use --prompt-list" in err
    assert "--prompt-list needs --server" in err


def test_one_vocabulary_for_counts_units_and_unbounded(store_root: Path) -> None:
    from spoolctl.cli import render
    from spoolctl.store import format_size

    assert format_size(1048575) == "1.0 MiB" and format_size((1 << 30) - 1) == "1.0 GiB"
    assert [render.count(n, "quarantined item") for n in (0, 1, 2)] == [
        "0 quarantined items", "1 quarantined item", "2 quarantined items"]
    assert render.count(1, "entry") == "1 entry" and render.count(3, "entry") == "3 entries"
    _filled(store_root, 1)  # created without a max size
    code, out, _ = run("status", "--root", str(store_root))
    assert code == 0 and "unbounded" in out and "no max size" not in out
