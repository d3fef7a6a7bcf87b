"""``POST /v1/completions``: prompts (text, token ids, batches, prompt_embeds) to choices."""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import JSONResponse
from starlette.responses import Response
from starlette.types import Receive

from pdserve.engine.outputs import GenerationDelta
from services.router.errors import bad_request
from services.router.logprobs import completion_logprobs
from services.router.prompt_embeds import decode_prompt_embeds
from services.router.protocol import CompletionRequest
from services.router.serving import (
    Prompt,
    ServingContext,
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


def _prompts(ctx: ServingContext, body: CompletionRequest) -> list[Prompt]:
    """Tokenize / decode the prompt field(s): one Prompt per batch entry."""
    prompt = body.prompt
    if body.prompt_embeds is not None:
        if prompt not in (None, "", []):
            raise bad_request("give either prompt or prompt_embeds, not both", "prompt")
        encoded = [body.prompt_embeds] if isinstance(body.prompt_embeds, str) else body.prompt_embeds
        if not encoded:
            raise bad_request("prompt_embeds is an empty list", "prompt_embeds")
        ctx.limits.check_prompts(len(encoded))
        ctx.limits.check_sequences(len(encoded), body.n)
        return [
            Prompt(
                [],
                decode_prompt_embeds(
                    e,
                    hidden_size=ctx.hidden_size,
                    max_bytes=ctx.max_prompt_embeds_bytes,
                    param="prompt_embeds",
                ),
            )
            for e in encoded
        ]
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
    prompts = []
    for entry in batch:
        if isinstance(entry, str):
            token_ids = ctx.tokenizer.encode(entry, add_special_tokens=True) if entry else []
        else:
            token_ids = list(entry)
        check_token_ids(ctx, token_ids, "prompt")
        prompts.append(Prompt(token_ids))
    return prompts


async def create_completion(ctx: ServingContext, body: CompletionRequest, receive: Receive) -> Response:
    arrival_s = time.monotonic()
    ctx.check_model(body.model)
    body.reject_unsupported()
    params = sampling_params(body, body.max_tokens, body.logprobs)
    prompts = _prompts(ctx, body)
    max_tokens = [resolve_max_tokens(ctx, p.num_tokens, body.max_tokens, "max_tokens") for p in prompts]
    await ctx.backend.check_capacity()

    request_id = new_request_id("cmpl")
    reqs = fan_out(request_id, prompts, params, max_tokens)
    num_prompt_tokens = sum(p.num_tokens for p in prompts)
    echo = _echo_texts(ctx, body, prompts, len(reqs))
    header: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
    }

    if body.stream:
        text_offsets = [0] * len(reqs)

        def make_chunk(i: int, delta: GenerationDelta) -> dict[str, Any]:
            lp = None
            if body.logprobs is not None and delta.logprobs:
                lp, text_offsets[i] = completion_logprobs(ctx.token_texts, delta.logprobs, text_offsets[i])
            choice = {"index": i, "text": delta.text, "logprobs": lp, "finish_reason": delta.finish_reason}
            if delta.finish_reason is not None:
                choice["stop_reason"] = delta.stop_reason
            return {"choices": [choice]}

        return await primed_sse(
            receive,
            stream_events(
                ctx,
                reqs,
                arrival_s,
                header,
                _echo_chunks(echo),
                make_chunk,
                num_prompt_tokens,
                body.include_usage,
            ),
        )

    results = await until_disconnect(receive, collect(ctx, reqs, arrival_s))
    choices = []
    for i, r in enumerate(results):
        lp = completion_logprobs(ctx.token_texts, r.logprobs, 0)[0] if body.logprobs is not None else None
        choices.append(
            {
                "index": i,
                "text": (echo[i] if echo else "") + r.text,
                "logprobs": lp,
                "finish_reason": r.finish_reason,
                "stop_reason": r.stop_reason,
            }
        )
    completion_tokens = sum(r.num_tokens for r in results)
    return JSONResponse({**header, "choices": choices, "usage": usage(num_prompt_tokens, completion_tokens)})


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
