"""``POST /v1/completions``: prompts (text, token ids, batches, prompt_embeds) to choices."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi.responses import JSONResponse
from starlette.responses import Response
from starlette.types import Receive

from pdserve.engine.outputs import GenerationDelta
from services.router.errors import bad_request
from services.router.limits import check_prompt_chars
from services.router.logprobs import completion_logprobs, echo_logprobs, merge_logprobs
from services.router.prompt_embeds import decode_prompt_embeds
from services.router.protocol import CompletionRequest
from services.router.serving import (
    Prompt,
    ServingContext,
    cached_tokens,
    check_token_ids,
    collect,
    fan_out,
    new_request_id,
    primed_sse,
    resolve_max_tokens,
    sampling_params,
    stream_events,
    usage,
)
from services.router.streams import until_disconnect


async def _prompts(ctx: ServingContext, body: CompletionRequest) -> list[Prompt]:
    """Tokenize / decode the prompt field(s): one Prompt per batch entry.

    Every bound that needs no tokenizing is checked first, on the event loop, in O(entries);
    the tokenizing (or decoding of prompt_embeds) runs on ``ctx.offload`` once the input is large.
    """
    prompt = body.prompt
    if body.prompt_embeds is not None:
        if prompt not in (None, "", []):
            raise bad_request("give either prompt or prompt_embeds, not both", "prompt")
        encoded = [body.prompt_embeds] if isinstance(body.prompt_embeds, str) else body.prompt_embeds
        if not encoded:
            raise bad_request("prompt_embeds is an empty list", "prompt_embeds")
        ctx.limits.check_prompts(len(encoded))
        ctx.limits.check_sequences(len(encoded), body.n)
        return await ctx.offload.run(sum(len(e) for e in encoded), _decode_embeds, ctx, encoded)
    if prompt is None or prompt == "" or prompt == []:
        raise bad_request("the prompt is empty", "prompt")
    if isinstance(prompt, str):
        batch: list[str] | list[list[int]] = [prompt]
    elif isinstance(prompt[0], int):
        batch = [prompt]  # type: ignore[list-item]
    else:
        batch = prompt  # type: ignore[assignment]
    ctx.limits.check_prompts(len(batch))  # before tokenizing a batch nobody will run
    ctx.limits.check_sequences(len(batch), body.n)
    for entry in batch:
        if isinstance(entry, str):
            check_prompt_chars(len(entry), ctx.max_prompt_chars, "prompt")
        elif len(entry) > ctx.max_model_len:
            resolve_max_tokens(ctx, len(entry), None, "prompt")  # raises context_length_exceeded
    return await ctx.offload.run(sum(len(e) for e in batch), _tokenize_batch, ctx, batch)


def _tokenize_batch(ctx: ServingContext, batch: list[str] | list[list[int]]) -> list[Prompt]:
    prompts = []
    for entry in batch:
        if isinstance(entry, str):
            token_ids = ctx.tokenizer.encode(entry, add_special_tokens=True) if entry else []
        else:
            token_ids = list(entry)
        check_token_ids(ctx, token_ids, "prompt")
        prompts.append(Prompt(token_ids))
    return prompts


def _decode_embeds(ctx: ServingContext, encoded: list[str]) -> list[Prompt]:
    return [
        Prompt(
            [],
            decode_prompt_embeds(
                e, hidden_size=ctx.hidden_size, max_bytes=ctx.max_prompt_embeds_bytes, param="prompt_embeds"
            ),
        )
        for e in encoded
    ]


async def create_completion(ctx: ServingContext, body: CompletionRequest, receive: Receive) -> Response:
    arrival_s = time.monotonic()
    lora_name = ctx.check_model(body.model)
    body.reject_unsupported()
    # echo with max_tokens 0 (vLLM's convention): the prompt only. The nodes still run one token
    # (the prefill that scores the prompt samples it); it is dropped here.
    echo_only = body.echo and body.max_tokens == 0
    engine_max_tokens = 1 if echo_only else body.max_tokens
    params = sampling_params(
        body, engine_max_tokens, body.logprobs, ctx.generation_defaults, ctx.max_grammar_bytes
    )
    if body.echo and body.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
    prompts = await _prompts(ctx, body)
    max_tokens = [resolve_max_tokens(ctx, p.num_tokens, engine_max_tokens, "max_tokens") for p in prompts]
    await ctx.backend.check_capacity()

    request_id = new_request_id("cmpl")
    reqs = fan_out(request_id, prompts, params, max_tokens, lora_name, arrival_s)
    n = len(reqs) // len(prompts)
    num_prompt_tokens = sum(p.num_tokens for p in prompts)
    echo = await ctx.offload.run(
        num_prompt_tokens if body.echo else 0, _echo_texts, ctx, body, prompts, len(reqs)
    )
    header: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
    }
    # With logprobs the echo goes out with the first delta, which brings the prompt's logprobs.
    echo_with_logprobs = bool(echo) and body.logprobs is not None

    if body.stream:
        text_offsets = [0] * len(reqs)
        echoed = [False] * len(reqs)

        def make_chunk(i: int, delta: GenerationDelta) -> dict[str, Any]:
            text = "" if echo_only else delta.text
            lp = None
            if echo_with_logprobs and not echoed[i]:
                echoed[i] = True
                text = echo[i] + text
                lp, text_offsets[i] = echo_logprobs(
                    ctx.token_texts, prompts[i // n].token_ids, delta.prompt_logprobs
                )
            if body.logprobs is not None and delta.logprobs and not echo_only:
                more, text_offsets[i] = completion_logprobs(ctx.token_texts, delta.logprobs, text_offsets[i])
                lp = more if lp is None else merge_logprobs(lp, more)
            finish_reason = "length" if echo_only and delta.finish_reason is not None else delta.finish_reason
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish_reason}
            if finish_reason is not None:
                choice["stop_reason"] = None if echo_only else delta.stop_reason
            return {"choices": [choice]}

        return await primed_sse(
            receive,
            stream_events(
                ctx,
                reqs,
                arrival_s,
                header,
                [] if echo_with_logprobs else _echo_chunks(echo),
                make_chunk,
                num_prompt_tokens,
                body.include_usage,
                num_prompts=len(prompts),
                count_tokens=(lambda d: 0) if echo_only else None,
            ),
        )

    results = await until_disconnect(receive, collect(ctx, reqs, arrival_s))
    choices = []
    for i, r in enumerate(results):
        lp = None
        if body.logprobs is not None:
            offset = 0
            if echo:
                lp, offset = echo_logprobs(ctx.token_texts, prompts[i // n].token_ids, r.prompt_logprobs)
            if not echo_only:
                more = completion_logprobs(ctx.token_texts, r.logprobs, offset)[0]
                lp = more if lp is None else merge_logprobs(lp, more)
        choices.append(
            {
                "index": i,
                "text": (echo[i] if echo else "") + ("" if echo_only else r.text),
                "logprobs": lp,
                "finish_reason": "length" if echo_only else r.finish_reason,
                "stop_reason": None if echo_only else r.stop_reason,
            }
        )
    completion_tokens = 0 if echo_only else sum(r.num_tokens for r in results)
    cached = cached_tokens([r.num_cached_tokens for r in results], len(prompts))
    return JSONResponse(
        {**header, "choices": choices, "usage": usage(num_prompt_tokens, completion_tokens, cached)}
    )


def _echo_texts(
    ctx: ServingContext, body: CompletionRequest, prompts: list[Prompt], num_choices: int
) -> list[str]:
    """Per choice, the prompt text that ``echo`` puts before the completion ([] when off)."""
    if not body.echo:
        return []
    n = num_choices // len(prompts)
    given = (
        body.prompt
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str)
        else None
    )
    texts = [
        given[p]
        if given is not None
        else body.prompt
        if isinstance(body.prompt, str)
        else ctx.tokenizer.decode(pr.token_ids)
        for p, pr in enumerate(prompts)
    ]
    return [texts[i // n] for i in range(num_choices)]


def _echo_chunks(echo: list[str]) -> list[dict[str, Any]]:
    """Streaming echo: each choice opens with its prompt text."""
    return [
        {"choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": None}]}
        for i, t in enumerate(echo)
    ]
