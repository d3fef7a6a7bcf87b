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
