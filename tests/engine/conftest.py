from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest


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
        assert eng.kv.num_held_requests == 0
