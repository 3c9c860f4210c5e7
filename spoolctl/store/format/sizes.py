"""Human sizes and durations: parsing and rendering (pure)."""

from __future__ import annotations

import re

from ...errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50,
}
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")
_DURATION_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(s|m|h|d|w)?\s*")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, None: 1}
MAX_SIZE = 1 << 60


def parse_size(text: str | int) -> int:
    """Parse ``200GiB``, ``64MiB``, ``1.5TiB``, ``500MB`` or plain bytes into bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE_RE.fullmatch(str(text))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ConfigError(
                f"invalid size {str(text)[:40]!r}",
                fix="write a number with an optional unit, e.g. 200GiB, 512MiB, 10GB or 1048576",
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0 or value > MAX_SIZE:
        raise ConfigError(f"invalid size {text!r}", fix="use a size between 1 byte and 1 EiB")
    return value


def parse_rate(text: str) -> int:
    """Parse a byte rate such as ``64MiB/s`` (the ``/s`` is optional)."""
    raw = str(text).strip()
    if raw.lower().endswith("/s"):
        raw = raw[:-2]
    try:
        return parse_size(raw)
    except ConfigError:  # a rate's own wording and example, not a size's
        raise ConfigError(f"invalid rate {str(text)[:40]!r}",
                          fix="write bytes per second, e.g. 64MiB/s, 200MB/s, or 0 for "
                              "unlimited") from None


def parse_duration(text: str) -> float:
    """Parse ``90s``, ``15m``, ``6h``, ``7d``, ``2w`` or plain seconds into seconds."""
    m = _DURATION_RE.fullmatch(str(text))
    if not m:
        raise ConfigError(
            f"invalid duration {str(text)[:40]!r}", fix="write e.g. 90s, 15m, 6h, 7d or 2w"
        )
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def format_size(n: int | float) -> str:
    """Render bytes in IEC units (``1.5 GiB``)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        # Compared as shown (one decimal): 1048575 B is "1.0 MiB", never "1024.0 KiB".
        if (abs(n) < 1024 if unit == "B" else round(abs(n), 1) < 1024) or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
