"""What generation hands back, in plain Python types (shared by the engine, the services and the router).

The engine emits one :class:`GenerationDelta` per request per step that produced tokens; the
router turns deltas into OpenAI chunks. No torch here: these cross process boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # The top-N alternatives at this position, best first: (token_id, logprob).
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class GenerationDelta:
    request_id: str
    token_ids: list[int]  # new tokens in this delta
    text: str  # detokenized text for the new tokens (stop strings already cut)
    logprobs: list[TokenLogprob] | None = None  # one per new token when requested
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative, for usage
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache or remote KV
    error: str | None = None  # set with finish_reason == "error"
    # SamplingParams.prompt_logprobs: one entry per prompt token from the second on (the first
    # has no context), ``top`` of the distribution at its position; on the request's first delta.
    prompt_logprobs: list[TokenLogprob] | None = None
    # With finish_reason "error": the engine had no room for it (queue limit / queue wait), nothing
    # was generated and nothing is held; nodes answer RESOURCE_EXHAUSTED (the router's 503).
    overloaded: bool = False


@dataclass
class RequestOutput:
    """Final result of one offline request (``LLM.generate``)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # from the second prompt token on
    finish_reason: str | None = None
    num_cached_tokens: int = 0


def merge_deltas(a: GenerationDelta, b: GenerationDelta) -> GenerationDelta:
    """``a`` then ``b`` of the same request as one delta (a stream's consumer fell behind).

    Tokens, text and logprobs concatenate; the finish and the cumulative counts are ``b``'s.
    Nothing may follow a finishing delta, so ``a`` never carries a finish_reason here.
    """
    assert a.finish_reason is None, f"{a.request_id}: delta after the finishing one"
    if a.logprobs is None and b.logprobs is None:
        logprobs = None
    else:
        logprobs = (a.logprobs or []) + (b.logprobs or [])
    return GenerationDelta(
        request_id=a.request_id,
        token_ids=a.token_ids + b.token_ids,
        text=a.text + b.text,
        logprobs=logprobs,
        finish_reason=b.finish_reason,
        stop_reason=b.stop_reason,
        num_prompt_tokens=b.num_prompt_tokens or a.num_prompt_tokens,
        num_output_tokens=b.num_output_tokens or a.num_output_tokens,
        num_cached_tokens=b.num_cached_tokens or a.num_cached_tokens,
        error=b.error,
        # prompt logprobs ride on a request's first delta only
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        overloaded=b.overloaded,
    )
