"""The spool store: a crash-safe, verified, bounded cache store on local disk.

Public API (stable; everything else in this package is internal)::

    from spoolctl.store import Store
    with Store.open("/var/cache/spoolctl", create=True, max_bytes=200 << 30) as store:
        m = store.put(kind="pytorch", namespace="model-x", key="abc", objects={"kv": data})
        hit = store.lookup("pytorch", "model-x", "abc")      # Manifest | None
        payload = store.read(hit, "kv")                       # verified bytes
        store.release(hit.entry_id)                           # hint: out of reuse now
        store.clean_released()                                # bytes deleted
        facts = store.facts()                                 # status/metrics snapshot

    with Store.open(path, read_only=True) as store:          # a cache this user cannot
        store.lookup(...); store.read(...)                    # write: reads only

Bad arguments raise the store's own errors (ConfigError, InvalidIdError) before anything
is written; see ``Store.put``.

Importing this package never imports torch, vllm, mlx or google-genai.
"""

from .catalog import CatalogRow, Totals
from .clean import CLEAN_STEPS, CleanReport
from .errors import (
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
from .facts import StoreFacts
from .gc import DeleteReport
from .keys import KINDS, entry_id_for, validate_entry_id
from .manifest import Manifest, ObjectRef
from .quarantine import QuarantineItem
from .recovery import ReconcileReport
from .sizes import format_size, parse_duration, parse_rate, parse_size
from .store import Store

__all__ = [
    "CLEAN_STEPS",
    "KINDS",
    "BusyError",
    "CapacityError",
    "CatalogRow",
    "CleanReport",
    "ConfigError",
    "CorruptionError",
    "DeleteReport",
    "InvalidIdError",
    "Manifest",
    "ManifestError",
    "NotFoundError",
    "ObjectRef",
    "QuarantineItem",
    "QuarantineReason",
    "ReadOnlyError",
    "ReconcileReport",
    "RootError",
    "SpoolError",
    "Store",
    "StoreFacts",
    "StoreIOError",
    "Totals",
    "entry_id_for",
    "format_size",
    "parse_duration",
    "parse_rate",
    "parse_size",
    "validate_entry_id",
]
