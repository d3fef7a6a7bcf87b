"""A request as the scheduler sees it: ints and ids only (no torch).

One counter model (docs/design.md §4): ``num_computed_tokens`` chases ``num_tokens``. There is no
prefill/decode flag; a request whose prompt is not fully computed simply has a larger gap.
Remote KV (disaggregated decode) counts as externally computed tokens.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.params import KVTransferParams

_arrival_counter = itertools.count()


def next_arrival_seq() -> int:
    """The next arrival number (Request.arrival_seq: ties of arrival_time keep admission order)."""
    return next(_arrival_counter)


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1  # blocks allocated, KV being pulled from a prefill node
    RUNNING = 2
    PREEMPTED = 3
    WAITING_FOR_GRAMMAR = 4  # its structured-output grammar is compiling (nothing allocated)
    # Everything from here on is finished.
    FINISHED_STOPPED = 10  # eos, stop token or stop string
    FINISHED_LENGTH = 11  # max_tokens or max_model_len
    FINISHED_ABORTED = 12  # client gone, router cancel, peer failure
    FINISHED_ERROR = 13  # e.g. KV load failed under policy "fail"

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True, eq=False)
class MultiModalItem:
    """One image of a prompt: its placeholder run and its identity (ints and bytes; the tensor is
    opaque here). ``content_hash`` salts the hash of every block the run overlaps."""

    offset: int  # first placeholder position in the prompt
    length: int  # number of placeholder positions (= rows of ``embeds``)
    content_hash: bytes  # digest of the image bytes, or of a client uuid
    embeds: Any | None = None  # [length, hidden] tensor; None on nodes that never compute the run

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower value = served first (priority policy)
    arrival_time: float = field(default_factory=time.monotonic)
    # Set when this request's prompt KV comes from another node (decode side) or must stay
    # resident for another node to pull (prefill side). Opaque to the scheduler core.
    kv_transfer_params: KVTransferParams | None = None
    # Prompt given as embeddings ([num_prompt_tokens, hidden] tensor, opaque here): the prompt
    # token ids are placeholders, and ``cache_salt`` (a digest of the embeddings) keeps their
    # blocks apart in the prefix cache.
    prompt_embeds: Any | None = None
    cache_salt: bytes = b""
    # Images (or other items) whose embeddings replace placeholder runs of the prompt, in order.
    mm_items: tuple[MultiModalItem, ...] = ()
    # The LoRA adapter the request runs under ("": the base model); its content hash is part of
    # cache_salt, so blocks never match across adapters.
    lora_name: str = ""

    output_token_ids: list[int] = field(default_factory=list)
    # Counts positions scheduled so far: computed, or being computed by a step in flight (the
    # scheduler advances it when it schedules a chunk, so it can schedule ahead of the GPU).
    num_computed_tokens: int = 0
    # Tokens sampled by a step still in flight (asynchronous scheduling): their values are on
    # the device only, so the next step feeds them from there. 0 or 1.
    num_output_placeholders: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    num_external_computed_tokens: int = 0  # prompt tokens whose KV came from a remote node
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Chained block hashes of this request's full blocks, extended lazily by the KV cache manager.
    block_hashes: list[bytes] = field(default_factory=list)
    arrival_seq: int = field(default_factory=next_arrival_seq)
    # Speculative decoding: draft tokens proposed for the next step (pdserve.spec_decode), verified
    # by it; never part of the token history until accepted.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def block_salt(self, start: int, end: int) -> bytes:
        """Extra bytes of the hash of the block over positions [start, end): the cache salt, then
        the content hash of each item the block overlaps (the same text with another image, or
        with the image elsewhere, never shares the block)."""
        if not self.mm_items:
            return self.cache_salt
        parts = [self.cache_salt]
        for item in self.mm_items:
            if item.offset < end and start < item.end:
                parts.append(item.content_hash + (item.offset - start).to_bytes(8, "little", signed=True))
        return b"".join(parts)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def sort_key(self, policy: str) -> tuple[float, ...]:
        """Order in which waiting requests are admitted (and the reverse picks preemption victims)."""
        if policy == "priority":
            return (self.priority, self.arrival_time, self.arrival_seq)
        return (self.arrival_time, self.arrival_seq)
