"""Timestamps from the future.

A clock that ran ahead stamps times that later lie in the future; taken at face value they
would protect what they stamp forever (an orphan never old enough, an entry always most
recently used). Such a time protects nothing. ``FUTURE_SLACK`` absorbs small clock skew.
"""

from __future__ import annotations

import math

FUTURE_SLACK = 300.0  # seconds a timestamp may lie ahead of now and still be trusted


def is_future(t: float, now: float) -> bool:
    """True if ``t`` lies further ahead of ``now`` than the slack allows."""
    return t > now + FUTURE_SLACK


def age(t: float, now: float) -> float:
    """Seconds since ``t``: never negative; infinite for a time from the future (it
    vouches for nothing, so any minimum age is met)."""
    if is_future(t, now):
        return math.inf
    return max(now - t, 0.0)
