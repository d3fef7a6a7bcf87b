"""What completions and chat share: prompt checks, sampling parameters, fan-out, collection, SSE.

A request becomes ``len(prompts) * n`` backend sequences; sequence ``p * n + i`` is choice
``p * n + i`` of the answer (prompt ``p``, sample ``i``), as in vLLM's batch completions.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from starlette.types import Receive

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.grammar_spec import DEFAULT_MAX_GRAMMAR_BYTES
from pdserve.engine.outputs import GenerationDelta, TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import CapacityError, PdserveError, PromptTooLongError
from services.router.backend import BackendRequest, GenerateBackend
from services.router.errors import APIError, bad_request, to_api_error
from services.router.limits import RequestLimits
from services.router.logprobs import TokenTexts
from services.router.metrics import RouterMetrics
from services.router.offload import TokenizerThreads
from services.router.protocol import SamplingFields
from services.router.streams import SSEResponse, run_sequences, sse_event, until_disconnect
from services.router.structured import structured_of

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServingContext:
    """Everything a handler needs; built once by ``create_app``."""

    backend: GenerateBackend
    tokenizer: Any  # a transformers tokenizer (encode, decode, apply_chat_template)
    served_model_names: tuple[str, ...]
    max_model_len: int
    metrics: RouterMetrics
    vocab_size: int  # token ids must lie in [0, vocab_size)
    hidden_size: int | None  # prompt_embeds width; None: prompt_embeds refused
    max_prompt_embeds_bytes: int
    limits: RequestLimits = field(default_factory=RequestLimits)
    tool_call_parser: str = "hermes"  # checked by create_app (tool_parsers.check_parser)
    detokenize_in_router: bool = True  # router.detokenize: "router" (streams.detokenize_here)
    # Images: the model's image placeholder token (None: a text-only model, image
    # parts are a 400) and the encoder nodes image_url parts go to (None: none in the cluster).
    image_token_id: int | None = None
    encoders: Any | None = None  # services.router.encoders.EncoderPool
    # Tokens per image, when prefill encodes images itself (no encoder node serves the model).
    image_seq_length: int | None = None
    max_image_bytes: int = 20 << 20
    # generation_config.json's sampling values (models.config.generation_defaults): what a
    # request that leaves temperature / top_p / top_k / repetition_penalty unset runs with
    generation_defaults: dict[str, float] = field(default_factory=dict)
    # The nodes' KV capacity in tokens (NodePool.kv_capacity_tokens); None: not known (yet)
    kv_capacity_tokens: Callable[[], int | None] | None = None
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES  # router.max_grammar_bytes (structured_of)
    lora: Any | None = None  # services.router.lora.RouterLoRA; None: no adapters served
    token_texts: TokenTexts = field(init=False)
    # The router makes the text of sequences without stop strings (streams.detokenize_here).
    detokenizer: IncrementalDetokenizer | None = field(init=False)
    # Tokenizing and chat templates of large bodies run here, off the event loop (offload.py).
    offload: TokenizerThreads = field(init=False)
    max_prompt_chars: int = field(init=False)  # limits.max_prompt_chars, resolved

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_texts", TokenTexts(self.tokenizer))
        lim = self.limits
        object.__setattr__(self, "offload", TokenizerThreads(lim.tokenizer_threads, lim.tokenize_timeout_s))
        object.__setattr__(self, "max_prompt_chars", lim.prompt_chars_limit(self.max_model_len))
        detok = None
        if self.detokenize_in_router and self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer)
        object.__setattr__(self, "detokenizer", detok)

    @property
    def max_len(self) -> int:
        """max_model_len, lowered to the smallest KV cache a node reported (a node that sized its
        cache below the checkpoint's length lowered its own max_model_len to it)."""
        cap = self.kv_capacity_tokens() if self.kv_capacity_tokens is not None else None
        return self.max_model_len if cap is None else min(self.max_model_len, cap)

    def check_model(self, model: str) -> str:
        """The LoRA adapter ``model`` names ("" for the base model); 404 for an unknown model."""
        if model in self.served_model_names:
            return ""
        if self.lora is not None and model in self.lora.adapters:
            return model
        adapters = list(self.lora.adapters) if self.lora is not None else []
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves {list(self.served_model_names) + adapters}",
            param="model",
            code="model_not_found",
        )


