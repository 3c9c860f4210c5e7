"""The safetensors body rule both local backends enforce (pure).

A safetensors body must be indexed entirely by its tensors, without holes or overlaps
(the format's own validation rule). Checking it catches a header whose length field was
shortened or lengthened: the JSON may still parse (e.g. only trailing padding spaces were
cut off), but every tensor would then be read from shifted bytes.
"""

from __future__ import annotations

from collections.abc import Iterable


def tiling_error(spans: Iterable[tuple[int, int]], body: int) -> str | None:
    """None if the ``(start, end)`` byte spans tile ``[0, body)`` exactly, else why not."""
    at = 0
    for start, end in sorted(spans):
        if start != at:
            return "tensor data has a hole or an overlap"
        at = end
    if at != body:
        return "tensor data does not end where the file ends"
    return None
