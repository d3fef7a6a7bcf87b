"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's request and response shapes.

/tokenize   {"model", "prompt", "add_special_tokens"=true}              -> {"count", "max_model_len", "tokens"}
            {"model", "messages", "add_generation_prompt"=true}        -> the chat template's tokens
/detokenize {"model", "tokens"}                                          -> {"prompt"}
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.params import Depends
from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.chat_template import render_chat
from services.router.chat import message_chars
from services.router.errors import bad_request
from services.router.limits import check_prompt_chars
from services.router.protocol import ChatMessage
from services.router.serving import ServingContext


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)  # [] is a 400, as in chat
    add_special_tokens: bool = True  # prompt only: the chat template writes its own
    add_generation_prompt: bool = True  # messages only


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    tokens: list[int] = Field(min_length=0)


class DetokenizeResponse(BaseModel):
    prompt: str


async def tokenize(ctx: ServingContext, body: TokenizeRequest) -> TokenizeResponse:
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if body.messages is not None:
        check_prompt_chars(message_chars(body.messages), ctx.max_prompt_chars, "messages")
        return await ctx.offload.in_thread(_tokenize_body, ctx, body)
    assert body.prompt is not None
    check_prompt_chars(len(body.prompt), ctx.max_prompt_chars, "prompt")
    return await ctx.offload.run(len(body.prompt), _tokenize_body, ctx, body)


def _tokenize_body(ctx: ServingContext, body: TokenizeRequest) -> TokenizeResponse:
    if body.messages is not None:
        msgs = [m.template_dict(j) for j, m in enumerate(body.messages)]
        _, ids = render_chat(
            ctx.tokenizer,
            msgs,
            add_generation_prompt=body.add_generation_prompt,
            check_text=lambda text: check_prompt_chars(len(text), ctx.max_prompt_chars, "messages"),
        )
    else:
        assert body.prompt is not None
        ids = (
            ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            if body.prompt
            else []
        )
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_len, tokens=list(ids))


async def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> DetokenizeResponse:
    ctx.check_model(body.model)
    return await ctx.offload.run(len(body.tokens), _detokenize_body, ctx, body)


def _detokenize_body(ctx: ServingContext, body: DetokenizeRequest) -> DetokenizeResponse:
    bad = [t for t in body.tokens if not 0 <= t < ctx.vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {ctx.vocab_size})", "tokens")
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens))


def install_tokenize_routes(app: FastAPI, ctx: ServingContext, guarded: list[Depends]) -> None:
    @app.post("/tokenize", dependencies=guarded)
    async def _tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenize(ctx, body)

    @app.post("/detokenize", dependencies=guarded)
    async def _detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await detokenize(ctx, body)
