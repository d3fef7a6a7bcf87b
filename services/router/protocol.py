"""Request bodies of the OpenAI endpoints the router serves (pydantic, validated on arrival).

Unknown fields are ignored, as OpenAI's own server does, except the few below whose silent
dropping would change the answer (``logit_bias``, ``suffix``, tools, ...): those are accepted by the
schema and rejected with a 400 naming them (see ``reject_unsupported``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.chat_template import template_message
from pdserve.errors import InvalidRequestError
from services.router.errors import APIError

# Fields that reach the nodes as int32 (node.proto Sampling) and that SamplingParams bounds only
# from below: a larger value failed in the protobuf conversion, a 500.
_INT32_MAX = 2**31 - 1
Int32 = Annotated[int, Field(le=_INT32_MAX)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat; ``None`` means "the default"."""

    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extras (vLLM's names), sent through the openai client's extra_body.
    ignore_eos: bool = False
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[Int32] | None = None
    # Structured outputs: OpenAI's response_format and vLLM's extra
    # {"json": schema | "regex": str | "choice": [str] | "grammar": EBNF} (services/router/structured.py).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # OpenAI fields we do not implement: present here only to reject them by name.
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def reject_unsupported(self) -> None:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    # str | token ids | batch of str | batch of token ids; optional only with prompt_embeds.
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    # base64 of a safetensors file with one [num_tokens, hidden_size] tensor (or a batch of them).
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def reject_unsupported(self) -> None:
        super().reject_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                400, "max_tokens 0 is allowed only with echo (the prompt alone)", param="max_tokens"
            )
        if self.echo and self.prompt_embeds is not None:
            raise APIError(400, "echo is not supported with prompt_embeds", param="echo", code="unsupported")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", param="best_of", code="unsupported")


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None
    # image parts (services/router/multimodal.py): {"url": "data:image/png;base64,..."}, or
    # precomputed embeddings (base64 safetensors, [placeholder tokens, hidden]); uuid as vLLM's
    image_url: dict[str, Any] | None = None
    image_embeds: str | None = None
    uuid: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the template as given
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None

    def template_dict(self, index: int) -> dict[str, Any]:
        """The message as the chat template sees it (chat_template.template_message)."""
        try:
            return template_message(self.model_dump(exclude_none=True), index)
        except InvalidRequestError as e:  # a non-text content part
            raise APIError(400, str(e), param=e.field, code="unsupported") from e


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def reject_unsupported(self) -> None:
        super().reject_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
