"""Image content parts of ``/v1/chat/completions``: parsed and checked at the router.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}, "uuid": "..."?}
    {"type": "image_embeds", "image_embeds": "<base64 safetensors [T, hidden]>"}

Each part becomes one ``<image>`` token in the rendered prompt (expanded to its placeholder run
once the encoder answered with the length) and one ``ImageItem``. Remote URLs are refused: nodes
have no internet access, and fetching for clients would make the router an open proxy. Image
bytes are not decoded here (the encoder does it, within its limits); only their size is bounded.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any

from services.router.errors import bad_request
from services.router.prompt_embeds import decode_prompt_embeds

IMAGE_TOKEN = "<image>"
_DATA_URL = re.compile(r"^data:image/(png|jpeg|jpg|webp);base64,(.*)$", re.DOTALL)


@dataclass(frozen=True)
class ImageItem:
    data: bytes | None  # encoded image bytes (image_url part)
    embeds: Any | None  # checked [T, hidden] tensor (image_embeds part)
    uuid: str | None  # the client's id for the image, replacing the content hash as cache key


def decode_data_url(url: str, max_bytes: int, param: str) -> bytes:
    if url.startswith(("http://", "https://", "ftp://", "file:")):
        raise bad_request(
            "remote image URLs are not supported (nodes have no internet access); "
            "send the image inline as a data:image/png;base64,... URL",
            param,
            code="unsupported_image_url",
        )
    m = _DATA_URL.match(url)
    if m is None:
        raise bad_request("image_url must be a data:image/(png|jpeg|webp);base64,... URL", param)
    if len(m.group(2)) > (max_bytes * 4) // 3 + 4:
        raise bad_request(f"image is larger than the limit of {max_bytes} bytes", param)
    try:
        return base64.b64decode(m.group(2), validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(f"image_url data is not valid base64: {e}", param) from e


def extract_images(
    messages: list[dict[str, Any]], *, hidden_size: int | None, max_image_bytes: int, max_embeds_bytes: int
) -> tuple[list[dict[str, Any]], list[ImageItem]]:
    """Messages with every image part replaced by ``<image>`` text (parts joined by newlines, as
    text-only messages are), and the images in prompt order. Raises APIError (400) naming the part."""
    out: list[dict[str, Any]] = []
    images: list[ImageItem] = []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if not isinstance(content, list):
            out.append(msg)
            continue
        texts = []
        for j, part in enumerate(content):
            param = f"messages.{i}.content.{j}"
            kind = part.get("type")
            if kind == "text":
                texts.append(part.get("text") or "")
            elif kind == "image_url":
                url = (part.get("image_url") or {}).get("url")
                if not isinstance(url, str):
                    raise bad_request("image_url part needs image_url.url", param)
                images.append(ImageItem(decode_data_url(url, max_image_bytes, param), None, part.get("uuid")))
                texts.append(IMAGE_TOKEN)
            elif kind == "image_embeds":
                enc = part.get("image_embeds")
                if not isinstance(enc, str):
                    raise bad_request("image_embeds part needs a base64 safetensors string", param)
                t = decode_prompt_embeds(
                    enc, hidden_size=hidden_size, max_bytes=max_embeds_bytes, param=param
                )
                images.append(ImageItem(None, t, part.get("uuid")))
                texts.append(IMAGE_TOKEN)
            else:
                raise bad_request(
                    f"content part type {kind!r} is not supported; use text, image_url or image_embeds",
                    param,
                    code="unsupported",
                )
        out.append({**msg, "content": "\n".join(texts)})
    return out, images


def has_image_parts(messages: list[dict[str, Any]]) -> bool:
    return any(
        isinstance(m.get("content"), list) and any(p.get("type") != "text" for p in m["content"])
        for m in messages
    )
