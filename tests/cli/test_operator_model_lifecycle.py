"""Issue 29.5 for the controllers / decision 2120: `status` and `doctor` show the PyTorch and
MLX controllers' models whose identity no longer matches the current model files (a newer
generation of the same model replaced them), with their last use and bytes, and
`clean --superseded` / `--unused-for` reclaim them by the rules of the vLLM deployments.

The first test runs the real controllers on the locally built tiny Llama (weights replaced
in place between two processes); the others write stores through the store API with the
identity records the controllers write, to age them (base install)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from operator_cli import run, run_json

from spoolctl.controllers.local.model_lifecycle import judge_models
from spoolctl.store import Store

DAY = 86400.0


def _retained(root: Path) -> dict[str, int]:
    """Retained entries per namespace."""
    out: dict[str, int] = {}
    with Store.open(root) as store:
        for row in store.entries():
            if row.hint == "retain":
                out[row.namespace] = out.get(row.namespace, 0) + 1
    return out


def _replace_weights(model_dir: Path) -> None:
    """A new fine-tune deployed in place: same files, same config, other weights."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name in tensors:
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("framework", ["pytorch", "mlx"])
def test_a_model_whose_weights_were_replaced_is_shown_and_reclaimed(
        framework, tiny_model_dir, tmp_path, store_root) -> None:
    pytest.importorskip("transformers")
    from controller_backends import make_backend

    from spoolctl.controllers import CachePrepareParams, Element, LocalCacheController

    model = tmp_path / "deployed"
    shutil.copytree(tiny_model_dir, model)
    docs = [Element("The pump starts when the valve is open. " * 4, role="user"),
            Element("Never run the pump dry. " * 4, role="user")]
    with LocalCacheController(make_backend(framework, model), store_root) as ctl:
        for doc in docs:
            ctl.prepare(CachePrepareParams(data=[doc]))
        old_ns = ctl.namespace
    _replace_weights(model)
    with LocalCacheController(make_backend(framework, model), store_root) as ctl:
        assert ctl.prepare(CachePrepareParams(data=[docs[0]])).source == "cold"
        new_ns = ctl.namespace
    assert _retained(store_root) == {old_ns: 2, new_ns: 1}

    doc = run_json("status", "--root", str(store_root))
    old, new = doc["models"][old_ns], doc["models"][new_ns]
    assert (old["state"], old["reason"], old["successor"]) == \
        ("superseded", "weights changed", new_ns)
    assert old["kind"] == framework and old["entries"] == 2 and old["model"] == str(model)
    with Store.open(store_root) as store:
        assert old["bytes"] == sum(r.size for r in store.entries(namespace=old_ns))
        assert old["last_used"] == max(r.last_access for r in store.entries(namespace=old_ns))
    assert old["weights"] != new["weights"] and new["state"] == "current"
    code, out, _ = run("status", "--root", str(store_root))
    shown = " ".join(out.split())  # lines wrap at the terminal's width
    assert code == 0 and "superseded (weights changed)" in shown
    assert "clean --superseded" in shown

    code, out, err = run("doctor", "--root", str(store_root), "--json")
    assert code in (0, 1), err  # other checks depend on the machine; this one does not
    warned = [c for c in json.loads(out)["checks"] if c["name"] == "model.lifecycle"]
    assert len(warned) == 1 and warned[0]["status"] == "warn"
    assert old_ns[:40] in warned[0]["detail"] and "clean --superseded" in warned[0]["fix"]

    dry = run_json("clean", "--root", str(store_root), "--superseded", "--dry-run")
    assert _retained(store_root) == {old_ns: 2, new_ns: 1}  # a dry run changes nothing
    real = run_json("clean", "--root", str(store_root), "--superseded", "--yes")
    assert real["model_lifecycle"] == dry["model_lifecycle"]
    assert list(real["model_lifecycle"]) == [old_ns]
    assert real["steps"]["released"]["entries"] == 2
    assert _same_counts(real["steps"], dry["steps"])  # the dry run said what the run did
    assert _retained(store_root) == {new_ns: 1}
    with LocalCacheController(make_backend(framework, model), store_root) as ctl:
        assert ctl.prepare(CachePrepareParams(data=[docs[0]])).source == "disk"


def test_a_model_served_from_memory_is_in_use(tiny_model_dir, store_root) -> None:
    """A long-lived process that serves its cache from memory keeps it "used": the memory
    hit moves the entry's clock in the catalog, so `--unused-for` does not reclaim it."""
    pytest.importorskip("transformers")
    from controller_backends import make_backend

    from spoolctl.controllers import CachePrepareParams, Element, LocalCacheController

    params = CachePrepareParams(data=[Element("The pump starts when the valve is open. " * 4,
                                              role="user")])
    with LocalCacheController(make_backend("pytorch", tiny_model_dir), store_root) as ctl:
        assert ctl.prepare(params).source == "cold"
        with Store.open(store_root, clock=lambda: time.time() - 40 * DAY) as store:
            store.touch([row.entry_id for row in store.entries()])  # last read 40 days ago
            assert all(row.last_access < time.time() - 39 * DAY for row in store.entries())
        assert ctl.prepare(params).source == "memory"
        doc = run_json("clean", "--root", str(store_root), "--unused-for", "30d", "--dry-run")
        assert doc["model_lifecycle"] == {}
        assert run_json("status", "--root", str(store_root))["models"][ctl.namespace][
            "state"] == "current"


