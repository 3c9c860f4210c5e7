"""Issue 15.6: text from the store or a client is data, never markup, in every human output.

Keys, namespaces, meta, display names, quarantine details, paths and file names carry rich
markup (``[link=...]``, ``[red]``) and raw terminal sequences (OSC 8 hyperlinks, clear
screen, the C1 CSI byte, a bidi override). Every human command runs as a real process on a
colour terminal (``FORCE_COLOR``): the markup must show literally, and no sequence from
the data may reach the terminal. JSON output keeps the data unchanged."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI
from operator_cli import ENV, script

from spoolctl.store import Store, entry_id_for
from spoolctl.store.maintain.quarantine import REASON_FILE

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

LINK = "[link=https://evil.example]x[/link]"
KEY = f"{LINK}[red]hidden[/red]"
NS = "[red]ns[/red][link=https://evil.example]n[/link]"
OSC8 = "\x1b]8;;https://evil.example\x07click\x1b]8;;\x07"
RAW = f"{OSC8}\x1b[2J\x9b2J\u202eevil"
TERMINAL = {**ENV, "FORCE_COLOR": "1", "TERM": "xterm-256color", "COLUMNS": "250"}
# What the data may never do on the terminal: a hyperlink, clearing it, a C1 CSI, a bidi
# override. rich's own styling (SGR "\x1b[...m") is allowed.
FORBIDDEN = ("\x1b]8;", "\x1b[2J", "\x9b", "\u202e", "\x07")


@pytest.fixture
def hostile(tmp_path: Path) -> tuple[Path, str]:
    root = Path(os.path.realpath(tmp_path)) / "[red]store[bold]"  # no "/" in a name
    with Store.open(root, create=True) as store:
        m = store.put(kind="pytorch", namespace=NS, key=KEY, objects={"kv": b"x" * 100},
                      meta={"note": RAW, LINK: RAW, "list": [RAW, NS]})
        store.put(kind="genai", namespace="gemini-" + "0" * 24, key=f"c/{LINK}", objects={},
                  meta={"name": "cachedContents/x", "display_name": RAW},
                  index={"name": f"cachedContents/{LINK}", "display_name": RAW,
                         "expire_time": 4e9})
        bad = store.put(kind="pytorch", namespace=NS, key=KEY + "2",
                        objects={"kv": b"y" * 100})
        obj = store.layout.object_path(bad.objects[0].digest)
        obj.write_bytes(b"z" * 100)  # corrupt: quarantined by the scrub below
    # a file that does not belong, named badly
    (root / "unknown-[red]x\x1b]8;;evil\x07\x1b[2J\u202e").write_text("?")
    return root, m.entry_id


def _check(proc, what: str) -> str:
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, (what, out)
    for seq in FORBIDDEN:
        assert seq not in out, (what, repr(seq), out)
    return out


def test_every_human_output_shows_store_text_as_data(hostile) -> None:
    root, entry_id = hostile
    r = str(root)
    scrub = script("scrub", "--root", r, env=TERMINAL)
    _check(scrub, "scrub")
    item = json.loads(script("quarantine", "ls", "--root", r, "--json").stdout)["items"][0]
    reason = Path(item["path"]) / REASON_FILE
    doc = json.loads(reason.read_text())
    reason.write_text(json.dumps({**doc, "detail": f"{LINK} {RAW}"}))  # tampered evidence
    commands = [["status"], ["ls"], ["inspect", entry_id], ["quarantine", "ls"],
                ["quarantine", "show", item["item"]], ["doctor"], ["request-auth", entry_id],
                ["clean", "--dry-run"], ["init"]]
    for args in commands:
        out = _check(script(*args, "--root", r, env=TERMINAL), args[0])
        plain = re.sub(r"\x1b\[[0-9;]*m", "", out)  # rich's own colours removed
        if args[0] in ("ls", "inspect"):
            assert "[red]ns[/red]" in plain, (args, plain)  # markup shown, not applied
        if args[0] == "inspect":
            assert "[red]hidden[/red]" in plain and "[link=https://evil.example]" in plain
            assert "\\u001b]8;;https://evil.example" in plain  # meta, escaped
        if args == ["quarantine", "show", item["item"]]:
            assert LINK in plain and "\\x1b]8;;https://evil.example" in plain
        if args[0] in ("status", "init", "doctor"):
            assert "[red]store[bold]" in plain, (args, plain)


def test_json_output_keeps_the_data_unchanged(hostile) -> None:
    root, entry_id = hostile
    doc = json.loads(script("inspect", entry_id, "--root", str(root), "--json").stdout)
    assert doc["key"] == KEY and doc["namespace"] == NS and doc["meta"]["note"] == RAW
    assert entry_id == entry_id_for("pytorch", NS, KEY)


def test_a_base_root_with_a_hostile_deployment_name(tmp_path: Path) -> None:
    base = Path(os.path.realpath(tmp_path)) / "spool"
    dep = base / "[link=evil.example]x[red]dep\x1b[2J\u202e"
    with Store.open(dep / "rank-0000", create=True) as store:
        store.put(kind="vllm", namespace=NS, key=KEY, objects={"kv": b"x"})
    for args in (["status"], ["ls"], ["clean", "--yes"], ["metrics"]):
        proc = script(*args, "--root", str(base), env=TERMINAL)
        out = _check(proc, args[0])
        if args[0] == "metrics":  # not a valid label value: left out, said on stderr
            assert proc.returncode == 2 and "cannot be a metric label" in out
        else:
            assert proc.returncode == 0 and "[link=evil.example]x[red]dep" in out, out


# -- commands added after issue 15: export, import, prefill --server, status with a host budget


def _hostile_dir(tmp_path: Path, name: str) -> Path:
    """A directory whose own name is hostile (markup, OSC 8, clear screen, bidi)."""
    return Path(os.path.realpath(tmp_path)) / f"{name}[link=https:evil.example]x[red]\x1b[2J\u202e"


def test_export_and_import_show_paths_and_names_as_data(hostile, tmp_path: Path) -> None:
    root, _entry = hostile
    archive = _hostile_dir(tmp_path, "a") / f"{LINK.replace('/', '')}.tar"
    archive.parent.mkdir()
    exported = script("export", "--root", str(root), "-o", str(archive), env=TERMINAL)
    out = _check(exported, "export")
    assert exported.returncode == 0 and "[link=https:evil.example]x[red]" in out, out
    target = _hostile_dir(tmp_path, "b")
    imported = script("import", "--root", str(target), str(archive), env=TERMINAL)
    out = _check(imported, "import")
    assert imported.returncode == 0 and "[link=https:evil.example]x[red]" in out, out
    # a peer root as the source, and a failing import whose error names the hostile path
    peer = script("import", "--root", str(_hostile_dir(tmp_path, "c")), str(root),
                  env=TERMINAL)
    assert peer.returncode == 0, _check(peer, "import <peer root>")
    missing = script("import", "--root", str(target), str(archive) + "\x1b]8;;x\x07",
                     env=TERMINAL)
    assert missing.returncode == 2 and "\\x1b]8;;x\\x07" in _check(missing, "import missing")


def test_export_of_a_base_root_with_a_hostile_deployment_name(tmp_path: Path) -> None:
    base = Path(os.path.realpath(tmp_path)) / "spool"
    good = "vllm-v1-" + "1" * 48
    for dep in (good, "[link=evil.example]x[red]dep\x1b[2J\u202e"):
        with Store.open(base / dep / "rank-0000", create=True) as store:
            store.put(kind="vllm", namespace="vllm-v1-ns", key=KEY, objects={"kv": b"x"})
    proc = script("export", "--root", str(base), "-o", str(tmp_path / "x.tar"), env=TERMINAL)
    out = _check(proc, "export")
    # the good deployment is exported, the other is that store's error, shown literally
    assert proc.returncode == 2 and "[link=evil.example]x[red]dep" in out, out
    assert "cannot be carried in an archive" in out


def _fake_server(reply: dict, models: tuple[str, ...]) -> FakeOpenAI:
    """A fake OpenAI-style server answering ``reply[prompt]`` (status, document) --
    hostile text included -- and a plain usage for any other prompt."""
    return FakeOpenAI(
        lambda body, _attempt: reply.get(body["prompt"], (200, {"usage": {"prompt_tokens": 3}})),
        models=models)


def test_prefill_server_shows_prompt_names_and_server_text_as_data(tmp_path: Path) -> None:
    evil = f"{LINK} {RAW}"
    replies = {"bad": (400, {"error": {"message": evil}}),
               "deep": (200, json.loads("[" * 50 + "]" * 50)),
               "lies": (200, {"usage": {"prompt_tokens": 3,
                                        "prompt_tokens_details": {"cached_tokens": 99}}})}
    server = _fake_server(replies, models=(f"m{LINK}",))
    try:
        prompts = tmp_path / "p.jsonl"
        prompts.write_text("\n".join(json.dumps({"prompt": p, "name": f"{p} {evil}"})
                                     for p in ("ok", "bad", "deep", "lies")) + "\n")
        url = server.url
        proc = script("prefill", "--server", url, "--prompt-list", str(prompts),
                      "--retries", "0", env=TERMINAL)
        out = _check(proc, "prefill --server")
        assert proc.returncode == 1, out  # "bad" failed
        assert out.count("[link=https://evil.example]x[/link]") >= 5, out  # names + error
        doc = json.loads(script("prefill", "--server", url, "--prompt-list", str(prompts),
                                "--retries", "0", "--json").stdout)
        lies = doc["results"][3]
        assert lies["cached_tokens"] is None and lies["computed_tokens"] is None  # not believed
        # a model the server does not serve: the served names are data in the error line
        proc = script("prefill", "--server", url, "--prompt", "x", "--model", evil,
                      env=TERMINAL)
        assert proc.returncode == 2 and "does not serve" in _check(proc, "prefill --model")
    finally:
        server.close()


def test_status_host_budget_errors_show_paths_as_data(tmp_path: Path) -> None:
    base = Path(os.path.realpath(tmp_path)) / "spool"
    dep = base / "[link=evil.example]x[red]dep\x1b[2J\u202e"
    with Store.open(dep / "rank-0000", create=True) as store:
        store.put(kind="vllm", namespace=NS, key=KEY, objects={"kv": b"x"})
    (dep / "host-budget.json").write_text("[" * 3000)  # deep nesting: hostile, not a record
    proc = script("status", "--root", str(base), env=TERMINAL)
    out = _check(proc, "status")
    assert proc.returncode == 0 and "host budget record unreadable" in out, out
    assert "[link=evil.example]x[red]dep" in out
