"""Archives that prove their author (issue 33 item 4, decision 2800).

``export --sign-key`` writes ``<archive>.sig`` (Ed25519 over the archive's BLAKE3);
``import --require-signed --verify-key`` refuses -- before anything is imported -- an archive
without a signature, one whose bytes were changed after signing (a forged archive carrying
the old signature), and one re-signed by another key or with a forged signature.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("cryptography")

from fleet_keys import keypair
from operator_cli import run, run_json, script

from spoolctl.store import Store
from spoolctl.store.transfer.archive import TRAILER_BYTES, TRAILER_MAGIC
from spoolctl.store.transfer.archive_sign import SigningSink, load_signing_key, sign_archive

KIND, NS = "pytorch", "model-x"


def _store_with(root: Path, payload: bytes, n: int = 3) -> None:
    with Store.open(root, create=True, master_key=None) as store:
        for i in range(n):
            store.put(kind=KIND, namespace=NS, key=f"k{i}", objects={"kv": payload + bytes([i])})


def _entries(root: Path) -> int:
    if not (root / ".spoolctl-root").exists():
        return 0
    with Store.open(root, read_only=True, master_key=None) as store:
        return store.totals().entries


@pytest.fixture
def fleet(tmp_path: Path):
    keys = tmp_path / "keys"
    keys.mkdir()
    return keypair(keys, "fleet")


def _import(archive: Path, target: Path, pub: Path) -> tuple[int, str]:
    code, _, err = run("import", str(archive), "--root", str(target), "--require-signed",
                       "--verify-key", str(pub))
    return code, err


def test_signed_archive_imports_and_forged_or_resigned_ones_do_not(tmp_path: Path, fleet):
    private, public, _ = fleet
    src = tmp_path.resolve() / "src"
    _store_with(src, b"the real KV " * 100)
    archive = tmp_path / "a.tar"
    doc = run_json("export", "-o", str(archive), "--root", str(src), "--sign-key", str(private))
    assert Path(doc["signature"]).exists()
    assert json.loads(Path(doc["signature"]).read_text())["alg"] == "ed25519"

    good = tmp_path.resolve() / "good"
    code, err = _import(archive, good, public)
    assert code == 0, err
    assert _entries(good) == 3

    # An attacker's archive (well formed, other KV under the same keys).
    evil_src = tmp_path.resolve() / "evil-src"
    _store_with(evil_src, b"attacker's KV " * 100)
    evil = tmp_path / "evil.tar"
    run_json("export", "-o", str(evil), "--root", str(evil_src))

    cases = {}
    unsigned = tmp_path / "unsigned.tar"  # no .sig at all
    shutil.copy(archive, unsigned)
    cases["unsigned"] = (unsigned, "not signed")
    forged = tmp_path / "forged.tar"  # the evil bytes with the genuine signature
    shutil.copy(evil, forged)
    shutil.copy(f"{archive}.sig", f"{forged}.sig")
    cases["forged"] = (forged, "not the ones signed")
    flipped = tmp_path / "flipped.tar"  # one byte of the genuine archive changed
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 1
    flipped.write_bytes(bytes(data))
    shutil.copy(f"{archive}.sig", f"{flipped}.sig")
    cases["flipped"] = (flipped, "not the ones signed")
    other_key, _, _ = keypair(tmp_path / "keys", "attacker")
    resigned = tmp_path / "resigned.tar"  # the evil bytes signed by the attacker's key
    shutil.copy(evil, resigned)
    sign_archive(resigned, load_signing_key(other_key))
    cases["resigned"] = (resigned, "signed by another key")
    spoofed = tmp_path / "spoofed.tar"  # attacker's signature under the fleet's key id
    shutil.copy(evil, spoofed)
    sig = json.loads(Path(f"{resigned}.sig").read_text())
    sig["key_id"] = json.loads(Path(f"{archive}.sig").read_text())["key_id"]
    Path(f"{spoofed}.sig").write_text(json.dumps(sig))
    cases["spoofed"] = (spoofed, "does not verify")
    for name, (path, why) in cases.items():
        target = tmp_path.resolve() / f"t-{name}"
        code, err = _import(path, target, public)
        assert code == 1 and why in err and err.count("\n") == 1, (name, code, err)
        assert _entries(target) == 0, name  # refused before anything was imported


def test_signing_options_say_what_they_need(tmp_path: Path, fleet):
    private, _, _ = fleet
    src = tmp_path.resolve() / "src"
    _store_with(src, b"x", 1)
    code, _, err = run("import", str(src), "--root", str(tmp_path / "t"), "--require-signed",
                       "--verify-key", str(private))  # a peer store root: nothing signed
    assert code == 2 and "needs an archive" in err
    code, _, err = run("import", str(tmp_path / "a.tar"), "--root", str(tmp_path / "t"),
                       "--require-signed")
    assert code == 2 and "go together" in err
    os.chmod(private, 0o644)
    code, _, err = run("export", "-o", str(tmp_path / "b.tar"), "--root", str(src),
                       "--sign-key", str(private))
    assert code == 2 and "chmod 600" in err


def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(data))))


def test_signed_streams_are_verified_before_anything_is_imported(tmp_path: Path, fleet,
                                                                 monkeypatch):
    """`export -o - --sign-key` ends the stream with a signature trailer; `import -
    --require-signed` imports it, and refuses -- before importing anything -- a stream that is
    unsigned, cut short, altered, forged (another stream with the genuine trailer), re-signed
    by another key or carrying a spoofed key id. An import that does not ask for signatures
    accepts the signed stream (the trailer is not "data after the end")."""
    private, public, _ = fleet
    src = tmp_path.resolve() / "src"
    _store_with(src, b"the real KV " * 100)
    proc = script("export", "-o", "-", "--root", str(src), "--sign-key", str(private),
                  text=False)  # a real process: the archive is its stdout
    assert proc.returncode == 0, proc.stderr
    signed = proc.stdout
    assert signed[-TRAILER_BYTES:].startswith(TRAILER_MAGIC)

    good = tmp_path.resolve() / "good"
    _stdin(monkeypatch, signed)
    code, _, err = run("import", "-", "--root", str(good), "--require-signed",
                       "--verify-key", str(public))
    assert code == 0 and _entries(good) == 3, err
    plain = tmp_path.resolve() / "plain"
    _stdin(monkeypatch, signed)
    code, _, err = run("import", "-", "--root", str(plain))
    assert code == 0 and _entries(plain) == 3, err

    evil_src = tmp_path.resolve() / "evil-src"
    _store_with(evil_src, b"attacker's KV " * 100)
    evil_file = tmp_path / "evil.tar"
    run_json("export", "-o", str(evil_file), "--root", str(evil_src))
    evil = evil_file.read_bytes()
    trailer = signed[-TRAILER_BYTES:]
    _, _, attacker = keypair(tmp_path / "keys", "attacker")
    resigner = SigningSink(lambda bufs: None)
    resigner([evil])
    resigned = evil + resigner.trailer(attacker)
    doc = json.loads(resigned[-TRAILER_BYTES:][len(TRAILER_MAGIC):].rstrip(b" "))
    doc["key_id"] = json.loads(trailer[len(TRAILER_MAGIC):].rstrip(b" "))["key_id"]
    body = TRAILER_MAGIC + json.dumps(doc).encode()
    flipped = bytearray(signed)
    flipped[len(signed) // 3] ^= 1
    cases = {
        "unsigned": (evil, "not signed"),
        "truncated": (signed[:len(signed) // 2], "not signed"),
        "flipped": (bytes(flipped), "not the ones signed"),
        "forged": (evil + trailer, "not the ones signed"),
        "resigned": (resigned, "signed by another key"),
        "spoofed": (evil + body + b" " * (TRAILER_BYTES - len(body)), "does not verify"),
    }
    for name, (data, why) in cases.items():
        target = tmp_path.resolve() / f"t-{name}"
        _stdin(monkeypatch, data)
        code, _, err = run("import", "-", "--root", str(target), "--require-signed",
                           "--verify-key", str(public))
        assert code == 1 and why in err and err.count("\n") == 1, (name, code, err)
        assert _entries(target) == 0, name  # refused before anything was imported
