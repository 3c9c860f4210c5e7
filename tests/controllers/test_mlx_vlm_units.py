"""Pure parts of the mlx-vlm controller: image inputs in the contract, the key, the
prompt layout with image placeholders, image identity digests. No framework needed."""

from __future__ import annotations

import pytest

from spoolctl.controllers import CachePrepareParams, Element
from spoolctl.controllers.contract import ImageInput
from spoolctl.controllers.local.vlm_prompt import (
    ImageIdentity,
    extra_hash_of,
    images_digest,
    images_in_prefix,
    render_vlm,
)
from spoolctl.errors import ConfigError

PH = "<IMG>"


def params(**kw) -> CachePrepareParams:
    return CachePrepareParams(model="m", instructions=[Element("sys", role="system")],
                              data=[Element("a", role="user"), Element("b", role="user")], **kw)


def test_text_keys_do_not_change_when_images_are_absent() -> None:
    plain = params()
    assert plain.images == () and plain.images_hash == ""
    # The key of a params without images is exactly the pre-image key derivation.
    assert plain.key() == params(images=[]).key()
    with_img = params(images=["/x.png"])
    assert with_img.key() != plain.key()
    assert params(images=["/x.png"], max_image_size=28).key() != with_img.key()
    assert params(images=[{"source": "/x.png", "before": 1}]).key() != with_img.key()
    assert params(images=["/y.png"]).key() != with_img.key()


@pytest.mark.parametrize("bad, match", [
    ({"images": [""]}, "non-empty file path"),
    ({"images": [{"source": "/x.png", "before": -1}]}, "integer >= 0"),
    ({"images": [{"source": "/x.png", "where": 1}]}, "unknown image fields"),
    ({"images": [3]}, "cannot use a int"),
    ({"max_image_size": 0}, "positive integer"),
    ({"max_image_size": True}, "positive integer"),
])
def test_bad_image_inputs_are_config_errors(bad, match) -> None:
    with pytest.raises(ConfigError, match=match):
        params(**bad)


def test_placeholders_go_in_front_of_the_named_element() -> None:
    p = params(images=[ImageInput("/a.png", 0), ImageInput("/b.png", 2), ImageInput("/c.png", 3)])
    text = render_vlm(p, p.images, PH, include_volatile=True, prompt="Q")
    assert text == f"{PH}system: sys\nuser: a\n{PH}user: b\n{PH}Q"


def test_images_after_a_volatile_element_are_not_cached() -> None:
    p = CachePrepareParams(
        model="m", instructions=[Element("sys", role="system")],
        data=[Element("a"), Element("now", cache="volatile"), Element("c")],
        images=[ImageInput("/a.png", 1), ImageInput("/b.png", 2), ImageInput("/c.png", 3)])
    prefix = images_in_prefix(p)
    assert [i.source for i in prefix] == ["/a.png", "/b.png"]
    # In the prefix rendering the image before the volatile element ends the prefix,
    # at the same place it has in the full prompt.
    cached = render_vlm(p, prefix, PH, include_volatile=False)
    full = render_vlm(p, p.images, PH, include_volatile=True)
    assert cached == f"system: sys\n{PH}a\n{PH}"
    assert full.startswith(cached)


def test_image_identity_covers_mode_size_pixels_and_position() -> None:
    base = ImageIdentity(index=0, before=0, mode="RGB", width=56, height=56, pixels_digest="p")
    variants = [
        ImageIdentity(0, 0, "L", 56, 56, "p"), ImageIdentity(0, 0, "RGB", 28, 56, "p"),
        ImageIdentity(0, 0, "RGB", 56, 28, "p"), ImageIdentity(0, 0, "RGB", 56, 56, "q"),
        ImageIdentity(1, 0, "RGB", 56, 56, "p"), ImageIdentity(0, 1, "RGB", 56, 56, "p"),
    ]
    digests = {base.digest, *(v.digest for v in variants)}
    assert len(digests) == 1 + len(variants)
    assert images_digest([base], None) != images_digest([base], 448)
    assert images_digest([base], None) != images_digest([base, base], None)


def test_extra_hash_is_a_signed_64_bit_int() -> None:
    assert extra_hash_of("0" * 64) == 0
    assert extra_hash_of("f" * 64) == -1
    assert extra_hash_of("7fffffffffffffff" + "0" * 48) == (1 << 63) - 1
