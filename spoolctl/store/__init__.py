"""The spool store: a crash-safe, verified, bounded cache store on local disk.

Public API (stable; everything else in this package is internal)::

    from spoolctl.store import PutRequest, Store
    with Store.open("/var/cache/spoolctl", create=True, max_bytes=200 << 30) as store:
        m = store.put(kind="pytorch", namespace="model-x", key="abc", objects={"kv": data})
        outcomes = store.put_many(                            # many entries, one
            [PutRequest("vllm", "model-x", k, {"kv": b}) for k, b in chunks])  # group commit
        hit = store.lookup("pytorch", "model-x", "abc")      # Manifest | None
        payload = store.read(hit, "kv")                       # verified bytes
        store.release(hit.entry_id)                           # hint: out of reuse now
        store.clean_released()                                # bytes deleted
        facts = store.facts()                                 # status/metrics snapshot

    with Store.open(path, read_only=True) as store:          # a cache this user cannot
        store.lookup(...); store.read(...)                    # write: reads only

Bad arguments raise the store's own errors (ConfigError, InvalidIdError) before anything
is written; see ``Store.put``. ``put_many`` reports them per entry (``PutOutcome.error``).

Importing this package never imports torch, vllm, mlx or google-genai.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ..errors import (
    BusyError,
    CapacityError,
    ConfigError,
    CorruptionError,
    InvalidIdError,
    ManifestError,
    NotFoundError,
    QuarantineReason,
    ReadOnlyError,
    RootError,
    SpoolError,
    StoreIOError,
)

# Each public name is loaded from its module on first use (PEP 562), so a process that
# needs only part of the store (``spoolctl --help``, a command on one subsystem, the
# connector's scheduler) does not import the rest: the transfer, scrub and doctor modules,
# the catalog and its SQLite are each imported by the first name that needs them. The
# import statements below are the same names for type checkers and for the layer contracts
# (.importlinter); ``_LAZY`` must list exactly them (tests/test_startup.py).
if TYPE_CHECKING:
    from .catalog.index import CatalogRow, Totals
    from .catalog.rows import MalformedRow
    from .commit.committer import PutOutcome, PutRequest
    from .disk.fsio import SpecialFileError, fsync_dir, read_small, write_tmp
    from .disk.locks import hold
    from .disk.progress import install_progress_sink
    from .disk.root import ALLOW_FOREIGN_ENV, MARKER, check_root_path
    from .facts import StoreFacts
    from .format.digest import Hasher, hash_bytes, hash_parts
    from .format.entry_tags import TagKey
    from .format.keys import (
        KINDS,
        MAX_KEY_LEN,
        entry_id_for,
        validate_entry_id,
        validate_entry_prefix,
        validate_kind,
    )
    from .format.manifest import Manifest, ObjectRef
    from .format.rankdirs import (
        DEPLOYMENT_NAME,
        MAX_RANKS,
        RANK_DIGITS,
        parse_rank_dirname,
        rank_dirname,
    )
    from .format.sizes import format_size, parse_duration, parse_rate, parse_size
    from .maintain.auth_requests import AuthQueue, authenticate
    from .maintain.clean import CLEAN_STEPS, CleanReport
    from .maintain.doctor import filesystem_type, run_checks
    from .maintain.doctor_scan import Check
    from .maintain.gc import DeleteReport
    from .maintain.maintainer import BackgroundMaintainer
    from .maintain.quarantine import QuarantineItem, validate_item_id
    from .maintain.recovery import ReconcileReport
    from .maintain.scrub import Scrubber
    from .maintain.staleness import DeploymentUse, Verdict, judge
    from .sealing import MasterKey, TenantId, TenantNames, plain_size, refuse_encrypted
    from .store import Store
    from .tenant_keys import (
        encryption_checks,
        encryption_summary,
        key_usage,
        retire_keys,
        revoke_tenant,
        rotate_keys,
        tenant_from_argument,
    )
    from .transfer.archive import FdSink, deployment_of, rank_of
    from .transfer.archive_sign import (
        SigningSink,
        load_signing_key,
        load_verify_key,
        sign_archive,
        verified_copy,
        verified_stream_copy,
    )
    from .transfer.exporter import export
    from .transfer.importer import Importer
    from .transfer.peer import import_from_root
    from .transfer.places import Kind, RootContents, StorePlace, inspect_root
    from .transfer.selection import Selection, resolve_deployment

_LAZY: dict[str, tuple[str, ...]] = {
    ".catalog.index": ("CatalogRow", "Totals"),
    ".catalog.rows": ("MalformedRow",),
    ".commit.committer": ("PutOutcome", "PutRequest"),
    ".disk.fsio": ("SpecialFileError", "fsync_dir", "read_small", "write_tmp"),
    ".disk.progress": ("install_progress_sink",),
    ".disk.locks": ("hold",),
    ".disk.root": ("ALLOW_FOREIGN_ENV", "MARKER", "check_root_path"),
    ".facts": ("StoreFacts",),
    ".format.digest": ("Hasher", "hash_bytes", "hash_parts"),
    ".format.entry_tags": ("TagKey",),
    ".format.keys": (
        "KINDS", "MAX_KEY_LEN", "entry_id_for", "validate_entry_id", "validate_entry_prefix",
        "validate_kind",
    ),
    ".format.manifest": ("Manifest", "ObjectRef"),
    ".format.rankdirs": (
        "DEPLOYMENT_NAME", "MAX_RANKS", "RANK_DIGITS", "parse_rank_dirname", "rank_dirname",
    ),
    ".format.sizes": ("format_size", "parse_duration", "parse_rate", "parse_size"),
    ".maintain.auth_requests": ("AuthQueue", "authenticate"),
    ".maintain.clean": ("CLEAN_STEPS", "CleanReport"),
    ".maintain.doctor": ("filesystem_type", "run_checks"),
    ".maintain.doctor_scan": ("Check",),
    ".maintain.gc": ("DeleteReport",),
    ".maintain.maintainer": ("BackgroundMaintainer",),
    ".maintain.quarantine": ("QuarantineItem", "validate_item_id"),
    ".maintain.recovery": ("ReconcileReport",),
    ".maintain.scrub": ("Scrubber",),
    ".maintain.staleness": ("DeploymentUse", "Verdict", "judge"),
    ".sealing": ("MasterKey", "TenantId", "TenantNames", "plain_size", "refuse_encrypted"),
    ".store": ("Store",),
    ".tenant_keys": (
        "encryption_checks", "encryption_summary", "key_usage", "retire_keys", "revoke_tenant",
        "rotate_keys", "tenant_from_argument",
    ),
    ".transfer.archive": ("FdSink", "deployment_of", "rank_of"),
    ".transfer.archive_sign": (
        "SigningSink", "load_signing_key", "load_verify_key", "sign_archive", "verified_copy",
        "verified_stream_copy",
    ),
    ".transfer.exporter": ("export",),
    ".transfer.importer": ("Importer",),
    ".transfer.peer": ("import_from_root",),
    ".transfer.places": ("Kind", "RootContents", "StorePlace", "inspect_root"),
    ".transfer.selection": ("Selection", "resolve_deployment"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    """Import the module that defines public name ``name`` and cache the name here."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = [
    "ALLOW_FOREIGN_ENV",
    "CLEAN_STEPS",
    "DEPLOYMENT_NAME",
    "KINDS",
    "MARKER",
    "MAX_KEY_LEN",
    "MAX_RANKS",
    "RANK_DIGITS",
    "AuthQueue",
    "BackgroundMaintainer",
    "BusyError",
    "CapacityError",
    "CatalogRow",
    "Check",
    "CleanReport",
    "ConfigError",
    "CorruptionError",
    "DeleteReport",
    "DeploymentUse",
    "FdSink",
    "Hasher",
    "Importer",
    "InvalidIdError",
    "Kind",
    "MalformedRow",
    "Manifest",
    "ManifestError",
    "MasterKey",
    "NotFoundError",
    "ObjectRef",
    "PutOutcome",
    "PutRequest",
    "QuarantineItem",
    "QuarantineReason",
    "ReadOnlyError",
    "ReconcileReport",
    "RootContents",
    "RootError",
    "Scrubber",
    "Selection",
    "SigningSink",
    "SpecialFileError",
    "SpoolError",
    "Store",
    "StoreFacts",
    "StoreIOError",
    "StorePlace",
    "TagKey",
    "TenantId",
    "TenantNames",
    "Totals",
    "Verdict",
    "authenticate",
    "check_root_path",
    "deployment_of",
    "encryption_checks",
    "encryption_summary",
    "entry_id_for",
    "export",
    "filesystem_type",
    "format_size",
    "fsync_dir",
    "hash_bytes",
    "hash_parts",
    "hold",
    "import_from_root",
    "inspect_root",
    "install_progress_sink",
    "judge",
    "key_usage",
    "load_signing_key",
    "load_verify_key",
    "parse_duration",
    "parse_rank_dirname",
    "parse_rate",
    "parse_size",
    "plain_size",
    "rank_dirname",
    "rank_of",
    "read_small",
    "refuse_encrypted",
    "resolve_deployment",
    "retire_keys",
    "revoke_tenant",
    "rotate_keys",
    "run_checks",
    "sign_archive",
    "tenant_from_argument",
    "validate_entry_id",
    "validate_entry_prefix",
    "validate_item_id",
    "validate_kind",
    "verified_copy",
    "verified_stream_copy",
    "write_tmp",
]
