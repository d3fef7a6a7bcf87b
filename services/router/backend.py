"""The seam between the router's HTTP layer and whatever produces tokens.

The HTTP layer (``app.py``) only ever sees :class:`GenerateBackend`: the real one dispatches to
prefill and decode nodes over gRPC, tests use a fake. One :class:`BackendRequest` is one sequence
on the nodes: the HTTP layer fans a request with ``n`` choices (or a batch of prompts) out into
several backend requests and merges their deltas.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.engine.outputs import GenerationDelta
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class BackendRequest:
    request_id: str  # unique per sequence: "<http id>-<prompt index>-<choice index>"
    # Empty when prompt_embeds is given: embeddings have no token ids, and placeholder ids would
    # make different embeddings collide in the prefix cache.
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # n == 1 always; the router fans out choices (seed + i)
    prompt_embeds: torch.Tensor | None = None  # [num_prompt_tokens, hidden_size], already checked
    # Images (services.router.multimodal.RouterMmItem): placeholder runs of prompt_token_ids with
    # their cache keys; prefill gets them (and fetches embeddings), decode only their keys.
    mm_items: list[Any] = field(default_factory=list)
    # False: the client reads the answer only at its end (non-streaming); the decode node may then
    # batch its tokens over time (router.nonstream_flush_ms) instead of sending every step.
    streamed: bool = True
    # LoRA: the adapter ("" = base model), and the identity (name@hash) prefill computed the KV
    # under, set from its answer: decode admits the request only under that same content.
    lora_name: str = ""
    lora_ident: str = ""
    # The sequence's root span (pdserve/tracing.py), set by the backend; legs are its children.
    trace_span: Any = None
    # When the HTTP request arrived (time.monotonic()): the root span starts there, and
    # router.admission spans it to the routing decision (parsing, tokenizing, limits, capacity).
    arrival_s: float | None = None

    @property
    def mm_needs_ec(self) -> bool:
        """Some image has no tensor here: only an EC consumer (prefill) can compute this prompt."""
        return any(it.embeds is None for it in self.mm_items)

    @property
    def num_prompt_tokens(self) -> int:
        if self.prompt_embeds is not None:
            return int(self.prompt_embeds.shape[0])
        return len(self.prompt_token_ids)


class GenerateBackend(Protocol):
    def generate(self, req: BackendRequest) -> AsyncGenerator[GenerationDelta, None]:
        """Yield deltas for ``req`` until one has ``finish_reason`` set, then stop.

        The caller owns the iterator: cancelling the task that consumes it, or ``aclose()`` on
        it, must abort the request on every node it reached and free what it holds there.
        Failures after the request was accepted arrive as a delta with ``finish_reason ==
        "error"`` and ``error`` set; a refusal before it was accepted may raise ``CapacityError``.
        """
        ...

    async def check_capacity(self) -> None:
        """Raise ``pdserve.errors.CapacityError`` when no node can take work now (HTTP 503)."""
        ...
