"""Per-body work off the router's event loop: tokenizing, chat templates, detokenizing.

    offload = TokenizerThreads(num_threads=4, timeout_s=60.0)
    ids = await offload.run(len(text), tokenizer.encode, text)   # inline when len(text) <= 2,048

A thread pool, not processes: measured on the 2-core dev host with the tiny Qwen3 tokenizer,
transformers' ``encode`` (which calls the Rust ``encode_batch``, run without the GIL) of 131,072
characters took 0.50 s while a thread sleeping 1 ms saw gaps of at most 20 ms (112 ms at 524,288
characters: the GIL is held while the ids become a Python list); the bare Rust
``Tokenizer.encode`` holds the GIL throughout (a 418 ms gap for 131,072 characters). Jinja chat
templates are Python, so they hold the GIL but yield it every switch interval (5 ms). The
prompt-length cap (``RequestLimits.max_prompt_chars``) bounds what one call can take.

Small inputs run inline: a hop to a thread and back costs more than tokenizing a short prompt.
A call that outlasts ``timeout_s`` answers 503; its thread finishes the call (a running thread
cannot be stopped) and its result is dropped.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from services.router.errors import APIError

T = TypeVar("T")

# Characters (or token ids) at most that are handled on the event loop itself.
INLINE_MAX_CHARS = 2048


class TokenizerThreads:
    """A bounded thread pool for the per-body work of requests; one per router process."""

    def __init__(self, num_threads: int, timeout_s: float, inline_max_chars: int = INLINE_MAX_CHARS) -> None:
        if num_threads < 1:
            raise ValueError(f"tokenizer threads must be >= 1, got {num_threads}")
        if timeout_s <= 0:
            raise ValueError(f"tokenize timeout must be > 0 s, got {timeout_s}")
        self.num_threads = num_threads
        self.timeout_s = timeout_s
        self.inline_max_chars = inline_max_chars
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="pdserve-tokenize")

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: inline when ``size`` (characters, token ids) is small, else on a pool thread.

        Exceptions of ``fn`` (APIError, PromptTooLongError, ...) propagate as they are.
        """
        if size <= self.inline_max_chars:
            return fn(*args)
        return await self.in_thread(fn, *args)

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a pool thread, whatever the size (chat templates: Python throughout)."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            raise APIError(
                503,
                f"tokenizing this request took over {self.timeout_s} s (router.tokenize_timeout_s); "
                "retry later or send a shorter prompt",
                code="tokenize_timeout",
            ) from None
