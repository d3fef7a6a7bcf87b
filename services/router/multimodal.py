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
import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.router.errors import bad_request
from services.router.prompt_embeds import decode_prompt_embeds

if TYPE_CHECKING:
    from services.router.encoders import EncoderPool

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


@dataclass(frozen=True)
class RouterMmItem:
    """One image of a backend request: its placeholder run and cache key. ``embeds`` is set only
    for precomputed image_embeds (then prefill takes them as sent); image_url items carry the
    encoder's address instead, and prefill fetches their embeddings from it."""

    offset: int
    length: int
    key: str
    embeds: Any | None
    encoder_address: str = ""
    image: bytes | None = None  # no encoder node: the bytes go to prefill, which encodes them


def embeds_key(t: Any) -> str:
    """Cache key of precomputed embeddings: a digest of dtype, shape and bytes."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}:{tuple(t.shape)}".encode())
    h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return "embeds:" + h.hexdigest()


async def resolve_images(
    encoders: EncoderPool | None,
    request_id: str,
    token_ids: list[int],
    image_token_id: int,
    images: list[ImageItem],
    colocated_length: int | None = None,
) -> tuple[list[int], list[RouterMmItem]]:
    """Encode the request's image_url images (one Encode call), then expand every ``<image>``
    token of ``token_ids`` into its placeholder run. Returns (ids, items in prompt order).

    Without encoder nodes, ``colocated_length`` (the model's tokens per image) set: the images'
    bytes go to prefill, which encodes them itself (the encoder colocated in prefill)."""
    n_tokens = sum(1 for t in token_ids if t == image_token_id)
    if n_tokens != len(images):
        raise bad_request(
            f"the rendered prompt has {n_tokens} image placeholder tokens for {len(images)} image parts; "
            "do not write the image token in message text",
            "messages",
        )
    to_encode = [(im.data, im.uuid) for im in images if im.data is not None]
    encoded: list[Any] = []
    address = ""
    colocated = not encoders and colocated_length is not None
    if to_encode and not colocated:
        if not encoders:
            raise bad_request(
                "this deployment has no encoder node for the model: image_url parts cannot be encoded "
                "(send precomputed image_embeds, or add a node with role: encoder)",
                "messages",
                code="unsupported",
            )
        encoded, address = await encoders.encode(request_id, to_encode)
    it = iter(encoded)
    specs: list[tuple[int, str, Any, str, bytes | None]] = []
    for im in images:
        if im.data is not None and colocated:
            assert colocated_length is not None
            key = "uuid:" + im.uuid if im.uuid else "sha256:" + hashlib.sha256(im.data).hexdigest()
            specs.append((colocated_length, key, None, "", im.data))
        elif im.data is not None:
            e = next(it)
            specs.append((e.length, e.key, None, address, None))
        else:
            assert im.embeds is not None
            key = "uuid:" + im.uuid if im.uuid else embeds_key(im.embeds)
            specs.append((int(im.embeds.shape[0]), key, im.embeds, "", None))
    out: list[int] = []
    items: list[RouterMmItem] = []
    k = 0
    for t in token_ids:
        if t != image_token_id:
            out.append(t)
            continue
        length, key, embeds, addr, data = specs[k]
        k += 1
        items.append(RouterMmItem(len(out), length, key, embeds, addr, data))
        out.extend([image_token_id] * length)
    return out, items
