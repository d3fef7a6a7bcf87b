"""The router serves at most what the nodes' KV caches hold: a node that sized its cache under
the checkpoint's length reports fewer blocks (GetLoad), and /v1/models, /tokenize and the
context-length check follow (real router app, official openai client, a fake backend)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.services.test_router_api import (
    MAX_MODEL_LEN,
    MODEL,
    FakeBackend,
    backend,
    server_factory,
    tokenizer,
)

__all__ = ["backend", "server_factory", "tokenizer"]  # fixtures used here


class SmallCacheBackend(FakeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.capacity: int | None = None

    def kv_capacity_tokens(self) -> int | None:
        return self.capacity


def test_the_smallest_reported_cache_caps_the_length(server_factory) -> None:
    fake = SmallCacheBackend()
    server = server_factory(fake)
    models = lambda: httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]  # noqa: E731
    assert models()["max_model_len"] == MAX_MODEL_LEN  # no report yet: the configured length
    fake.capacity = 32
    assert models()["max_model_len"] == 32
    tok = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "hi"}, timeout=10).json()
    assert tok["max_model_len"] == 32
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=10) as client:
        client.completions.create(model=MODEL, prompt=[1] * 20, max_tokens=12)  # 32: fits
        with pytest.raises(openai.BadRequestError, match="maximum context length is 32 tokens"):
            client.completions.create(model=MODEL, prompt=[1] * 20, max_tokens=13)
    fake.capacity = 4 * MAX_MODEL_LEN  # a bigger cache never raises the configured length
    assert models()["max_model_len"] == MAX_MODEL_LEN


def test_the_pool_takes_the_smallest_reported_cache() -> None:
    from tests.services.test_pd_backend_policy import _with_backend

    def check(be: Any) -> list[int | None]:
        seen = [be.kv_capacity_tokens()]  # no GetLoad answered yet
        p0, p1, _p2 = be.prefill
        p0.num_blocks_total, p1.num_blocks_total = 1000, 600  # p2 has not reported
        seen.append(be.kv_capacity_tokens())
        be.decode[0].num_blocks_total, be.decode[0].block_size = 100, 32
        seen.append(be.kv_capacity_tokens())
        return seen

    assert _with_backend(check) == [None, 600 * 16, 100 * 32]
