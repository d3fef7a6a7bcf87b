"""Image items on the engine nodes: ``MmItem`` messages -> ``MultiModalItem``s the engine takes
(the messages are parsed and checked by ``pdserve/rpc/mm_convert.py``).

    prefill (EC consumer)                          decode (KV consumer)
    ---------------------                          --------------------
    check the node's derived flags                 check the node's derived flags
    items with a tensor: checked, used as sent     items never carry a tensor (the KV holds them)
    items without: EmbeddingFetcher.fetch(key)     they only salt the prefix-cache block hashes
      index lookup -> reserve -> start_write
      -> encoder.PushEmbeddings (Mooncake write)
      -> complete (READY -> TAKEN -> copy) -> release

The fetcher is the consumer half of the embedding-cache connector (docs/design.md §7) on the node's first
stage; every exit path releases its reservation (a push that may still be writing is released
once its lease passed, never earlier).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from pdserve.embedcache.connector import EmbeddingConsumer
from pdserve.embedcache.index import EmbeddingEntry, EmbeddingIndex
from pdserve.embedcache.reservation import Reservation
from pdserve.errors import CapacityError, InvalidRequestError, PdserveError
from pdserve.kvtransfer.backend import TransferBackend
from pdserve.rpc import channel
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from pdserve.rpc.mm_convert import WireItem

logger = logging.getLogger(__name__)


class EmbeddingUnavailableError(PdserveError):
    """An item's embedding could not be fetched (expired from the index, encoder gone); the
    router answers 503: encoding the image again may succeed."""


class EmbeddingFetcher:
    """Key -> embedding tensor, pushed by the encoder that owns it into a reserved buffer."""

    def __init__(
        self,
        backend: TransferBackend,
        index: EmbeddingIndex,
        buffer_bytes: int,
        lease_s: float,
        timeout_s: float,
        shared_token: str | None,
        registry: CollectorRegistry,
    ) -> None:
        self.backend = backend
        self.index = index
        self.consumer = EmbeddingConsumer(backend, buffer_bytes, lease_s, registry=registry)
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self._md = channel.auth_metadata(shared_token)
        self._channels: dict[str, grpc.aio.Channel] = {}

    @property
    def num_reserved(self) -> int:
        return self.consumer.table.num_reserved

    def _stub(self, address: str) -> pb_grpc.EncoderServiceStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address, options=channel.OPTIONS)
        return pb_grpc.EncoderServiceStub(ch)

    async def fetch_all(self, items: Sequence[WireItem]) -> list[Any]:
        """Every item's tensor (sent ones as they are); all fetches run at once."""
        self.consumer.expire()
        missing = list({it.key: it for it in items if it.embeds is None and it.image is None}.values())
        got = await asyncio.gather(*(self.fetch(it) for it in missing), return_exceptions=True)
        for g in got:
            if isinstance(g, BaseException):
                raise g
        by_key = {it.key: t for it, t in zip(missing, got, strict=True)}
        return [it.embeds if it.embeds is not None else by_key.get(it.key) for it in items]

    async def fetch(self, item: WireItem) -> Any:
        entry = await asyncio.to_thread(self.index.lookup, item.key)
        if entry is None:
            raise EmbeddingUnavailableError(
                f"embedding {item.key!r} is not in the cache index (expired or evicted); send the image again"
            )
        if entry.shape[0] != item.length:
            raise InvalidRequestError(
                f"image {item.key!r}: {item.length} placeholder tokens, but its embedding has "
                f"{entry.shape[0]} rows",
                field="mm_items",
            )
        if not item.encoder_address:
            raise InvalidRequestError(f"image {item.key!r}: encoder_address is required", field="mm_items")
        r, dst = self.consumer.reserve(entry)  # CapacityError: no room now (a 503)
        try:
            self.consumer.start_write(r)
        except CapacityError:
            self.consumer.table.release(r.rid)
            raise
        return await self._push(item, entry, r, dst)

    async def _push(self, item: WireItem, entry: EmbeddingEntry, r: Reservation, dst: int) -> Any:
        req = pb.EncoderPushRequest(
            key=item.key,
            dst_session=self.backend.session_id,
            dst_addr=dst,
            nbytes=entry.nbytes,
            transfer_id=f"ec-{uuid.uuid4().hex[:12]}",
        )
        try:
            await self._stub(item.encoder_address).PushEmbeddings(
                req, timeout=self.timeout_s, metadata=self._md
            )
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                self._release_after_lease(r, entry)  # the encoder may still be writing into it
            else:
                self.consumer.complete(r, entry, ok=False)  # the writer is done (or never began)
            raise EmbeddingUnavailableError(
                f"encoder {item.encoder_address} could not push {item.key!r}: {e.code().name}: {e.details()}"
            ) from e
        except asyncio.CancelledError:
            self._release_after_lease(r, entry)
            raise
        t = self.consumer.complete(r, entry, ok=True)
        if t is None:
            raise EmbeddingUnavailableError(f"reservation for {item.key!r} expired during the push")
        return t

    def _release_after_lease(self, r: Reservation, entry: EmbeddingEntry) -> None:
        """A push that ended without an answer: its write may still land, so the buffer is freed
        only after the lease (never while a writer may be active), and counted as an expiry."""

        def end() -> None:
            self.consumer.complete(r, entry, ok=False)
            self.consumer.reservation_expiries.inc()

        asyncio.get_running_loop().call_later(self.lease_s, end)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()


