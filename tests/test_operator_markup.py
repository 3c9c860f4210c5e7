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
from operator_cli import ENV, script

from spoolctl.store import Store, entry_id_for
from spoolctl.store.quarantine import REASON_FILE

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