@dataclass
class Prompt:
    token_ids: list[int]  # empty when embeds is set
    embeds: torch.Tensor | None = None  # [num_tokens, hidden_size]
    mm_items: list[Any] = field(default_factory=list)  # RouterMmItem, placeholder runs of token_ids

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0]) if self.embeds is not None else len(self.token_ids)


def check_token_ids(ctx: ServingContext, token_ids: list[int], param: str) -> None:
    if not token_ids:
        raise bad_request("the prompt is empty", param)
    bad = [t for t in token_ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {ctx.vocab_size})", param)


def resolve_max_tokens(ctx: ServingContext, num_prompt_tokens: int, requested: int | None, param: str) -> int:
    """The max_tokens a sequence runs with; raises OpenAI's context_length_exceeded when it can't fit."""
    max_len = ctx.max_len
    room = max_len - num_prompt_tokens
    if room < 1 or (requested is not None and requested > room):
        completion = requested if requested is not None else 1
        asked = f"{num_prompt_tokens + completion} tokens ({num_prompt_tokens} in the prompt, {completion} in the completion)"
        raise PromptTooLongError(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            + (asked if requested is not None else f"{num_prompt_tokens} tokens in the prompt")
            + ". Please reduce the length of the prompt or the completion.",
            field=param,
        )
    return requested if requested is not None else room


def sampling_params(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    defaults: dict[str, float] | None = None,
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
) -> SamplingParams:
    """Map the body to SamplingParams; InvalidRequestError names the field (-> 400 with param).
    A field the body leaves unset (None) takes ``defaults`` (the model's generation config), then
    SamplingParams' own default. A structured-output constraint longer than ``max_grammar_bytes``
    is refused before it is parsed."""
    kwargs: dict[str, Any] = {
        "n": body.n,
        "max_tokens": max_tokens,
        "min_tokens": body.min_tokens,
        "stop": body.stop or [],
        "stop_token_ids": body.stop_token_ids or [],
        "seed": body.seed,
        "ignore_eos": body.ignore_eos,
        "logprobs": logprobs,
        "structured": structured_of(body.response_format, body.structured_outputs, max_grammar_bytes),
    }
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        value = getattr(body, name)
        if value is None and defaults:
            value = defaults.get(name)
        if value is not None:
            kwargs[name] = value
    return SamplingParams(**kwargs)


def fan_out(
    request_id: str,
    prompts: list[Prompt],
    params: SamplingParams,
    max_tokens: list[int],
    lora_name: str = "",
    arrival_s: float | None = None,
) -> list[BackendRequest]:
    """One backend request per (prompt, choice); choice i of a seeded request gets seed + i."""
    reqs = []
    for p, prompt in enumerate(prompts):
        for i in range(params.n):
            sp = dataclasses.replace(params.for_sample(i), max_tokens=max_tokens[p])
            reqs.append(
                BackendRequest(
                    f"{request_id}-{p}-{i}",
                    prompt.token_ids,
                    sp,
                    prompt.embeds,
                    mm_items=prompt.mm_items,
                    lora_name=lora_name,
                    arrival_s=arrival_s,
                )
            )
    return reqs


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ChoiceResult:
    """One choice collected to the end (non-streaming)."""

    text_parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # From the node that prefilled (the first that sent them: a recompute on decode repeats them).
    prompt_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0  # prefix-cache hits where the prompt was prefilled

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def _failure(delta: GenerationDelta) -> APIError:
    reason = delta.error or (
        "the request was aborted on the serving node" if delta.finish_reason == "abort" else ""
    )
    return APIError(500, f"generation failed: {reason or 'unknown error'}", code="generation_failed")


async def collect(ctx: ServingContext, reqs: list[BackendRequest], arrival_s: float) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in reqs]
    for req in reqs:
        req.streamed = False
    async for i, delta in run_sequences(ctx.backend, reqs, ctx.metrics, arrival_s, ctx.detokenizer):
        if delta.finish_reason in ("error", "abort"):
            raise _failure(delta)  # leaving run_sequences aborts the other choices
        r = results[i]
        r.text_parts.append(delta.text)
        r.num_tokens += len(delta.token_ids)
        if delta.logprobs:
            r.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None and r.prompt_logprobs is None:
            r.prompt_logprobs = delta.prompt_logprobs
        # Prefill's first delta carries its hits; decode's later deltas count only its own.
        r.num_cached_tokens = max(r.num_cached_tokens, delta.num_cached_tokens)
        if delta.finish_reason is not None:
            r.finish_reason, r.stop_reason = delta.finish_reason, delta.stop_reason
    return results