class ColocatedEncoder:
    """The encoder colocated in prefill: a prefill node of a multimodal model that no encoder node
    serves runs the vision tower itself, on the engine thread between steps (the model's first
    stage holds it), with an in-process LRU of embeddings by key. Same metrics as an encoder."""

    def __init__(self, model_dir: str, limits: Any, capacity_bytes: int, registry: CollectorRegistry) -> None:
        from collections import OrderedDict

        from pdserve.models.image_processor import ClipImageProcessor
        from services.encoder.core import EncoderMetrics

        self.processor = ClipImageProcessor.from_model_dir(model_dir)
        self.limits = limits
        self.capacity_bytes = capacity_bytes
        self.metrics = EncoderMetrics(registry)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._bytes = 0

    async def embeds_of(self, items: Sequence[WireItem], engine_loop: Any) -> dict[str, Any]:
        """key -> [length, hidden] tensor for every item carrying its image. Every image is decoded
        (InvalidRequestError for a bad one) before any is encoded."""
        import torch

        from pdserve.models.image_processor import decode_image

        self.metrics.requests.inc()
        out: dict[str, Any] = {}
        todo: dict[str, Any] = {}
        for it in items:
            if it.image is None or it.key in out or it.key in todo:
                continue
            if it.key in self._cache:
                self._cache.move_to_end(it.key)
                out[it.key] = self._cache[it.key]
            else:
                todo[it.key] = self.processor(decode_image(it.image, self.limits))  # [3, S, S]
        self.metrics.cache_hits.inc(len(out))
        self.metrics.cache_misses.inc(len(todo))
        if todo:
            px = torch.stack(list(todo.values()))  # [k, 3, S, S]

            def encode(e: Any) -> Any:
                with torch.inference_mode():
                    return e.runner.model.encode_images(px.to(e.runner.device)).cpu()  # [k, T, hidden]

            embeds = await engine_loop.call(encode)
            self.metrics.images_encoded.inc(len(todo))
            for key, emb in zip(todo, embeds, strict=True):
                self._put(key, emb.contiguous())
                out[key] = emb
        for it in items:
            if it.image is not None and out[it.key].shape[0] != it.length:
                raise InvalidRequestError(
                    f"image {it.key!r}: {it.length} placeholder tokens, the tower gives {out[it.key].shape[0]}",
                    field="mm_items",
                )
        return out

    def _put(self, key: str, t: Any) -> None:
        n = t.numel() * t.element_size()
        while self._cache and self._bytes + n > self.capacity_bytes:
            _k, old = self._cache.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
        if n <= self.capacity_bytes:
            self._cache[key] = t
            self._bytes += n
