"""The offline API's inputs and results: prompts in vLLM's forms in, RequestOutputs out.

``parse_prompts`` accepts what vLLM's ``LLM.generate`` does for text models; ``OfflineRequest``
gathers one prompt's ``n`` samples from the engine's deltas and builds its RequestOutput.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.outputs import (
    CompletionOutput,
    GenerationDelta,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
    TokenLogprob,
)
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError

# A string, token ids, {"prompt": str} or {"prompt_token_ids": [int, ...]} (vLLM's TextPrompt /
# TokensPrompt; a TokensPrompt may carry "prompt", the text it came from, returned as given).
PromptType = str | list[int] | Mapping[str, Any]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


@dataclass(frozen=True)
class ParsedPrompt:
    text: str | None  # tokenized by the engine when token_ids is None
    token_ids: list[int] | None


def _is_token_ids(p: object) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) for t in p)


def _parse_one(p: object, i: int) -> ParsedPrompt:
    if isinstance(p, str):
        return ParsedPrompt(p, None)
    if isinstance(p, list) and all(isinstance(t, int) for t in p):
        return ParsedPrompt(None, list(p))
    if isinstance(p, Mapping):
        unknown = sorted(set(p) - set(_PROMPT_KEYS))
        if unknown:
            raise InvalidRequestError(
                f"prompts[{i}]: key(s) {unknown} are not supported; a prompt dict takes "
                f"{list(_PROMPT_KEYS)} (text models, no multi-modal data or embeddings here)",
                field="prompts",
            )
        ids, text = p.get("prompt_token_ids"), p.get("prompt")
        if ids is not None:
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise InvalidRequestError(
                    f"prompts[{i}]: prompt_token_ids must be a list of ints", field="prompts"
                )
            return ParsedPrompt(text if isinstance(text, str) else None, list(ids))
        if isinstance(text, str):
            return ParsedPrompt(text, None)
    raise InvalidRequestError(
        f"prompts[{i}]: expected a string, a list of token ids, {{'prompt': str}} or "
        f"{{'prompt_token_ids': [int, ...]}}, got {type(p).__name__}",
        field="prompts",
    )


def parse_prompts(prompts: PromptType | Sequence[PromptType]) -> list[ParsedPrompt]:
    """One prompt or a list of them, as ParsedPrompts (an empty list gives none)."""
    if isinstance(prompts, str | Mapping) or _is_token_ids(prompts):
        return [_parse_one(prompts, 0)]
    if not isinstance(prompts, Sequence):
        raise InvalidRequestError(
            f"prompts: expected a prompt or a list of prompts, got {type(prompts).__name__}", field="prompts"
        )
    return [_parse_one(p, i) for i, p in enumerate(prompts)]


def logprob_dict(lp: TokenLogprob, decode: Any) -> dict[int, Logprob]:
    """One position's logprobs in vLLM's form: the chosen token first, then the top-N by rank."""
    ranks = {tid: j + 1 for j, (tid, _) in enumerate(lp.top)}
    out = {lp.token_id: Logprob(lp.logprob, ranks.get(lp.token_id), decode(lp.token_id))}
    for tid, value in lp.top:
        if tid not in out:
            out[tid] = Logprob(value, ranks[tid], decode(tid))
    return out


@dataclass
class SampleState:
    """One sample's deltas, gathered."""

    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    def add(self, d: GenerationDelta) -> None:
        assert self.finish_reason is None, f"{d.request_id}: delta after the finishing one"
        self.token_ids.extend(d.token_ids)
        self.text_parts.append(d.text)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.num_cached_tokens = d.num_cached_tokens
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
            self.stop_reason = d.stop_reason


@dataclass
class OfflineRequest:
    """One prompt of ``LLM.generate``: its ``params.n`` samples run as n=1 engine requests."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState] = field(init=False)

    def __post_init__(self) -> None:
        self.samples = [SampleState() for _ in range(self.params.n)]

    def result(self, tokenizer: Any) -> RequestOutput:
        sp = self.params
        cache: dict[int, str | None] = {}

        def decode(tid: int) -> str | None:
            if tid not in cache:
                cache[tid] = tokenizer.decode([tid]) if sp.detokenize and tokenizer is not None else None
            return cache[tid]

        outputs = []
        for i, s in enumerate(self.samples):
            logprobs: SampleLogprobs | None = None
            if sp.logprobs is not None:
                logprobs = [logprob_dict(lp, decode) for lp in s.logprobs]
            outputs.append(
                CompletionOutput(
                    index=i,
                    text="".join(s.text_parts),
                    token_ids=s.token_ids,
                    cumulative_logprob=sum(lp.logprob for lp in s.logprobs) if logprobs is not None else None,
                    logprobs=logprobs,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        prompt_logprobs: PromptLogprobs | None = None
        scored = self.samples[0].prompt_logprobs  # only sample 0 asks for them
        if sp.prompt_logprobs is not None and scored is not None:
            prompt_logprobs = [None, *(logprob_dict(lp, decode) for lp in scored)]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=all(o.finished() for o in outputs),
            num_cached_tokens=self.samples[0].num_cached_tokens,
        )
