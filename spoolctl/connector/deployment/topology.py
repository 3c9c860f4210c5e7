"""Rank-local store roots and the same-host quorum rule (pure; no I/O, no frameworks).

Every worker of a deployment writes only its own shard of the KV, under

    <spoolctl_root>/<deployment digest>/rank-<NNNN>/

where the deployment digest is the rank-independent part of the deployment
identity (``identity.for_rank(0, 0).namespace``) and ``NNNN`` is the global rank
``pp_rank * tp_size + tp_rank`` taken from vLLM's parallel config. Nothing about
rank roots is configured by hand, so two deployments (or two TP layouts of one
model) can never share a rank directory, and an operator can always tell which
directory belongs to which rank.

A chunk is a *hit* only when every rank that owns part of its KV (all TP ranks of
all PP stages) holds it: :func:`quorum` folds the per-rank answers.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from spoolctl.store import MAX_RANKS, parse_rank_dirname, rank_dirname


@dataclass(frozen=True)
class RankPlace:
    """One rank's place in the TP x PP grid."""

    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int

    def __post_init__(self) -> None:
        if self.tp_size <= 0 or self.pp_size <= 0:
            raise ValueError("parallel sizes must be positive")
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError("rank outside the parallel topology")
        if self.tp_size * self.pp_size > MAX_RANKS:
            raise ValueError("more than 10000 ranks do not fit the rank-NNNN directory names")

    @property
    def rank(self) -> int:
        """The global rank (PP-major), as vLLM numbers workers."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def dirname(self) -> str:
        return rank_dirname(self.rank)


def all_ranks(tp_size: int, pp_size: int) -> list[RankPlace]:
    """Every rank of the deployment, in global-rank order."""
    return [RankPlace(tp, pp, tp_size, pp_size) for pp in range(pp_size) for tp in range(tp_size)]


def deployment_dir(base: str, digest: str) -> str:
    """``<base>/<digest>``: the directory ``spoolctl status --root`` summarises."""
    if not digest or "/" in digest or digest in (".", ".."):
        raise ValueError("deployment digest must be one path component")
    return os.path.join(base, digest)


def rank_root(base: str, digest: str, place: RankPlace) -> str:
    """The store root of one rank."""
    return os.path.join(deployment_dir(base, digest), place.dirname)


def rank_of_dirname(name: str) -> int | None:
    """The global rank a ``rank-NNNN`` directory name stands for, else None (the store's
    one parser, ``store.rankdirs``: ASCII digits, the whole name)."""
    return parse_rank_dirname(name)


def quorum(per_rank: Iterable[Sequence[bool]], n: int) -> list[bool]:
    """Chunk ``i`` is present only if every rank reports it present (no ranks: nothing is).

    ``per_rank`` yields one list of ``n`` flags per rank; a rank that answered with the
    wrong length is treated as holding nothing (fail closed).
    """
    result: list[bool] | None = None
    for flags in per_rank:
        flags = list(flags) if len(flags) == n else [False] * n
        result = flags if result is None else [a and b for a, b in zip(result, flags, strict=True)]
    return result if result is not None else [False] * n


@dataclass(frozen=True)
class RankDisagreement:
    """How the ranks of one deployment directory differ (what ``status`` flags).

    ``missing_ranks``: gaps in the ``rank-NNNN`` numbering (a rank that never stored or
    whose disk was lost); ``partial``: per rank, how many chunk keys *other* ranks hold
    that it lacks (those chunks are misses for the whole deployment until re-stored).
    """

    ranks: tuple[int, ...]
    missing_ranks: tuple[int, ...]
    complete_keys: int
    partial: dict[int, int]

    @property
    def agree(self) -> bool:
        return not self.missing_ranks and not any(self.partial.values())


def compare_ranks(keys_by_rank: dict[int, set[str]]) -> RankDisagreement:
    """Compare the live chunk keys of each rank (chain keys are the same on every rank)."""
    ranks = tuple(sorted(keys_by_rank))
    expected = range(ranks[-1] + 1) if ranks else range(0)
    missing = tuple(r for r in expected if r not in keys_by_rank)
    union: set[str] = set().union(*keys_by_rank.values()) if keys_by_rank else set()
    common = set.intersection(*keys_by_rank.values()) if keys_by_rank and not missing else set()
    return RankDisagreement(
        ranks=ranks, missing_ranks=missing, complete_keys=len(common),
        partial={r: len(union - keys_by_rank[r]) for r in ranks})


# -- deployment status (what ``spoolctl status`` shows for a deployment directory) ----------


@dataclass(frozen=True)
class RankReport:
    """One rank's store as ``status`` summarises it: its size and its live chunk keys."""

    rank: int
    root: str
    entries: int
    bytes: int
    max_bytes: int | None
    quarantined: int
    chunk_keys: frozenset[str]
    # The rank store's write budget today (``write_budget.LedgerState.to_json``) or the
    # one-line reason its ledger cannot be read (``{"error": ...}``); None without one.
    write_budget: dict[str, Any] | None = None

    def to_json_doc(self) -> dict[str, Any]:
        """Every field as JSON (the chunk keys a sorted list): ``from_json_doc`` inverts it."""
        return {"rank": self.rank, "root": self.root, "entries": self.entries,
                "bytes": self.bytes, "max_bytes": self.max_bytes,
                "quarantined": self.quarantined, "chunk_keys": sorted(self.chunk_keys),
                "write_budget": self.write_budget}

    @staticmethod
    def from_json_doc(doc: dict[str, Any]) -> RankReport:
        return RankReport(**{**doc, "chunk_keys": frozenset(doc["chunk_keys"])})


