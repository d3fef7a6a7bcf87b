"""GPU tests: the CUDA engine path (Triton attention, CUDA graphs) against transformers and eager.

Tests marked ``gpu`` skip cleanly without CUDA. The Triton attention kernel tests also run on CPU
under TRITON_INTERPRET=1 (tiny shapes); it must be set before triton is first imported, which
pdserve does lazily, so setting it here is early enough.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def make_llm() -> Iterator[Callable[..., Any]]:
    """Build ``LLM`` instances; at teardown every one must have its block pool fully free."""
    from pdserve.engine.llm import LLM

    made: list[LLM] = []

    def factory(model_dir: Any, **kwargs: Any) -> LLM:
        llm = LLM(str(model_dir), **kwargs)
        made.append(llm)
        return llm

    yield factory
    for llm in made:
        eng = llm.engine
        eng.kv.process_deferred_frees()
        assert not eng.has_unfinished(), "requests left unfinished"
        assert eng.kv.pool.num_used_blocks == 0, f"{eng.kv.pool.num_used_blocks} KV blocks still held"
    made.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
