"""Image items of a Prefill / Decode request: ``MmItem`` messages -> checked ``WireItem``s ->
the engine's ``MultiModalItem``s (the tensors fetched from encoders where missing, by
``services/mm_items.py``'s EmbeddingFetcher on prefill)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.config.resolver import MmPolicy, check_mm_items_allowed
from pdserve.engine.request import MultiModalItem
from pdserve.errors import InvalidRequestError
from pdserve.rpc import convert
from pdserve.rpc import node_pb2 as pb


@dataclass(frozen=True)
class WireItem:
    offset: int
    length: int
    key: str
    embeds: Any | None  # checked tensor, or None
    encoder_address: str
    image: bytes | None = None  # colocated encoding: the image's bytes (prefill runs the tower)


def items_from_pb(msgs: Sequence[pb.MmItem], policy: MmPolicy) -> list[WireItem]:
    """Parse and check (InvalidRequestError, naming the item) against the node's derived flags."""
    out = []
    for i, m in enumerate(msgs):
        if not m.key:
            raise InvalidRequestError(f"mm_items[{i}]: key is required", field="mm_items")
        t = None
        if m.HasField("embeds"):
            try:
                t = convert.tensor_from_pb(m.embeds)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"mm_items[{i}].embeds: {e}", field="mm_items") from e
        out.append(WireItem(m.offset, m.length, m.key, t, m.encoder_address, m.image or None))
    # Items with their image are encoded here (colocated): not embedding-only inputs.
    embedding_items = [it for it in out if it.image is None]
    if embedding_items:
        check_mm_items_allowed(policy, [it.embeds is not None for it in embedding_items])
    return out


def to_engine_items(items: Sequence[WireItem], tensors: Sequence[Any | None]) -> list[MultiModalItem]:
    return [
        MultiModalItem(it.offset, it.length, it.key.encode(), t) for it, t in zip(items, tensors, strict=True)
    ]