@dataclass(frozen=True)
class DeploymentStatus:
    """Every rank store of one deployment directory and whether the ranks agree.

    Ranks agree when the rank numbering has no gaps and every rank holds the same live
    chunk keys; a chunk missing on any rank is a miss for the whole deployment.
    """

    deployment: str
    ranks: tuple[RankReport, ...]
    comparison: RankDisagreement
    # The host disk budget (``spoolctl_host_max_size``) recorded for the deployment, so
    # status can set the host's total against it, and why it could not be read.
    host_max_bytes: int | None = None
    host_budget_error: str | None = None
    # Ranks whose store is there but could not be read (status lists their error): they
    # cannot be shown to hold anything, so the ranks do not agree.
    unreadable_ranks: tuple[int, ...] = ()

    @property
    def host_bytes(self) -> int:
        """Bytes of every rank store of the deployment on this host."""
        return sum(r.bytes for r in self.ranks)

    @property
    def agree(self) -> bool:
        return self.comparison.agree and not self.unreadable_ranks

    @property
    def has_findings(self) -> bool:
        """What ``status --check`` flags: disagreeing ranks or quarantined items."""
        return not self.agree or any(r.quarantined for r in self.ranks)

    def to_json(self) -> dict:
        rows = [{"rank": r.rank, "root": r.root, "entries": r.entries, "bytes": r.bytes,
                 "max_bytes": r.max_bytes, "chunks": len(r.chunk_keys),
                 "quarantined": r.quarantined,
                 "missing_chunks": self.comparison.partial[r.rank],
                 "write_budget": r.write_budget} for r in self.ranks]
        host: dict[str, object] = {"bytes": self.host_bytes, "max_bytes": self.host_max_bytes,
                "usage_pct": round(100 * self.host_bytes / self.host_max_bytes, 1)
                if self.host_max_bytes else None}
        if self.host_budget_error is not None:
            host["error"] = self.host_budget_error
        return {"deployment": self.deployment, "ranks": rows, "agree": self.agree,
                "missing_ranks": list(self.comparison.missing_ranks),
                "unreadable_ranks": list(self.unreadable_ranks),
                "complete_chunks": self.comparison.complete_keys, "host": host}


def deployment_status(deployment: str, ranks: Iterable[RankReport], *,
                      host_max_bytes: int | None = None,
                      host_budget_error: str | None = None,
                      unreadable: Iterable[int] = ()) -> DeploymentStatus:
    """Fold per-rank reports into the deployment's status (ranks in rank order);
    ``unreadable``: ranks whose store could not be read."""
    ordered = tuple(sorted(ranks, key=lambda r: r.rank))
    return DeploymentStatus(deployment, ordered,
                            compare_ranks({r.rank: set(r.chunk_keys) for r in ordered}),
                            host_max_bytes=host_max_bytes, host_budget_error=host_budget_error,
                            unreadable_ranks=tuple(sorted(set(unreadable))))
