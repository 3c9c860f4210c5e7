"""Connector settings parsed from ``kv_connector_extra_config`` (pure; no I/O).

Keys (all optional except the root):

``spoolctl_root``            absolute base directory (default: the ``SPOOLCTL_ROOT`` variable);
                             each rank's store is ``<root>/<deployment digest>/rank-<NNNN>``,
                             derived from vLLM's parallel config (see ``topology``)
``spoolctl_roots``           several base directories, one per drive (``["/nvme0/spool",
                             "/nvme1/spool"]``; or ``SPOOLCTL_ROOT`` with ':' between them):
                             a rank store on each, chunks placed by ``drives``;
                             not together with ``spoolctl_root``
``spoolctl_max_size``        store capacity, e.g. ``200GiB`` (recorded in the root marker)
``spoolctl_chunk_tokens``    tokens per chunk; a multiple of the block size (default: the
                             smallest multiple of the block size that is >= 256)
``spoolctl_staging_bytes``   host memory for captured chunks waiting to be written
                             (default 512MiB); a store that does not fit is skipped
``spoolctl_scrub_rate``      background scrub rate, e.g. ``32MiB/s`` (``0`` disables)
``spoolctl_maintenance_interval``  seconds between maintenance passes (default 60)
``spoolctl_on_unsupported``  ``error`` (default: refuse to start) or ``disable`` (serve without
                             persistent reuse) for a KV layout the connector cannot persist
``spoolctl_inventory``       how the scheduler learns what each rank holds: ``auto`` (default:
                             read the catalogs of ranks on its own host, use the workers'
                             inventory reports for the others) or ``reported`` (reports for
                             every rank, as if each were on another host)
``spoolctl_host_max_size``   one disk budget for all rank stores of the deployment on a host
                             (``host_budget``); ``spoolctl_max_size`` still bounds each rank
``spoolctl_admit_after``     store a chunk only once this many requests within the window
                             contained it (default 1: on its first sighting; ``admission``)
``spoolctl_admit_window``    that window, e.g. ``10m`` or seconds (default 600)
``spoolctl_kv_events``       ``on`` (default: publish the spool tier's KV events for routers
                             when vLLM's ``kv_events_config`` enables events) or ``off``
``spoolctl_tag_key_file``    absolute path of the tag key file (``store.entry_tags``): every
                             chunk is tagged when stored and its tag checked on restore
                             (default: ``SPOOLCTL_TAG_KEY_FILE`` / ``SPOOLCTL_TAG_KEY``; none:
                             digests only). Read by the worker and the scheduler at start-up.
``spoolctl_weights_id``      a name the operator vouches changes whenever the model's files do
                             (e.g. a release tag), used instead of the weights digest; needed
                             only for a model that is not a local directory or hub cache snapshot
``spoolctl_lookup_deadline`` seconds a lookup waits for a rank store's catalog on this host
                             (default 0.5; past it the request is a miss)
``spoolctl_read_deadline``   seconds a restore waits for its next chunk (default 5; past it
                             that chunk and the rest are recomputed)
``spoolctl_probe_interval``  seconds between probes of a store taken out of service after
                             repeated late or failed reads (default 5)
``spoolctl_write_budget``    KV bytes each rank store may write per UTC day, e.g. ``500GiB``
                             (default: no limit); enforced by admission, counted across
                             restarts (``write_budget``)
``spoolctl_tenant_metrics``  per-tenant metrics on an encrypted store (``tenancy``): the most
                             tenant ids labelled per role (default 32; later tenants count as
                             ``other``; 0: none)
``spoolctl_weights_memo``    directory remembering file digests by file identity (default
                             ``~/.cache/spoolctl/weights``; ``off``: hash every file at each
                             start) (``weights``)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from spoolctl.errors import ConfigError
from spoolctl.metrics import PATTERN_LABELS
from spoolctl.store import MARKER, TagKey, parse_duration, parse_rate, parse_size

from ..diskguard import (
    DEFAULT_LOOKUP_DEADLINE_S,
    DEFAULT_PROBE_INTERVAL_S,
    DEFAULT_READ_DEADLINE_S,
    bounded,
)
from .topology import RankPlace, rank_root

# What a drive's base root must look like to label ``spoolctl_drive_*{drive}``.
DRIVE_LABEL = PATTERN_LABELS["drive"]

DEFAULT_CHUNK_TOKENS = 256
DEFAULT_STAGING_BYTES = 512 << 20
DEFAULT_SCRUB_RATE = 32 << 20
DEFAULT_MAINTENANCE_INTERVAL = 60.0
DEFAULT_ADMIT_WINDOW = 600.0
DEFAULT_TENANT_METRICS = 32
KNOWN_KEYS = frozenset({
    "spoolctl_root", "spoolctl_max_size", "spoolctl_chunk_tokens", "spoolctl_staging_bytes",
    "spoolctl_scrub_rate", "spoolctl_maintenance_interval", "spoolctl_on_unsupported",
    "spoolctl_inventory", "spoolctl_host_max_size", "spoolctl_admit_after",
    "spoolctl_admit_window", "spoolctl_kv_events", "spoolctl_tag_key_file",
    "spoolctl_weights_id", "spoolctl_weights_memo", "spoolctl_lookup_deadline",
    "spoolctl_read_deadline", "spoolctl_probe_interval", "spoolctl_write_budget",
    "spoolctl_tenant_metrics", "spoolctl_roots",
})
# The most drive roots one connector takes (a metric label per drive: bounded).
MAX_ROOTS = 64
ON_UNSUPPORTED = ("error", "disable")
INVENTORY_MODES = ("auto", "reported")
KV_EVENTS = ("on", "off")
_WHERE = "kv_connector_extra_config"


@dataclass(frozen=True)
class ConnectorSettings:
    """Validated connector settings. ``roots``: the base directories (one per drive) of
    every rank's stores; ``root`` is the first, for the code that needs one directory."""

    root: str
    chunk_tokens: int
    max_bytes: int | None = None
    staging_bytes: int = DEFAULT_STAGING_BYTES
    scrub_rate: int = DEFAULT_SCRUB_RATE
    maintenance_interval: float = DEFAULT_MAINTENANCE_INTERVAL
    on_unsupported: str = "error"
    inventory: str = "auto"
    host_max_bytes: int | None = None
    admit_after: int = 1
    admit_window: float = DEFAULT_ADMIT_WINDOW
    kv_events: str = "on"
    tag_key_file: str | None = None
    # The operator's name for the weights (replaces the digest), and the digest memo
    # directory: None = the default, "off" = none.
    weights_id: str | None = None
    weights_memo: str | None = None
    # A slow or failing disk turns into misses (``diskguard``).
    lookup_deadline: float = DEFAULT_LOOKUP_DEADLINE_S
    read_deadline: float = DEFAULT_READ_DEADLINE_S
    probe_interval: float = DEFAULT_PROBE_INTERVAL_S
    # KV bytes a rank store may write per UTC day (``write_budget``).
    write_budget: int | None = None
    # Tenant ids labelled in the per-tenant metrics, per role (the rest are "other").
    tenant_metrics: int = DEFAULT_TENANT_METRICS
    # Every base root, ``root`` first (empty when built by hand: ``(root,)``)
    roots: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.roots:
            object.__setattr__(self, "roots", (self.root,))
        elif self.roots[0] != self.root:
            raise ValueError("roots must start with root")
        if not 0 <= self.tenant_metrics <= 1024:
            raise ConfigError("spoolctl_tenant_metrics must be 0..1024", path=_WHERE,
                              fix="set how many tenants get their own label, e.g. 32 (0: none)")
        for name in ("lookup_deadline", "read_deadline", "probe_interval"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"spoolctl_{name} must be a positive number of seconds",
                                  path=_WHERE, fix=f"set spoolctl_{name} to e.g. "
                                  f"{getattr(ConnectorSettings, name)}")
        if self.write_budget is not None and self.write_budget <= 0:
            raise ConfigError("spoolctl_write_budget must be positive", path=_WHERE,
                              fix="set the bytes a drive may take per day, e.g. 500GiB, "
                                  "or drop it for no limit")
        if self.tag_key_file is not None and not os.path.isabs(self.tag_key_file):
            raise ConfigError("spoolctl_tag_key_file must be an absolute path", path=_WHERE,
                              fix="give the full path of the key file")
        if self.weights_id is not None and not self.weights_id.strip():
            raise ConfigError("spoolctl_weights_id must not be empty", path=_WHERE,
                              fix="drop it (the weights are then hashed) or give a name that "
                                  "changes whenever the weights do")
        if self.weights_memo not in (None, "off") and not os.path.isabs(self.weights_memo):
            raise ConfigError("spoolctl_weights_memo must be an absolute path or off",
                              path=_WHERE, fix="give the full path of a private directory")
        if self.kv_events not in KV_EVENTS:
            raise ConfigError(f"spoolctl_kv_events={self.kv_events[:20]!r} is not one of on, "
                              "off", path=_WHERE, fix='set "spoolctl_kv_events" to "on" or "off"')
        if self.admit_after < 1:
            raise ConfigError("spoolctl_admit_after must be at least 1", path=_WHERE,
                              fix="set 1 to store on the first sighting, 2 on the second, ...")
        if self.admit_window <= 0:
            raise ConfigError("spoolctl_admit_window must be positive", path=_WHERE,
                              fix="set a duration, e.g. 10m")
        if self.host_max_bytes is not None and self.host_max_bytes <= 0:
            raise ConfigError("spoolctl_host_max_size must be positive", path=_WHERE,
                              fix="set a size, e.g. 400GiB")
        if self.inventory not in INVENTORY_MODES:
            raise ConfigError(f"spoolctl_inventory={self.inventory[:20]!r} is not one of "
                              "auto, reported", path=_WHERE,
                              fix='set "spoolctl_inventory" to "auto" or "reported"')
        if self.on_unsupported not in ON_UNSUPPORTED:
            raise ConfigError(f"spoolctl_on_unsupported={self.on_unsupported[:20]!r} is not "
                              "one of error, disable", path=_WHERE,
                              fix='set "spoolctl_on_unsupported" to "error" or "disable"')
        if self.chunk_tokens <= 0:
            raise ConfigError("spoolctl_chunk_tokens must be positive", path=_WHERE,
                              fix="set it to a multiple of the block size, e.g. 256")
        if self.staging_bytes <= 0:
            raise ConfigError("spoolctl_staging_bytes must be positive", path=_WHERE,
                              fix="set e.g. 512MiB")
        if self.maintenance_interval <= 0:
            raise ConfigError("spoolctl_maintenance_interval must be positive", path=_WHERE,
                              fix="set a number of seconds, e.g. 60")

    def root_for(self, *, digest: str, place: RankPlace) -> str:
        """The store root of one rank: ``<root>/<digest>/rank-<NNNN>``, checked absolute."""
        if not os.path.isabs(self.root):
            raise ConfigError("spoolctl_root must be an absolute path", path=self.root,
                              fix="give the full path of the base directory for rank stores")
        return rank_root(self.root, digest, place)

    def tag_key(self) -> TagKey | None:
        """The tag key: from ``spoolctl_tag_key_file`` when set, else the environment's
        (``TagKey.from_environment``); None when neither configures one. Reads the file."""
        if self.tag_key_file is not None:
            return TagKey.from_file(self.tag_key_file)
        return TagKey.from_environment()


