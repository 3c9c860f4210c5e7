"""`spoolctl prefill` and `spoolctl demo` end to end (real torch, tiny model, in-process CLI)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from spoolctl.cli.app import main
from spoolctl.store import Store

PROMPT = "You are a helpful assistant. " + " ".join(
    f"Fact {i}: the pump is blue." for i in range(30))


def run_json(capsys, *argv: str) -> dict:
    main([*argv, "--json"])
    return json.loads(capsys.readouterr().out)


def run_error(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    return exc.value.code, capsys.readouterr().err


def test_prefill_twice_hits_the_cache(capsys, tiny_model_dir, store_root):
    args = ("prefill", "--model", str(tiny_model_dir), "--prompt", PROMPT, "--root",
            str(store_root))
    first = run_json(capsys, *args)
    assert first["source"] == "cold" and first["tokens_written"] == first["tokens"] > 0
    second = run_json(capsys, *args)
    assert second["entry_id"] == first["entry_id"]
    assert second["source"] == "disk" and second["tokens_written"] == 0
    with Store.open(store_root) as s:
        assert [r.entry_id for r in s.entries()] == [first["entry_id"]]
    main(list(args))  # the table form
    out = capsys.readouterr().out
    assert "tokens written" in out and "disk" in out


def test_prefill_messages_file_grows_incrementally(capsys, tiny_model_dir, store_root,
                                                   tmp_path):
    doc = {"instructions": [{"role": "system", "content": "Answer from the manual."}],
           "data": [{"role": "user", "content": "Manual: " + "check the valve. " * 40}],
           "tools": [{"name": "search", "description": "search the manual"}]}
    f = tmp_path / "messages.json"
    f.write_text(json.dumps(doc))
    args = ("prefill", "--model", str(tiny_model_dir), "--messages-file", str(f), "--root",
            str(store_root))
    base = run_json(capsys, *args)
    doc["data"].append({"role": "user", "content": "Addendum: replace the seal yearly."})
    f.write_text(json.dumps(doc))
    grown = run_json(capsys, *args)
    assert grown["source"] == "incremental" and grown["supersedes"] == base["entry_id"]
    assert grown["tokens_reused"] == base["tokens"]
    assert grown["tokens_written"] == grown["tokens"] - base["tokens"]


def test_prefill_bad_input_is_one_clear_error(capsys, tiny_model_dir, store_root, tmp_path):
    code, err = run_error(capsys, "prefill", "--model", str(tiny_model_dir), "--root",
                          str(store_root))
    assert code == 2 and "exactly one of --prompt" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, err = run_error(capsys, "prefill", "--model", str(tiny_model_dir), "--messages-file",
                          str(bad), "--root", str(store_root))
    assert code == 2 and str(bad) in err and "Traceback" not in err
    code, err = run_error(capsys, "prefill", "--model", str(tmp_path / "nope"), "--prompt", "x",
                          "--root", str(store_root))
    assert code == 2 and "model directory not found" in err


def test_demo_runs_reuses_from_disk_and_cleans_up(capsys, tiny_model_dir, store_root):
    report = run_json(capsys, "demo", "--preset", "tiny", "--model-dir", str(tiny_model_dir),
                      "--root", str(store_root))
    assert report["all_tokens_identical"] is True
    assert [p["source"] for p in report["prompts"]] == ["disk", "disk", "disk"]
    inc = report["incremental"]
    assert inc["source"] == "incremental" and 0 < inc["written_tokens"] < inc["tokens"]
    assert inc["reused_tokens"] + inc["written_tokens"] == inc["tokens"]
    assert report["entries_created"] == 4 and report["entries_left_after_cleanup"] == 0
    with Store.open(store_root) as s:
        assert s.entries(include_pending=True) == []
