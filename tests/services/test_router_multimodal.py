"""Image content parts at the router: data URLs, refused remote URLs, checked image_embeds."""

from __future__ import annotations

import base64

import pytest
import torch
from safetensors.torch import save

from services.router.encoders import EncodedImage
from services.router.errors import APIError
from services.router.multimodal import IMAGE_TOKEN, ImageItem, extract_images, has_image_parts, resolve_images

PNG = b"\x89PNG\r\n\x1a\nfake"  # not decoded here: the encoder decodes within its limits


def _url(data: bytes, mime: str = "png") -> dict:
    return {
        "type": "image_url",
        "image_url": {"url": f"data:image/{mime};base64," + base64.b64encode(data).decode()},
    }


def _embeds(t: torch.Tensor) -> dict:
    return {"type": "image_embeds", "image_embeds": base64.b64encode(save({"e": t})).decode()}


def _extract(messages):
    return extract_images(messages, hidden_size=8, max_image_bytes=1024, max_embeds_bytes=1 << 16)


def test_two_images_in_one_message_keep_their_order() -> None:
    msgs = [
        {"role": "user", "content": [_url(PNG), {"type": "text", "text": "and"}, _embeds(torch.ones(4, 8))]}
    ]
    assert has_image_parts(msgs)
    out, images = _extract(msgs)
    assert out[0]["content"] == f"{IMAGE_TOKEN}\nand\n{IMAGE_TOKEN}"
    assert images[0].data == PNG and images[0].embeds is None
    assert images[1].data is None and torch.equal(images[1].embeds, torch.ones(4, 8))
    assert not has_image_parts([{"role": "user", "content": "text only"}])


@pytest.mark.parametrize(
    ("part", "needle"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "remote image URLs"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
        ({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}, "data:image/"),
        (_url(b"x" * 2000), "larger than the limit"),
        (_embeds(torch.ones(4, 7)), "shape"),
        (_embeds(torch.ones(4, 8, dtype=torch.int32)), "dtype"),
        (_embeds(torch.full((4, 8), float("nan"))), "NaN"),
        ({"type": "input_audio"}, "not supported"),
    ],
)
def test_bad_parts_are_400s_naming_the_part(part: dict, needle: str) -> None:
    with pytest.raises(APIError) as e:
        _extract([{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])
    assert e.value.status == 400 and needle in str(e.value.message)
    assert e.value.param == "messages.0.content.1"


class _FakeEncoders:
    """Stands in for EncoderPool (unit test of the expansion only)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.calls: list[list[tuple[bytes, str | None]]] = []

    def __bool__(self) -> bool:
        return True

    async def encode(self, request_id, images):
        self.calls.append(images)
        keys = [("uuid:" + u) if u else f"sha256:{d.hex()}" for d, u in images]
        return [EncodedImage(k, self.length, False) for k in keys], "127.0.0.9:50061"


def test_placeholders_expand_per_item_with_their_own_lengths() -> None:
    import asyncio

    img = 99  # the image token id
    enc = _FakeEncoders(length=3)
    images = [
        ImageItem(b"\x01", None, None),
        ImageItem(None, torch.ones(2, 8), None),
        ImageItem(b"\x02", None, "u"),
    ]
    ids, items = asyncio.run(resolve_images(enc, "r", [5, img, 6, img, img, 7], img, images))
    assert ids == [5, img, img, img, 6, img, img, img, img, img, 7]
    assert [(it.offset, it.length) for it in items] == [(1, 3), (5, 2), (7, 3)]
    assert items[0].key == "sha256:01" and items[2].key == "uuid:u" and items[1].key.startswith("embeds:")
    assert items[0].encoder_address == "127.0.0.9:50061" and items[1].encoder_address == ""
    assert items[1].embeds is not None and items[0].embeds is None
    assert enc.calls == [[(b"\x01", None), (b"\x02", "u")]], "one Encode call for the request's images"
    with pytest.raises(APIError, match="2 image placeholder tokens for 3 image parts"):
        asyncio.run(resolve_images(enc, "r", [img, 1, img], img, images))
    with pytest.raises(APIError, match="no encoder node"):
        asyncio.run(resolve_images(None, "r", [img], img, images[:1]))