def usage(num_prompt_tokens: int, num_completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def cached_tokens(per_choice: list[int], num_prompts: int) -> int:
    """``usage.prompt_tokens_details.cached_tokens``: per prompt, the fewest hits among its
    choices (each choice is its own sequence; prompt_tokens counts the prompt once), summed."""
    n = len(per_choice) // num_prompts
    return sum(min(per_choice[p * n : (p + 1) * n]) for p in range(num_prompts))


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


async def stream_events(
    ctx: ServingContext,
    reqs: list[BackendRequest],
    arrival_s: float,
    header: dict[str, Any],
    first_chunks: list[dict[str, Any]],
    make_chunk: Callable[[int, GenerationDelta], dict[str, Any]],
    num_prompt_tokens: int,
    include_usage: bool,
    *,
    num_prompts: int = 1,
    count_tokens: Callable[[GenerationDelta], int] | None = None,
) -> AsyncIterator[str]:
    """SSE events: ``first_chunks``, one chunk per delta, the usage chunk, then ``[DONE]``.

    ``header`` (id, object, created, model) starts every chunk. Errors after the headers went out
    become one error event in OpenAI's shape (the openai client raises it as APIError).
    ``count_tokens``: a delta's completion tokens for usage (default: its token ids).
    """
    extra = {"usage": None} if include_usage else {}
    num_completion_tokens = 0
    cached = [0] * len(reqs)
    seqs = run_sequences(ctx.backend, reqs, ctx.metrics, arrival_s, ctx.detokenizer)
    sent = False  # nothing yielded yet: a refusal (CapacityError) is raised, not an error event
    try:
        # The first delta before any event: ``primed_sse`` sends the 200 only once it is here.
        first = await anext(seqs, None)
        sent = True
        for chunk in first_chunks:
            yield sse_event(_dumps({**header, **chunk, **extra}))
        while first is not None:
            i, delta = first
            if delta.finish_reason in ("error", "abort"):
                raise _failure(delta)
            num_completion_tokens += len(delta.token_ids) if count_tokens is None else count_tokens(delta)
            cached[i] = max(cached[i], delta.num_cached_tokens)
            yield sse_event(_dumps({**header, **make_chunk(i, delta), **extra}))
            first = await anext(seqs, None)
        if include_usage:
            u = usage(num_prompt_tokens, num_completion_tokens, cached_tokens(cached, num_prompts))
            yield sse_event(_dumps({**header, "choices": [], "usage": u}))
    except (APIError, PdserveError) as e:
        if not sent and isinstance(e, CapacityError):
            raise  # before the 200: primed_sse lets the app answer 503 with the error body
        err = to_api_error(e)
        ctx.metrics.http_errors.labels(status=str(err.status)).inc()
        yield sse_event(_dumps(err.body()))
    except Exception as e:  # a bug or a broken node connection: tell the client, keep the trace
        logger.exception("stream %s failed", header.get("id"))
        ctx.metrics.http_errors.labels(status="500").inc()
        yield sse_event(_dumps(APIError(500, f"internal error: {type(e).__name__}: {e}").body()))
    finally:
        await seqs.aclose()  # stops (and aborts) every sequence still running
    yield sse_event("[DONE]")


async def primed_sse(receive: Receive, events: AsyncIterator[str]) -> SSEResponse:
    """An SSE response whose status goes out with its first event (the first token).

    A request the nodes refuse before generating (overload: queue limit or queue wait) is then a
    plain 503 with OpenAI's error body, not an error event inside a 200 stream. A client that
    leaves while waiting is noticed (``until_disconnect``) and its sequences are aborted.
    """
    agen = cast(AsyncGenerator[str, None], events)
    try:
        first = await until_disconnect(receive, anext(agen, None))
    except BaseException:
        await agen.aclose()
        raise

    async def chained() -> AsyncIterator[str]:
        try:
            if first is not None:
                yield first
            async for e in agen:
                yield e
        finally:
            await agen.aclose()

    return SSEResponse(chained())
