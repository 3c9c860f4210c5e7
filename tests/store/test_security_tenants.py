"""``cache_salt`` isolation on a real store: a tenant with another salt computes other keys
for the same prompt, finds none of the first tenant's entries, and its lookups run the very
same catalog statements (point probes by entry id) whether or not other tenants' entries
exist -- no lookup path scans or branches on other tenants' data, so its cost cannot reveal
them. (Uses the connector's pure chain module only; no vLLM.)"""

from __future__ import annotations

import random
import re

from spoolctl.connector.planning.chain import chain_root, chunk_keys
from spoolctl.store import Store

NS = "deploy-1"
CHUNK = 32


def _prompt(seed: int, n: int = 8 * CHUNK) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


def _store_chain(store: Store, salt: str | None, tokens: list[int]) -> list[str]:
    keys = chunk_keys(chain_root(NS, salt), tokens, CHUNK)
    for key in keys:
        store.put(kind="vllm", namespace=NS, key=key, objects={"kv": key.encode() * 4})
    return keys


def _traced_lookups(store: Store, keys: list[str]) -> list[str]:
    statements: list[str] = []
    # the catalog's own connection: see exactly what a lookup runs
    db = store.catalog.connection_for_inspection()
    db.set_trace_callback(statements.append)
    try:
        hits = [store.lookup("vllm", NS, key, touch=False) for key in keys]
    finally:
        db.set_trace_callback(None)
    assert hits == [None] * len(keys)
    # the statement shapes, with the probed ids blanked
    return [re.sub(r"'[0-9a-f]{64}'", "'<id>'", s) for s in statements]


def test_other_salt_other_keys_no_hits(store: Store) -> None:
    prompt = _prompt(1)
    a_keys = _store_chain(store, "tenant-a", prompt)
    b_keys = chunk_keys(chain_root(NS, "tenant-b"), prompt, CHUNK)
    none_keys = chunk_keys(chain_root(NS, None), prompt, CHUNK)
    assert not set(a_keys) & set(b_keys) and not set(a_keys) & set(none_keys)
    assert [store.lookup("vllm", NS, k) for k in b_keys] == [None] * len(b_keys)
    assert all(store.lookup("vllm", NS, k) is not None for k in a_keys)


def test_lookup_work_does_not_depend_on_other_tenants(store_root) -> None:
    prompt = _prompt(2)
    b_keys = chunk_keys(chain_root(NS, "tenant-b"), prompt, CHUNK)
    with Store.open(store_root, create=True) as store:
        alone = _traced_lookups(store, b_keys)
        # tenant A caches the very same prompt, and lots more
        _store_chain(store, "tenant-a", prompt)
        for seed in range(3, 8):
            _store_chain(store, "tenant-a", _prompt(seed))
        crowded = _traced_lookups(store, b_keys)
    assert alone and crowded == alone
    assert all("entry_id" in s for s in alone if s.lstrip().upper().startswith("SELECT"))
