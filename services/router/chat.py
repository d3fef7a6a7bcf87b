"""``POST /v1/chat/completions``: messages through the chat template to choices."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse
from opentelemetry import trace
from starlette.responses import Response
from starlette.types import Receive

from pdserve import tracing
from pdserve.engine.chat_template import render_chat
from pdserve.engine.outputs import GenerationDelta
from pdserve.engine.sampling_params import SamplingParams
from services.router.errors import APIError, bad_request
from services.router.limits import check_prompt_chars
from services.router.logprobs import chat_logprobs
from services.router.multimodal import ImageItem, extract_images, has_image_parts, resolve_images
from services.router.protocol import ChatCompletionRequest, ChatMessage
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
from services.router.structured import refuse_large
from services.router.tools import ToolMode, tool_message, tool_mode


def message_chars(messages: list[ChatMessage]) -> int:
    """Characters of the messages' text content (string content and text parts)."""
    total = 0
    for m in messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content:
            total += sum(len(p.text or "") for p in m.content)
    return total


def render_chat_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> tuple[Prompt, list[ImageItem]]:
    """The prompt's token ids (one image token per image part) and the image parts in order.

    Runs on ``ctx.offload``: decoding images, the template and tokenizing are all per-body work.
    """
    images: list[ImageItem] = []
    raw = [m.model_dump(exclude_none=True) for m in body.messages]
    if has_image_parts(raw) and ctx.image_token_id is not None:
        # (a text-only model: template_dict below refuses the part, naming it)
        messages, images = extract_images(
            raw,
            hidden_size=ctx.hidden_size,
            max_image_bytes=ctx.max_image_bytes,
            max_embeds_bytes=ctx.max_prompt_embeds_bytes,
        )
    else:
        messages = [m.template_dict(j) for j, m in enumerate(body.messages)]
    tools = body.tools if body.tools and body.tool_choice != "none" else None
    _, token_ids = render_chat(
        ctx.tokenizer,
        messages,
        tools=tools,
        # tool fields, long names, ...: the rendered text is held to the cap too
        check_text=lambda text: check_prompt_chars(len(text), ctx.max_prompt_chars, "messages"),
    )
    if not images and ctx.image_token_id is not None and ctx.image_token_id in token_ids:
        raise bad_request("message text must not contain the image placeholder token", "messages")
    check_token_ids(ctx, token_ids, "messages")
    return Prompt(token_ids), images


async def with_images(
    ctx: ServingContext, request_id: str, prompt: Prompt, images: list[ImageItem]
) -> Prompt:
    """Images encoded (keys and lengths from an encoder) and their placeholders expanded."""
    if not images:
        return prompt
    assert ctx.image_token_id is not None
    ids, items = await resolve_images(
        ctx.encoders, request_id, prompt.token_ids, ctx.image_token_id, images, ctx.image_seq_length
    )
    check_token_ids(ctx, ids, "messages")
    for it in items:
        source = "client" if it.embeds is not None else "prefill" if it.image is not None else "encoder"
        ctx.metrics.images.labels(source).inc()
    return Prompt(ids, mm_items=items)


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, receive: Receive
) -> Response:
    arrival_s = time.monotonic()
    lora_name = ctx.check_model(body.model)
    body.reject_unsupported()
    requested = body.requested_max_tokens
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    num_top = body.top_logprobs or 0
    params = sampling_params(
        body, requested, num_top if body.logprobs else None, ctx.generation_defaults, ctx.max_grammar_bytes
    )
    ctx.limits.check_sequences(1, body.n)
    mode, params = _with_tools(body, params, ctx.tool_call_parser, ctx.max_grammar_bytes)
    check_prompt_chars(message_chars(body.messages), ctx.max_prompt_chars, "messages")
    prompt, images = await ctx.offload.in_thread(render_chat_prompt, ctx, body)
    request_id = new_request_id("chatcmpl")
    # With images the first sequence's root span starts here, so the encoder's spans join its trace.
    root = tracing.start_span("router.request", arrival_s) if images and tracing.enabled() else None
    with trace.use_span(root, end_on_exit=False) if root is not None else contextlib.nullcontext():
        prompt = await with_images(ctx, request_id, prompt, images)
    max_tokens = resolve_max_tokens(ctx, prompt.num_tokens, requested, max_tokens_param)
    await ctx.backend.check_capacity()

    reqs = fan_out(request_id, [prompt], params, [max_tokens], lora_name, arrival_s)
    reqs[0].trace_span = root
    created = int(time.time())

    if body.stream:
        header: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": body.model,
        }
        # Every choice opens with the role, as OpenAI's stream does.
        first = [
            {
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            }
            for i in range(len(reqs))
        ]

        def make_chunk(i: int, delta: GenerationDelta) -> dict[str, Any]:
            lp = (
                chat_logprobs(ctx.token_texts, delta.logprobs, num_top)
                if body.logprobs and delta.logprobs
                else None
            )
            content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
            choice = {"index": i, "delta": content, "logprobs": lp, "finish_reason": delta.finish_reason}
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
                first,
                _tool_chunks(mode) if mode is not None else make_chunk,
                prompt.num_tokens,
                body.include_usage,
            ),
        )

    results = await until_disconnect(receive, collect(ctx, reqs, arrival_s))
    if mode is not None:
        return _tool_response(mode, request_id, created, body.model, results, prompt.num_tokens)
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": r.text},
            "logprobs": chat_logprobs(ctx.token_texts, r.logprobs, num_top) if body.logprobs else None,
            "finish_reason": r.finish_reason,
            "stop_reason": r.stop_reason,
        }
        for i, r in enumerate(results)
    ]
    completion_tokens = sum(r.num_tokens for r in results)
    header = {"id": request_id, "object": "chat.completion", "created": created, "model": body.model}
    u = usage(prompt.num_tokens, completion_tokens, cached_tokens([r.num_cached_tokens for r in results], 1))
    return JSONResponse({**header, "choices": choices, "usage": u})