def _same_counts(real: dict, dry: dict) -> bool:
    keys = ("entries", "objects", "files", "bytes")
    return all({k: real[s].get(k) for k in keys} == {k: dry[s].get(k) for k in keys}
               for s in real) and set(real) == set(dry)


# -- stores written through the store API, aged -------------------------------------------


def _identity(kind: str, weights: str, *, model: str = "/models/m",
              version: str = "5.19.0") -> dict:
    if kind == "pytorch":
        return {"framework": "transformers", "transformers": version, "torch": "2.13.0",
                "model": model, "revision": f"blake3:{weights}", "dtype": "float32",
                "device": "cpu", "kv_layout": "hf-dynamic/L2/H2/D32"}
    return {"framework": "mlx-lm", "mlx_lm_version": version, "mlx_version": "0.32.4",
            "cache_format": "v2", "model": model, "model_digest": weights,
            "dtype": "float32", "device": "cpu"}


def _fill(store: Store, kind: str, namespace: str, identity: dict, created: float,
          used: float, n: int = 2) -> None:
    store.clock = lambda: created  # when these entries were stored, then last read
    ids = [store.put(kind=kind, namespace=namespace, key=f"{namespace}-{i}",
                     objects={"kv": os.urandom(2048)},
                     meta={"format": "spoolctl-local-kv/v1", "identity": identity}).entry_id
           for i in range(n)]
    store.clock = lambda: used
    store.touch(ids)
    store.clock = time.time


@pytest.fixture
def aged(store_root: Path) -> Path:
    """pytorch: an old generation (weights 1, last used 9 days ago) replaced by weights 2;
    mlx: another model nothing used for 40 days; pytorch: two generations both in use."""
    now = time.time()
    with Store.open(store_root, create=True) as store:
        _fill(store, "pytorch", "pytorch-old", _identity("pytorch", "1" * 64),
              now - 10 * DAY, now - 9 * DAY)
        _fill(store, "pytorch", "pytorch-new", _identity("pytorch", "2" * 64),
              now - 8 * DAY, now - 60)
        _fill(store, "mlx", "mlx-idle", _identity("mlx", "3" * 64, model="/models/other"),
              now - 50 * DAY, now - 40 * DAY)
        _fill(store, "pytorch", "pytorch-ab-1", _identity("pytorch", "4" * 64, model="/ab"),
              now - 5 * DAY, now - 30)
        _fill(store, "pytorch", "pytorch-ab-2", _identity("pytorch", "5" * 64, model="/ab"),
              now - 4 * DAY, now - 40)
    return store_root


@pytest.mark.base
def test_status_judges_each_controller_model(aged: Path) -> None:
    models = run_json("status", "--root", str(aged))["models"]
    assert {n: m["state"] for n, m in models.items()} == {
        "pytorch-old": "superseded", "pytorch-new": "current", "mlx-idle": "current",
        "pytorch-ab-1": "current", "pytorch-ab-2": "current"}  # A/B: both in use
    assert models["pytorch-old"]["successor"] == "pytorch-new"
    assert time.time() - models["mlx-idle"]["last_used"] == pytest.approx(40 * DAY, abs=600)


@pytest.mark.base
def test_clean_unused_for_reclaims_only_models_idle_that_long(aged: Path) -> None:
    dry = run_json("clean", "--root", str(aged), "--unused-for", "30d", "--dry-run")
    real = run_json("clean", "--root", str(aged), "--unused-for", "30d", "--yes")
    assert list(real["model_lifecycle"]) == ["mlx-idle"] == list(dry["model_lifecycle"])
    assert real["model_lifecycle"]["mlx-idle"]["state"] == "unused"
    assert _same_counts(real["steps"], dry["steps"])
    left = _retained(aged)
    assert "mlx-idle" not in left and left["pytorch-old"] == 2  # superseded, 9 days: kept


@pytest.mark.base
def test_clean_superseded_keeps_generations_in_use(aged: Path) -> None:
    run_json("clean", "--root", str(aged), "--superseded", "--yes")
    assert _retained(aged) == {"pytorch-new": 2, "mlx-idle": 2, "pytorch-ab-1": 2,
                               "pytorch-ab-2": 2}


def _use(name: str, first: float, last: float, identity: dict):
    from spoolctl.store.maintain.staleness import DeploymentUse

    return DeploymentUse(name, 2, 4096, first, last, identity)


@pytest.mark.base
def test_what_replaced_a_model_is_named_and_other_models_never_supersede() -> None:
    old = {**_identity("pytorch", "1" * 64), "kind": "pytorch"}
    upgraded = {**_identity("pytorch", "1" * 64, version="5.20.0"), "kind": "pytorch"}
    other = {**_identity("pytorch", "9" * 64, model="/other"), "kind": "pytorch"}
    mlx_same_path = {**_identity("mlx", "9" * 64), "kind": "mlx"}
    v = judge_models([_use("a", 100, 200, old), _use("b", 300, 400, upgraded),
                      _use("c", 300, 400, other), _use("d", 300, 400, mlx_same_path)], now=500)
    assert (v["a"].state, v["a"].reason, v["a"].successor) == \
        ("superseded", "transformers version changed", "b")
    assert v["c"].state == v["d"].state == "current"
    # an identity that cannot be read is never superseded
    assert judge_models([_use("x", 100, 200, None), _use("y", 300, 400, old)],
                        now=500)["x"].state == "current"