def parse_settings(
    extra: Mapping[str, Any] | None, *, block_size: int, env: Mapping[str, str] | None = None
) -> ConnectorSettings:
    """Build settings from vLLM's ``kv_connector_extra_config``; ConfigError on bad input."""
    extra = dict(extra or {})
    env = os.environ if env is None else env
    unknown = sorted(k for k in extra if k.startswith("spoolctl_") and k not in KNOWN_KEYS)
    if unknown:
        raise ConfigError(f"unknown connector option {unknown[0]!r}", path=_WHERE,
                          fix=f"use one of: {', '.join(sorted(KNOWN_KEYS))}")
    roots, given = _roots(extra, env)
    lookup_deadline = _optional(extra, "spoolctl_lookup_deadline", _seconds,
                                DEFAULT_LOOKUP_DEADLINE_S)
    for root in roots:
        if "{" in root or "}" in root:
            raise ConfigError(f"{given} must not hold rank placeholders", path=root,
                              fix="give one base directory; each rank's store is placed under "
                                  "<root>/<deployment digest>/rank-<NNNN> automatically")
        # A hung disk must not hang the engine's start: a root that does not answer in
        # time is checked again by ``drives.opening`` before a store is opened under it.
        if store_root_answer(root, 4 * lookup_deadline) is True:
            # One meaning for SPOOLCTL_ROOT: a root the CLI's --root also
            # takes. A single store is such a root, but the connector's stores go *under*
            # its root.
            raise single_store_error(given, root)
    root = roots[0]
    if block_size <= 0:
        raise ConfigError("vLLM block size must be positive", path="cache_config.block_size")
    chunk = extra.get("spoolctl_chunk_tokens")
    if chunk is None:
        chunk_tokens = -(-DEFAULT_CHUNK_TOKENS // block_size) * block_size
    else:
        chunk_tokens = _int(chunk, "spoolctl_chunk_tokens")
        if chunk_tokens <= 0 or chunk_tokens % block_size:
            raise ConfigError(
                f"spoolctl_chunk_tokens={chunk_tokens} is not a multiple of the block size "
                f"{block_size}", path=_WHERE,
                fix=f"use a positive multiple of {block_size}, e.g. "
                    f"{-(-DEFAULT_CHUNK_TOKENS // block_size) * block_size}")
    max_size = extra.get("spoolctl_max_size")
    staging = extra.get("spoolctl_staging_bytes")
    scrub = extra.get("spoolctl_scrub_rate")
    interval = extra.get("spoolctl_maintenance_interval")
    return ConnectorSettings(
        root=root,
        roots=roots,
        chunk_tokens=chunk_tokens,
        max_bytes=parse_size(max_size) if max_size not in (None, "") else None,
        staging_bytes=parse_size(staging) if staging not in (None, "") else DEFAULT_STAGING_BYTES,
        scrub_rate=(0 if str(scrub).strip() in ("0", "off") else parse_rate(str(scrub)))
        if scrub not in (None, "") else DEFAULT_SCRUB_RATE,
        maintenance_interval=float(interval) if interval not in (None, "")
        else DEFAULT_MAINTENANCE_INTERVAL,
        on_unsupported=str(extra.get("spoolctl_on_unsupported") or "error"),
        inventory=str(extra.get("spoolctl_inventory") or "auto"),
        host_max_bytes=_optional(extra, "spoolctl_host_max_size", parse_size),
        admit_after=_int(extra.get("spoolctl_admit_after", 1), "spoolctl_admit_after"),
        admit_window=_optional(extra, "spoolctl_admit_window", _seconds,
                               DEFAULT_ADMIT_WINDOW),
        kv_events=str(extra.get("spoolctl_kv_events") or "on"),
        tag_key_file=_optional(extra, "spoolctl_tag_key_file", str),
        weights_id=None if extra.get("spoolctl_weights_id") is None
        else str(extra["spoolctl_weights_id"]),
        weights_memo=_optional(extra, "spoolctl_weights_memo", str),
        lookup_deadline=lookup_deadline,
        read_deadline=_optional(extra, "spoolctl_read_deadline", _seconds,
                                DEFAULT_READ_DEADLINE_S),
        probe_interval=_optional(extra, "spoolctl_probe_interval", _seconds,
                                 DEFAULT_PROBE_INTERVAL_S),
        write_budget=_optional(extra, "spoolctl_write_budget", parse_size),
        tenant_metrics=_int(extra.get("spoolctl_tenant_metrics", DEFAULT_TENANT_METRICS),
                            "spoolctl_tenant_metrics"),
    )


def _roots(extra: Mapping[str, Any], env: Mapping[str, str]) -> tuple[tuple[str, ...], str]:
    """The base roots and the name they were given by (``spoolctl_root``,
    ``spoolctl_roots`` or ``SPOOLCTL_ROOT``); ConfigError, one line naming the fix, for a
    refused list. The variable is read only when neither key is given."""
    one, several = extra.get("spoolctl_root"), extra.get("spoolctl_roots")
    if one not in (None, "") and several not in (None, ""):
        raise ConfigError("spoolctl_root and spoolctl_roots are both set", path=_WHERE,
                          fix='keep one: "spoolctl_roots" lists every drive\'s base root, '
                              'the first included')
    if several not in (None, ""):
        given = "spoolctl_roots"
        if isinstance(several, str) or not isinstance(several, (list, tuple)) or \
                not all(isinstance(r, str) for r in several):
            raise ConfigError("spoolctl_roots must be a list of directories", path=_WHERE,
                              fix='set e.g. "spoolctl_roots": ["/nvme0/spool", '
                                  '"/nvme1/spool"]')
        roots = list(several)
    else:
        value = one or env.get("SPOOLCTL_ROOT")
        if not value or not isinstance(value, str):
            raise ConfigError("no store root configured for the spoolctl connector",
                              path=_WHERE,
                              fix='set "spoolctl_root": "/abs/path" (or SPOOLCTL_ROOT)')
        if one:
            given, roots = "spoolctl_root", [value]
        else:
            # The CLI's reading of the variable: ':' between drive roots.
            given, roots = "SPOOLCTL_ROOT", value.split(":")
    if not roots:
        raise ConfigError(f"{given} is empty", path=_WHERE,
                          fix="list at least one base directory, one per drive")
    if len(roots) > MAX_ROOTS:
        raise ConfigError(f"{given} names {len(roots)} roots; the connector takes at most "
                          f"{MAX_ROOTS}", path="SPOOLCTL_ROOT (environment)"
                          if given == "SPOOLCTL_ROOT" else _WHERE,
                          fix=f"list at most {MAX_ROOTS} drives (one base root per drive)")
    # A refusal of the variable names the variable, not the extra config it was not in.
    where = "SPOOLCTL_ROOT (environment)" if given == "SPOOLCTL_ROOT" else _WHERE
    seen: dict[str, str] = {}
    for root in roots:
        if not root:
            raise ConfigError(f"{given} has an empty root", path=where,
                              fix="separate the drive roots by single ':' (SPOOLCTL_ROOT) "
                                  "or drop the empty entry")
        if root != root.strip():
            # Almost always a quoting slip ("/nvme0/spool, /nvme1/spool"): a directory
            # named with a trailing space would be created beside the one meant.
            raise ConfigError(f"{given} has a root with spaces around it ({root!r})",
                              path=where, fix="remove the spaces around each root")
        if not os.path.isabs(root):
            raise ConfigError(f"{given} must hold absolute paths", path=root,
                              fix="give the full path of each base directory")
        norm = os.path.normpath(root)
        if norm in seen:
            raise ConfigError(f"{given} names one root twice ({seen[norm]} and {root})",
                              path=root, fix="name each drive's base root once")
        seen[norm] = root
        if len(roots) > 1 and not DRIVE_LABEL.fullmatch(root):
            # Its base root labels the per-drive metrics, as the CLI's
            # `metrics --root` requires: a label outside the vocabulary would be refused at
            # the first failover, on the engine's thread.
            raise ConfigError(f"{given} has a root that cannot label the per-drive metrics "
                              f"({root!r})", path=where,
                              fix="give each drive's base root as a path of printable "
                                  "characters (no control characters, valid UTF-8)")
    return tuple(roots), given


def store_root_answer(root: str, bound_s: float) -> bool | None:
    """Whether ``root`` itself is a store (holds its marker); None when the disk did not
    answer within ``bound_s`` (a hung mount: the caller checks again later)."""
    done, found = bounded(lambda: os.path.lexists(os.path.join(root, MARKER)), bound_s)
    return found if done else None


def single_store_error(given: str, root: str) -> ConfigError:
    """The refusal of a base root that is itself a store."""
    key = "spoolctl_roots" if given == "spoolctl_roots" else "spoolctl_root"
    return ConfigError(f"{given} is a single store (it holds {MARKER}); the connector keeps "
                       "its <deployment>/rank-NNNN stores under a base directory",
                       path=root, fix=f'set "{key}" to a directory of its own, '
                                      "e.g. /var/cache/spoolctl/vllm")


def _optional(extra: Mapping[str, Any], name: str, parse: Any, default: Any = None) -> Any:
    value = extra.get(name)
    return default if value in (None, "") else parse(value)


def _seconds(value: Any) -> float:
    """A duration: a number of seconds or ``90s``/``15m``/``6h``..."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    try:
        return float(str(value))  # "0.05": fractions of a second
    except ValueError:
        return parse_duration(str(value))


def _int(value: Any, name: str) -> int:
    try:
        if isinstance(value, bool):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be an integer, got {str(value)[:40]!r}",
                          path=_WHERE, fix=f"set {name} to a whole number") from None
