"""Which entries an export (or a copy from a peer root) takes, in which order (pure).

Entries are taken most recently used first (an export's ``last_access``; a peer root's
manifest ``created``, since its catalog is not read), skipping those that would overflow
``max_bytes`` and continuing with smaller ones, so a size-bounded export holds the newest
entries that fit.

vLLM chunks of a deployment with several ranks are selected as whole chunks (every rank's
shard of one key, sized as their sum): a chunk is only useful when every rank holds its
shard. A key some rank lacks is left out (counted in ``incomplete_chunks``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ...errors import ConfigError
from ..format.keys import validate_kind, validate_namespace
from .archive import deployment_of, rank_of

HINTS = ("retain", "release")


@dataclass(frozen=True)
class Selection:
    """Filters and a size budget. Empty sets mean "all"; ``hint=None`` means any hint."""

    kinds: frozenset[str] = frozenset()
    namespaces: frozenset[str] = frozenset()
    deployments: tuple[str, ...] = ()
    hint: str | None = "retain"
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        for kind in self.kinds:
            validate_kind(kind)
        for ns in self.namespaces:
            validate_namespace(ns)
        if self.hint is not None and self.hint not in HINTS:
            raise ConfigError(f"unknown hint {self.hint!r}", fix="use retain, release or any")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ConfigError("the size budget must be positive", fix="e.g. --max-size 50GiB")

    def wants(self, kind: str, namespace: str, hint: str = "retain") -> bool:
        return (not self.kinds or kind in self.kinds) and \
            (not self.namespaces or namespace in self.namespaces) and \
            (self.hint is None or hint == self.hint)


#: The shortest ``--deployment`` prefix taken (a unique one; every name starts ``vllm-v1-``,
#: so a shorter prefix than the digest can only match when one deployment is there).
MIN_DEPLOYMENT_PREFIX = 4


def resolve_deployment(text: str, available: Iterable[str]) -> str:
    """The one deployment of ``available`` that ``--deployment text`` names: the full
    directory name or a unique prefix of at least ``MIN_DEPLOYMENT_PREFIX`` characters.
    ConfigError for no or several matches."""
    avail = sorted(set(available))
    matches = [d for d in avail if d == text] or \
        ([d for d in avail if d.startswith(text)] if len(text) >= MIN_DEPLOYMENT_PREFIX else [])
    if len(matches) != 1:
        what = "matches more than one" if matches else "matches no"
        raise ConfigError(f"--deployment {text[:64]!r} {what} deployment directory",
                          fix="use one of: " + (", ".join(avail[:10]) or "none here"))
    return matches[0]


def resolve_deployments(given: Iterable[str], available: Iterable[str]) -> set[str]:
    """``resolve_deployment`` for each value of ``given``."""
    avail = sorted(set(available))
    return {resolve_deployment(text, avail) for text in given}


@dataclass(frozen=True)
class Candidate:
    """One entry that may be selected: where it lives and what the catalog says of it."""

    place: str
    entry_id: str
    kind: str
    namespace: str
    key: str
    size: int
    time: float
    hint: str = "retain"


@dataclass
class Plan:
    """The selected entries in archive order, and what was left out."""

    parts: list[Candidate] = field(default_factory=list)
    bytes: int = 0
    over_budget: int = 0
    incomplete_chunks: int = 0
    filtered: int = 0

    def by_place(self) -> dict[str, list[Candidate]]:
        out: dict[str, list[Candidate]] = defaultdict(list)
        for c in self.parts:
            out[c.place].append(c)
        return out


def plan(candidates: Mapping[str, Iterable[Candidate]], selection: Selection, *,
         quorum: bool) -> Plan:
    """Select from ``candidates`` (per place). ``quorum``: the places are every rank store of
    their deployments (an exported deployment directory or connector root), so vLLM chunks
    are taken only where every rank ``0..max`` holds a shard."""
    result = Plan()
    units: list[tuple[float, int, list[Candidate]]] = []
    by_deployment: dict[str, dict[int, dict[str, Candidate]]] = defaultdict(dict)
    for place in candidates:
        dep, rank = deployment_of(place), rank_of(place)
        if quorum and dep is not None and rank is not None:
            by_deployment[dep][rank] = {}  # every rank store found, even an empty one
    for place, items in candidates.items():
        dep, rank = deployment_of(place), rank_of(place)
        for c in items:
            if not selection.wants(c.kind, c.namespace, c.hint):
                result.filtered += 1
            elif quorum and dep is not None and rank is not None and c.kind == "vllm":
                by_deployment[dep][rank][c.key] = c
            else:
                units.append((c.time, c.size, [c]))
    for ranks in by_deployment.values():
        expected = range(max(ranks) + 1)
        keys: set[str] = set().union(*(r.keys() for r in ranks.values()))
        for key in keys:
            shards = [ranks[r].get(key) for r in expected if r in ranks]
            if len(shards) != len(expected) or any(s is None for s in shards):
                result.incomplete_chunks += 1
                continue
            parts = [s for s in shards if s is not None]
            units.append((max(p.time for p in parts), sum(p.size for p in parts), parts))
    # Most recent first; ties by entry id so the order is deterministic.
    units.sort(key=lambda u: (-u[0], u[2][0].entry_id))
    for _time, size, parts in units:
        if selection.max_bytes is not None and result.bytes + size > selection.max_bytes:
            result.over_budget += len(parts)
            continue
        result.parts.extend(parts)
        result.bytes += size
    return result
