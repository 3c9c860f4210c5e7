"""Pure helpers of the mlx-vlm controller: prompt layout with images, image identity.

No I/O and no framework imports. A VLM prompt is the plain controller rendering
(``render_segments``) with an image placeholder inserted in front of the element
each image names (``ImageInput.before``). Image identity is computed from the
normalized payload (after decoding, RGB conversion and the ``max_image_size``
resize): mode, width, height and the pixel bytes, plus the image's place in the
prompt. That digest, not the file path, decides whether an entry may be reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spoolctl.store import hash_parts

from ..contract import CachePrepareParams, ImageInput, render_segments

IMAGE_SCHEMA = b"spoolctl-vlm-image/v1"
#: Text-only and image entries live in separate namespaces (and carry the mode in meta).
MODE_TEXT = "text"
MODE_IMAGE = "image"


@dataclass(frozen=True)
class ImageIdentity:
    """The identity of one normalized image at one place in the prompt."""

    index: int
    before: int
    mode: str
    width: int
    height: int
    pixels_digest: str

    @property
    def digest(self) -> str:
        return hash_parts(IMAGE_SCHEMA, str(self.index).encode(), str(self.before).encode(),
                          self.mode.encode(), str(self.width).encode(),
                          str(self.height).encode(), self.pixels_digest.encode())

    def to_meta(self) -> dict:
        return {"index": self.index, "before": self.before, "mode": self.mode,
                "width": self.width, "height": self.height, "pixels": self.pixels_digest}


def images_digest(images: Sequence[ImageIdentity], max_image_size: int | None) -> str:
    """Digest of every image identity in order plus the resize setting."""
    return hash_parts(IMAGE_SCHEMA, b"all", str(max_image_size).encode(),
                      *(i.digest.encode() for i in images))


def extra_hash_of(digest: str) -> int:
    """mlx-vlm's exact-snapshot ``extra_hash`` (a signed 64-bit int) for a digest."""
    value = int(digest[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def cacheable_element_count(params: CachePrepareParams) -> int:
    instr, data = params.cacheable()
    return len(instr) + len(data)


def images_in_prefix(params: CachePrepareParams) -> tuple[ImageInput, ...]:
    """The images that belong to the cacheable prefix: those in front of a cacheable
    element or right after the last cacheable one (an image placed after a volatile
    element is never cached)."""
    n = cacheable_element_count(params)
    return tuple(i for i in params.images if i.before <= n)


def render_vlm(params: CachePrepareParams, images: Sequence[ImageInput], placeholder: str,
               *, include_volatile: bool, prompt: str = "") -> str:
    """The prompt text with ``placeholder`` in front of the element each image names.

    ``images`` must be the params' images (or the prefix subset), in params order;
    an image whose ``before`` is past the last rendered element goes at the end.
    """
    segments = render_segments(params, include_volatile=include_volatile)
    lead = 1 if params.tools else 0
    elements = segments[lead:]
    out = list(segments[:lead])
    for j, seg in enumerate(elements):
        out.extend(placeholder for i in images if i.before == j)
        out.append(seg)
    out.extend(placeholder for i in images if i.before >= len(elements))
    if prompt:
        out.append(prompt)
    return "".join(out)
