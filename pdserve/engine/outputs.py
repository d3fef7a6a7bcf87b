"""What generation hands back, in plain Python types (shared by the engine, the services and the router).

The engine emits one :class:`GenerationDelta` per request per step that produced tokens; the
router turns deltas into OpenAI chunks, the offline API (``engine/offline.py``) into vLLM's
:class:`RequestOutput`. No torch here: these cross process boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class Logprob:
    """One token's entry in an offline result's logprobs, as vLLM's ``Logprob``."""

    logprob: float
    rank: int | None = None  # 1 = most likely; None: outside the top-N returned (not computed)
    decoded_token: str | None = None  # the token's text (None with detokenize=False)


# Per position, the logprobs by token id: the chosen token first, then the top-N (vLLM's shape).
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt position; the first is None (no context scores it), as vLLM's.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One sample of an offline request (``LLM.generate`` / ``LLM.chat``), as vLLM's."""

    index: int  # the sample's place among the request's n
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the chosen tokens' logprobs; None unless logprobs
    logprobs: SampleLogprobs | None  # None unless SamplingParams.logprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string; None at EOS or length

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Result of one offline prompt: its ``n`` samples in ``outputs``, as vLLM's."""

    request_id: str
    prompt: str | None  # the prompt text (a chat's rendered template); None for token ids
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None  # None unless SamplingParams.prompt_logprobs
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (sample 0's)


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
