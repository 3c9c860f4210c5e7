"""Key operations of an encrypted store (``spoolctl keys``), as data.

* ``usage``: whether the store is encrypted, whether the configured master key is the one
  its keyring was written under, and per tenant id its key versions and entries per version.
  Never any key material: ids and counts only.
* ``revoke``: crypto-erase a tenant. Every wrapped data key of the tenant is removed from the
  keyring (atomically, fsynced), then the tenant's entries are released in the catalog: from
  then on every lookup misses and ``clean`` reclaims the bytes. An entry committed by a
  writer that sealed it before the revoke is released by the first read that finds its key
  gone (``Store.read``). The tenant may write again: under a new version.
* ``rotate``: a new current version per tenant (new commits use it); old versions stay
  readable until ``retire`` erases them (and releases their entries, like a revoke).

Each refuses a store without encryption (ConfigError) and a master key that does not own
the keyring (KeyUnavailableError), before changing anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, InvalidIdError, KeyUnavailableError
from .format.keys import TenantId
from .sealing import DEFAULT_TENANT, Sealer
from .store import Store

# A tenant is named by its name (vLLM: the cache_salt, a secret) or by its opaque id.
Tenant = str | TenantId


@dataclass
class KeyChange:
    """What one key operation did (or, ``dry_run``, would do)."""

    action: str
    dry_run: bool
    tenants: dict[str, list[int]] = field(default_factory=dict)  # tid -> versions changed
    released_entries: int = 0
    released_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "dry_run": self.dry_run,
                "tenants": [{"tenant_id": t, "versions": v} for t, v in self.tenants.items()],
                "released_entries": self.released_entries,
                "released_bytes": self.released_bytes}


def _sealer(store: Store, *, owned: bool = True) -> Sealer:
    if store.sealer is None:
        raise ConfigError("this store has no encryption configured", path=store.root,
                          fix="set SPOOLCTL_MASTER_KEY_FILE (docs/runbook.md, encryption)")
    if owned and store.sealer.keyring.path.exists() and not store.sealer.keyring.master_matches:
        raise KeyUnavailableError("the configured master key is not the one this store's "
                                  "keyring was written under", path=store.sealer.keyring.path,
                                  fix="configure the store's own master key (docs/runbook.md, "
                                      "key loss)")
    return store.sealer


def key_usage(store: Store) -> dict[str, Any]:
    """The store's encryption facts (see the module docstring); safe to print and log."""
    counts = store.run_with_catalog_repair(store.catalog.sealed_counts)
    per: dict[str, dict[int, tuple[int, int]]] = {}
    for tid, version, n, size in counts:
        per.setdefault(tid, {})[version] = (n, size)
    doc: dict[str, Any] = {"encrypted": store.sealer is not None or bool(counts),
                           "master_key": None, "keyring": None, "tenants": []}
    keys: dict[str, Any] = {}
    if store.sealer is not None:
        ring = store.sealer.keyring
        doc["master_key"] = {"key_id": store.sealer.master.key_id,
                             "matches_keyring": ring.master_matches or not ring.path.exists()}
        doc["keyring"] = str(ring.path)
        keys = {t.tenant_id: t for t in ring.tenants()}
    for tid in sorted(set(per) | set(keys)):
        t = keys.get(tid)
        live = list(t.versions) if t is not None else []
        imported = set(t.imported) if t is not None else set()
        versions = sorted(set(live) | set(per.get(tid, {})))
        doc["tenants"].append({
            "tenant_id": tid, "current": t.current if t is not None else None,
            "revoked": bool(t is not None and t.revoked),
            "versions": [{"version": v, "key": "live" if v in live else "unavailable",
                          "origin": "imported" if v in imported else "here",
                          "entries": per.get(tid, {}).get(v, (0, 0))[0],
                          "bytes": per.get(tid, {}).get(v, (0, 0))[1]} for v in versions]})
    doc["unreadable_entries"] = sum(v["entries"] for t in doc["tenants"] for v in t["versions"]
                                    if v["key"] != "live")
    return doc


def _tid(sealer: Sealer, tenant: Tenant) -> str:
    return tenant.tid if isinstance(tenant, TenantId) else sealer.tenant_id(tenant)


def known_tenant_ids(store: Store) -> set[str]:
    """The tenant ids this store knows: in its keyring, or on its sealed entries."""
    sealer = _sealer(store, owned=False)
    counts = store.run_with_catalog_repair(store.catalog.sealed_counts)
    return {t.tenant_id for t in sealer.keyring.tenants()} | {tid for tid, *_ in counts}


def tenant_from_argument(store: Store, value: str) -> Tenant:
    """The tenant a command-line ``--tenant`` value names: an id (16 hex, as ``keys ls``
    shows it) or ``default``. A tenant's name there would be a secret in every process
    listing and shell history: ConfigError when ``value`` is the name of a tenant this store
    knows (its keyed id is known) or is not an id at all; the message never repeats it."""
    if value == DEFAULT_TENANT:
        return value
    sealer = _sealer(store)
    known = known_tenant_ids(store)
    secret = "a tenant's name (vLLM: its cache_salt) is a secret: never pass it as an argument"
    fix = ("pass the name in a file (--tenant-file PATH, or --tenant-file - for stdin) or an "
           "environment variable (--tenant-env VAR), or the tenant's id (`spoolctl keys ls`)")
    if sealer.tenant_id(value) in known and value not in known:
        raise ConfigError(f"--tenant was given a tenant's name, not its id: {secret}",
                          fix=f"rotate that secret if others can read this host's process "
                              f"list or your shell history; {fix}")
    try:
        return TenantId(value)
    except InvalidIdError:
        raise ConfigError(f"--tenant takes a tenant id (16 hex characters); {secret}",
                          fix=fix) from None


