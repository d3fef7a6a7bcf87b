"""Bounds on one HTTP request: how many prompts, how many sequences, how many bytes.

A request past a bound is refused with a 400 (413 for the body) in OpenAI's shape before any
tokenizing or node work, so one request cannot occupy a node's queue (a completions ``prompt``
of 1,500 strings) or the router's CPU (a 20 MB chat body) for everyone else.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.router.errors import APIError

# Bodies carrying no prompt_embeds need far less; images and embeddings raise it (create_app).
DEFAULT_MIN_BODY_BYTES = 16 << 20
# max_prompt_chars defaults to max_model_len times this: English averages about 4 characters a
# token with Llama / Qwen vocabularies, so a prompt 8x past that cannot fit the context; the
# longest entry of the tiny test Qwen3 vocabulary is 13 characters.
DEFAULT_CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class RequestLimits:
    max_prompts_per_request: int = 256  # entries of a completions batch
    max_sequences_per_request: int = 256  # prompts x n: backend sequences one request starts
    # Characters of one prompt (a completions entry, or a chat's message text), checked before
    # tokenizing; None: max_model_len x DEFAULT_CHARS_PER_TOKEN (ServingContext resolves it).
    max_prompt_chars: int | None = None
    tokenizer_threads: int = 4  # the pool that tokenizes and renders chat templates (offload.py)
    tokenize_timeout_s: float = 60.0  # one body's tokenizing / rendering, queue wait included

    def __post_init__(self) -> None:
        if self.max_prompts_per_request < 1 or self.max_sequences_per_request < 1:
            raise ValueError(f"request limits must be >= 1, got {self}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")

    def prompt_chars_limit(self, max_model_len: int) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return max_model_len * DEFAULT_CHARS_PER_TOKEN

    def check_prompts(self, num_prompts: int) -> None:
        if num_prompts > self.max_prompts_per_request:
            raise APIError(
                400,
                f"the prompt is a batch of {num_prompts} entries; at most "
                f"{self.max_prompts_per_request} per request (router.max_prompts_per_request)",
                param="prompt",
                code="too_many_prompts",
            )

    def check_sequences(self, num_prompts: int, n: int) -> None:
        if n < 1:
            raise APIError(400, f"n must be >= 1, got {n}", param="n")
        if num_prompts * n > self.max_sequences_per_request:
            raise APIError(
                400,
                f"{num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; at most "
                f"{self.max_sequences_per_request} per request (router.max_sequences_per_request)",
                param="n",
                code="too_many_sequences",
            )


def check_prompt_chars(num_chars: int, limit: int, param: str) -> None:
    """A prompt longer than ``limit`` characters is refused before it is tokenized."""
    if num_chars > limit:
        raise APIError(
            400,
            f"{param} has {num_chars} characters; at most {limit} per prompt (router.max_prompt_chars, "
            "by default max_model_len x 32): a longer prompt cannot fit this model's context",
            param=param,
            code="context_length_exceeded",
        )