def _with_tools(
    body: ChatCompletionRequest, params: SamplingParams, parser: str, max_grammar_bytes: int
) -> tuple[ToolMode | None, SamplingParams]:
    """The request's tool mode, and its params with a forced call's constraint."""
    mode = tool_mode(body.tools, body.tool_choice, parser)
    if mode is None or mode.structured is None:
        return mode, params
    if params.structured is not None:
        raise APIError(
            400, "a forced tool_choice cannot be combined with response_format", param="tool_choice"
        )
    refuse_large(mode.structured, max_grammar_bytes, "tools")  # before anything parses it
    return mode, dataclasses.replace(params, structured=mode.structured)


def _tool_choice(mode: ToolMode, i: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    content, calls = tool_message(mode, text)
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return {"index": i, "message": msg, "logprobs": None, "finish_reason": finish_reason}


def _tool_response(
    mode: ToolMode, request_id: str, created: int, model: str, results: list[Any], num_prompt: int
) -> JSONResponse:
    choices = [_tool_choice(mode, i, r.text, r.finish_reason) for i, r in enumerate(results)]
    header = {"id": request_id, "object": "chat.completion", "created": created, "model": model}
    completion_tokens = sum(r.num_tokens for r in results)
    u = usage(num_prompt, completion_tokens, cached_tokens([r.num_cached_tokens for r in results], 1))
    return JSONResponse({**header, "choices": choices, "usage": u})


def _tool_chunks(mode: ToolMode) -> Callable[[int, GenerationDelta], dict[str, Any]]:
    """Stream chunks for tool mode: the output is held until it finishes, then its content and
    tool calls go out in one delta, so the reassembled stream equals the non-streaming answer."""
    texts: dict[int, str] = {}

    def make_chunk(i: int, delta: GenerationDelta) -> dict[str, Any]:
        texts[i] = texts.get(i, "") + delta.text
        if delta.finish_reason is None:
            return {"choices": [{"index": i, "delta": {}, "logprobs": None, "finish_reason": None}]}
        full = _tool_choice(mode, i, texts.pop(i), delta.finish_reason)
        d: dict[str, Any] = {}
        if full["message"]["content"]:
            d["content"] = full["message"]["content"]
        if "tool_calls" in full["message"]:
            d["tool_calls"] = full["message"]["tool_calls"]
        return {
            "choices": [{"index": i, "delta": d, "logprobs": None, "finish_reason": full["finish_reason"]}]
        }

    return make_chunk
