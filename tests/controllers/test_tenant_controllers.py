"""The PyTorch and MLX prompt-cache controllers with ``tenant=`` on an encrypted store (issue 33
item 6, decision 2810): a tenant's entries are sealed with its key and hold no clear-text
prompt data; the same tenant reuses them (exact and as a base) with tokens identical to a cold
run; another tenant, or none, never reads them (a miss, tokens identical to cold); after
``keys revoke`` they are misses; with a lost (replaced) master key every prepare is a miss,
said in one line."""

from __future__ import annotations

import json
import logging
import secrets
from pathlib import Path

import pytest

pytest.importorskip("cryptography")
pytest.importorskip("transformers")

from controller_backends import Counting, cold_tokens
from operator_cli import run_json

from spoolctl.controllers import CachePrepareParams, Element, LocalCacheController
from spoolctl.errors import ConfigError
from spoolctl.store import Store
from spoolctl.store.sealing import COMMAND_ENV, FILE_ENV, MAGIC3, VALUE_ENV

SYSTEM = "You are a helpful assistant. Answer using the reference documents below."
DOC1 = "Ward 7 note: patient 4711, hypertension, started on amlodipine five milligrams. " * 3
DOC2 = "Follow-up: blood pressure down to 130 over 85 after two weeks; continue the dose. " * 2
QUESTION = "Question: what was the patient started on?"


@pytest.fixture(autouse=True)
def master_env(monkeypatch) -> str:
    for name in (FILE_ENV, VALUE_ENV, COMMAND_ENV):
        monkeypatch.delenv(name, raising=False)
    key = secrets.token_hex(32)
    monkeypatch.setenv(VALUE_ENV, key)
    return key


def _params(model: str, *data: str) -> CachePrepareParams:
    return CachePrepareParams(model=model, instructions=[Element(SYSTEM, role="system")],
                              data=[Element(d, role="user") for d in data])


def _check_tenancy(backend, make, root: Path, master_env: str, monkeypatch, caplog,
                   n: int = 4) -> None:
    """The behaviour both frameworks must show; ``make(backend, root, tenant)`` builds a
    controller."""
    p1, p2 = _params(None, DOC1), _params(None, DOC1, DOC2)
    want1, want2 = cold_tokens(backend, p1, QUESTION, n), cold_tokens(backend, p2, QUESTION, n)
    with make(backend, root, "acme") as ctl:
        first = ctl.generate(p1, QUESTION, n)
    assert first.handle.source == "cold" and first.tokens == want1

    # Sealed at rest: every object is ciphertext, no manifest or catalog row carries the
    # token ids or the tenant's name, and the element hashes are keyed per tenant.
    objects = [p for p in (root / "objects").rglob("*.obj")]
    assert objects and all(p.read_bytes()[:4] == MAGIC3 for p in objects)
    ids = first.handle.ref
    with Store.open(root, read_only=True, master_key=None) as store:
        manifest = store.manifest(ids)
        acme_row = store.row(ids)
    assert manifest.meta["token_count"] == first.handle.cached_tokens > 0
    assert "tokens" not in manifest.meta and "prefix_offsets" not in manifest.meta
    for path in (root / "manifests").rglob("*.json"):
        text = path.read_text()
        assert '"prefix_hashes"' not in text, path
        assert "acme" not in text and "Ward 7" not in text, path
    assert acme_row.index["group"].startswith("t:")

    # The same tenant: an exact disk hit, then an incremental prefill on its sealed base.
    counting = Counting(backend)
    with make(counting, root, "acme") as ctl:
        hit = ctl.generate(p1, QUESTION, n)
        assert hit.handle.source == "disk" and hit.tokens == want1 and counting.prefills == []
    with make(counting, root, "acme") as ctl:  # the base comes from disk: its sealed meta too
        inc = ctl.generate(p2, QUESTION, n)
        assert inc.handle.source == "incremental" and inc.tokens == want2
        assert inc.handle.reused_tokens == hit.handle.cached_tokens

    # Another tenant, and no tenant (the default one): a miss, tokens as cold; their rows of
    # the same params share no hash with acme's.
    for other in ("globex", None):
        with make(backend, root, other) as ctl:
            got = ctl.generate(p1, QUESTION, n)
            assert got.handle.source == "cold" and got.tokens == want1, other
            assert got.handle.ref != ids
            assert not set(json.dumps(ctl.store.row(got.handle.ref).index).split('"')) & \
                {acme_row.index["group"], *acme_row.index["elements"]}

    # Crypto-erase: acme's entries are misses at once.
    run_json("keys", "revoke", "--tenant-env", "SPOOLCTL_TENANT", "--yes", "--root", str(root),
             env={VALUE_ENV: master_env, "SPOOLCTL_TENANT": "acme",
                  # erased keys are recorded outside the store
                  "SPOOLCTL_KEY_LEDGER": str(root.parent / "erased-keys.json")})
    with make(backend, root, "acme") as ctl:
        again = ctl.generate(p2, QUESTION, n)
        assert again.handle.source == "cold" and again.tokens == want2

    # A lost master key, replaced by a new one: one line, then misses, nothing written.
    monkeypatch.setenv(VALUE_ENV, secrets.token_hex(32))
    before = sorted(p.name for p in (root / "manifests").rglob("*.json"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spoolctl"), make(backend, root, "globex") as ctl:
        lost = ctl.generate(p1, QUESTION, n)
    assert lost.handle.source == "cold" and lost.tokens == want1
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "not the one this store's keyring" in lines[0], lines
    assert sorted(p.name for p in (root / "manifests").rglob("*.json")) == before


def test_pytorch_controller_tenants(tiny_model_dir: Path, store_root: Path, master_env: str,
                                    monkeypatch, caplog):
    from spoolctl.controllers.pytorch import PyTorchBackend, PyTorchCacheController

    backend = PyTorchBackend(tiny_model_dir, model_id="tiny")

    def make(b, root, tenant):
        return LocalCacheController(b, root, tenant=tenant) if isinstance(b, Counting) else \
            PyTorchCacheController(b, root, tenant=tenant)
    _check_tenancy(backend, make, store_root, master_env, monkeypatch, caplog)

    # A tenant on a store without encryption isolates nothing: refused in one line.
    monkeypatch.delenv(VALUE_ENV)
    plain = store_root.parent / "plain"
    with pytest.raises(ConfigError, match="no encryption at rest configured") as err:
        PyTorchCacheController(backend, plain, tenant="acme")
    assert "\n" not in str(err.value)


def test_mlx_controller_tenants(tiny_model_dir: Path, store_root: Path, master_env: str,
                                monkeypatch, caplog):
    pytest.importorskip("mlx.core")
    from spoolctl.controllers.mlx import MlxBackend, MlxCacheController

    backend = MlxBackend(tiny_model_dir)

    def make(b, root, tenant):
        return LocalCacheController(b, root, tenant=tenant) if isinstance(b, Counting) else \
            MlxCacheController(b, root, tenant=tenant)
    _check_tenancy(backend, make, store_root, master_env, monkeypatch, caplog)
