"""The connector's directory names: ``<deployment>/rank-NNNN``: the one parser and formatter.

Both patterns are ASCII only and matched whole: ``\\d`` would read Arabic-Indic digits as a
rank and ``$`` would accept a trailing newline, making two directories stand for one rank.
"""

from __future__ import annotations

import re

MAX_RANKS = 10_000
# Patterns to embed in larger ones (archive member names, metric labels); [0-9] is ASCII.
RANK_DIGITS = "[0-9]{4}"
DEPLOYMENT_NAME = "[A-Za-z0-9][A-Za-z0-9._-]{0,127}"

_RANK_DIR = re.compile(rf"rank-({RANK_DIGITS})", re.ASCII)
_DEPLOYMENT = re.compile(DEPLOYMENT_NAME, re.ASCII)


def rank_dirname(rank: int) -> str:
    """``rank-NNNN`` for global rank ``rank`` (0..9999); ValueError otherwise."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_RANKS:
        raise ValueError(f"rank {rank!r} does not fit a rank-NNNN directory name")
    return f"rank-{rank:04d}"


def parse_rank_dirname(name: str) -> int | None:
    """The rank a ``rank-NNNN`` directory name stands for (four ASCII digits, nothing
    before or after), else None."""
    match = _RANK_DIR.fullmatch(name) if isinstance(name, str) else None
    return int(match.group(1)) if match else None


def is_deployment_name(name: str) -> bool:
    """True for a name an archive place and a metric label can carry (letters, digits,
    ``.``, ``_``, ``-``; the connector names them by a digest)."""
    return isinstance(name, str) and _DEPLOYMENT.fullmatch(name) is not None
