"""The encoder node's work, without the wire: images -> cache keys and placeholder lengths.

    image bytes --decode (limits)--> PIL --CLIP preprocessing--> pixels
       key = "sha256:<hex of the bytes>"  (or "uuid:<client uuid>", vLLM's multi_modal_uuids)
       key in the producer's cache?  yes: a hit, the encoder does not run
                                     no:  batch every miss of the call through vision tower +
                                          projector, put each into the embedding cache

Metrics (Prometheus, ``pdserve:`` namespace): encoder requests, images encoded, cache hits and
misses, embedding bytes pushed.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry, Counter

from pdserve.embedcache.connector import EmbeddingProducer
from pdserve.models.image_processor import ClipImageProcessor, ImageLimits, decode_image
from pdserve.models.llava import LlavaForConditionalGeneration


@dataclass(frozen=True)
class ImageInput:
    data: bytes
    uuid: str | None = None  # the client's own id for the image; replaces the content hash


@dataclass(frozen=True)
class EncodedItem:
    key: str
    length: int  # placeholder tokens the prompt needs for this image
    cache_hit: bool


def cache_key(item: ImageInput) -> str:
    if item.uuid:
        return "uuid:" + item.uuid
    return "sha256:" + hashlib.sha256(item.data).hexdigest()


class EncoderMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve:encoder_requests", "Encode calls", registry=r)
        self.images_encoded = Counter(
            "pdserve:encoder_images_encoded", "Images run through the encoder", registry=r
        )
        self.cache_hits = Counter(
            "pdserve:ec_cache_hits", "Images served from the embedding cache", registry=r
        )
        self.cache_misses = Counter(
            "pdserve:ec_cache_misses", "Images not in the embedding cache", registry=r
        )


@dataclass(eq=False)
class _Ticket:
    pixels: list[torch.Tensor]  # [3, S, S] each
    result: list[torch.Tensor] | None = None
    error: BaseException | None = None


class EncoderCore:
    """Thread-safe. Concurrent calls share batches: while one batch runs through the tower, the
    misses of every call that arrives wait, and the next batch takes all of them at once
    (leader / followers: whichever waiting call finds the model idle runs the batch for all)."""

    def __init__(
        self,
        model: LlavaForConditionalGeneration,
        processor: ClipImageProcessor,
        producer: EmbeddingProducer,
        limits: ImageLimits,
        metrics: EncoderMetrics | None = None,
    ) -> None:
        self.model, self.processor, self.producer, self.limits = model, processor, producer, limits
        self.metrics = metrics or EncoderMetrics()
        self._cv = threading.Condition()
        self._pending: list[_Ticket] = []
        self._busy = False
        self.num_batches = 0  # tower calls (tests check that concurrent calls share them)

    def encode(self, images: list[ImageInput]) -> list[EncodedItem]:
        """Keys and lengths in input order. Every image is decoded and checked before any is
        encoded, so a bad image (InvalidRequestError) leaves nothing in the cache."""
        self.metrics.requests.inc()
        keys = [cache_key(im) for im in images]
        misses: dict[str, torch.Tensor] = {}
        hits: set[str] = set()
        for im, key in zip(images, keys, strict=True):
            if key in misses or key in hits:
                continue  # the same image twice in one call: encoded once
            if self.producer.has(key):
                hits.add(key)
            else:
                misses[key] = self.processor(decode_image(im.data, self.limits))  # [3, S, S]
        self.metrics.cache_hits.inc(len(hits))
        self.metrics.cache_misses.inc(len(misses))
        if misses:
            embeds = self._encode_batched(list(misses.values()))  # [T, hidden] each
            self.metrics.images_encoded.inc(len(misses))
            for key, e in zip(misses, embeds, strict=True):
                self.producer.put(key, e)
        n = self.model.num_image_tokens
        return [EncodedItem(k, n, k in hits) for k in keys]

    def _encode_batched(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        ticket = _Ticket(pixels)
        with self._cv:
            self._pending.append(ticket)
            while ticket.result is None and ticket.error is None:
                if self._busy:
                    self._cv.wait()
                    continue
                batch, self._pending, self._busy = self._pending, [], True
                self._cv.release()
                try:
                    self._run(batch)
                finally:
                    self._cv.acquire()
                    self._busy = False
                    self._cv.notify_all()
        if ticket.error is not None:
            raise ticket.error
        assert ticket.result is not None
        return ticket.result

    def _run(self, batch: list[_Ticket]) -> None:
        """One tower call for every waiting call's images (runs without the condition's lock)."""
        try:
            px = torch.stack([p for t in batch for p in t.pixels])  # [k, 3, S, S]
            with torch.inference_mode():
                out = self.model.encode_images(px)  # [k, T, hidden]
            self.num_batches += 1
        except Exception as e:  # every waiting call gets the error, none hangs
            for t in batch:
                t.error = e
            return
        i = 0
        for t in batch:
            t.result = list(out[i : i + len(t.pixels)])
            i += len(t.pixels)