def revoke_tenant(store: Store, tenant: Tenant, *, dry_run: bool = False) -> KeyChange:
    """Crypto-erase ``tenant`` (see the module docstring)."""
    return _erase(store, _tid(_sealer(store), tenant), None, dry_run, "revoke")


def retire_keys(store: Store, tenant: Tenant | None, *, dry_run: bool = False) -> KeyChange:
    """Erase every version but the current one (older ones, and keys imported from archives),
    of ``tenant`` (None: every tenant)."""
    sealer = _sealer(store)
    change = KeyChange("retire", dry_run)
    tids = [_tid(sealer, tenant)] if tenant is not None else \
        [t.tenant_id for t in sealer.keyring.tenants()]
    for t in sealer.keyring.tenants():
        if t.tenant_id in tids and t.current is not None:
            one = _erase(store, t.tenant_id, t.current, dry_run, "retire")
            change.tenants.update(one.tenants)
            change.released_entries += one.released_entries
            change.released_bytes += one.released_bytes
    return change


def rotate_keys(store: Store, tenant: Tenant | None, *, dry_run: bool = False) -> KeyChange:
    """A new current key version for ``tenant`` (None: every tenant with a key)."""
    sealer = _sealer(store)
    store._writable("rotating keys")
    change = KeyChange("rotate", dry_run)
    tids = [_tid(sealer, tenant)] if tenant is not None else \
        [t.tenant_id for t in sealer.keyring.tenants()]
    if dry_run:  # a new version is a random id: none is drawn for a dry run
        change.tenants = {tid: [] for tid in tids}
        return change
    change.tenants = {tid: [v] for tid, v in sealer.keyring.rotate(tids).items()}
    return change


def _erase(store: Store, tid: str, keep: int | None, dry_run: bool, action: str) -> KeyChange:
    """Erase every key of ``tid`` but ``keep`` (None: all) and release their entries."""
    sealer = _sealer(store)
    store._writable(f"{action} of a tenant's keys")
    change = KeyChange(action, dry_run)
    known = {t.tenant_id: t for t in sealer.keyring.tenants()}.get(tid)
    versions = [v for v in (known.versions if known else ()) if keep is None or v != keep]
    if not dry_run:
        # Keys first: from this moment nothing of the tenant decrypts, whatever happens next.
        versions = sealer.keyring.revoke(tid) if keep is None else \
            sealer.keyring.retire(tid, keep)
    n, size = store.run_with_catalog_repair(
        lambda: store.catalog.release_sealed(tid, keep, store.clock(), dry_run))
    change.tenants[tid] = versions
    change.released_entries, change.released_bytes = n, size
    return change


def encryption_summary(store: Store) -> dict[str, Any] | None:
    """``status``'s ``encryption``: None for a store that is not encrypted (no master key
    configured and no keyring: nothing is scanned, so plain stores pay nothing); else
    ``usage`` in short: master key id and match, tenants, entries per key version, entries
    whose key is gone."""
    keyring = store.layout.state / "keyring.json"
    if store.sealer is None and not keyring.exists():
        return None
    doc = key_usage(store)
    versions: dict[str, int] = {}
    for t in doc["tenants"]:
        for v in t["versions"]:
            versions[str(v["version"])] = versions.get(str(v["version"]), 0) + v["entries"]
    imported = {t["tenant_id"]: [v["version"] for v in t["versions"]
                                 if v["origin"] == "imported" and v["key"] == "live"]
                for t in doc["tenants"]}
    return {"master_key": doc["master_key"], "tenants": len(doc["tenants"]),
            "entries_by_version": versions, "unreadable_entries": doc["unreadable_entries"],
            "imported_keys": {t: vs for t, vs in imported.items() if vs}}


def encryption_checks(root: Any) -> list[Any]:
    """``doctor``'s encryption checks for the store at ``root`` (none for a plain store)."""
    from .maintain.doctor_scan import Check
    from .sealing import FILE_ENV, MasterKey

    keyring = Path(root) / "state" / "keyring.json"
    try:
        master = MasterKey.from_environment()
    except ConfigError as exc:
        return [Check("encryption.master_key", "fail", exc.message, exc.fix or "")]
    if master is None and not keyring.exists():
        return []
    try:
        with Store.open(root, read_only=True, master_key=master) as store:
            doc = encryption_summary(store)
    except ConfigError as exc:
        return [Check("encryption.keyring", "fail", exc.message, exc.fix or "")]
    assert doc is not None
    held = sum(doc["entries_by_version"].values())
    if doc["master_key"] is None:
        return [Check("encryption.master_key", "fail",
                      f"the store is encrypted ({held} entries) and no master key is "
                      "configured: every encrypted entry is a miss",
                      f"set {FILE_ENV} to the store's master key (docs/runbook.md)")]
    if not doc["master_key"]["matches_keyring"]:
        return [Check("encryption.master_key", "fail",
                      f"master key {doc['master_key']['key_id']} is not the key this store's "
                      f"keyring was written under: all {held} encrypted entries are misses",
                      "configure the right master key; if it is lost, the entries are too "
                      "(docs/runbook.md, key loss)")]
    imported = sum(len(vs) for vs in doc["imported_keys"].values())
    out = [Check("encryption.master_key", "ok",
                 f"encrypted: master key {doc['master_key']['key_id']}, {doc['tenants']} "
                 f"tenants, entries by key version {doc['entries_by_version']}"
                 + (f", {imported} key version(s) imported from archives "
                    f"{doc['imported_keys']}" if imported else ""))]
    if doc["unreadable_entries"]:
        out.append(Check("encryption.unreadable", "warn",
                         f"{doc['unreadable_entries']} entries are under revoked or retired "
                         "keys (misses)", "reclaim them: spoolctl clean --released"))
    return out
