"""Timestamps from the future (issue 30.7).

A host whose clock ran ahead (a bad NTP step, a wrong RTC after a reboot) stamps files and
catalog rows with times that, once the clock is corrected, lie in the future. Taken at
face value they protect what they stamp: an orphan "younger" than any ``--min-age`` is
never reclaimed, and an entry "used" next year outranks every entry used today in the
LRU. They are treated as untrustworthy instead: such a time says only that the thing was
made before the clock was corrected, so it protects nothing (decision 2300).
``FUTURE_SLACK`` absorbs small steps and the skew of a filesystem's own clock.
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
