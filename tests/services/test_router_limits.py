"""Bounded input at the router: prompt count, prompts x n, body size -> OpenAI-shaped 4xx."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx

from services.router.limits import RequestLimits
from tests.services.test_router_api import (  # noqa: F401  (fixtures)
    MODEL,
    FakeBackend,
    ServerThread,
    _cmpl,
    assert_openai_error,
    server_factory,
    tokenizer,
)


def test_batch_of_1500_prompts_is_a_fast_400(server_factory: Callable[..., ServerThread]) -> None:  # noqa: F811
    backend = FakeBackend()
    srv = server_factory(backend)
    t0 = time.monotonic()
    resp = httpx.post(srv.url + "/v1/completions", json=_cmpl(prompt=["tell me a story"] * 1500), timeout=10)
    assert_openai_error(resp, 400, param="prompt", code="too_many_prompts")
    assert time.monotonic() - t0 < 2 and not backend.requests  # refused before any node work
    ok = httpx.post(srv.url + "/v1/completions", json=_cmpl(prompt=["a"] * 256), timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 256


def test_prompts_times_n_is_capped(server_factory: Callable[..., ServerThread]) -> None:  # noqa: F811
    backend = FakeBackend()
    srv = server_factory(
        backend, limits=RequestLimits(max_prompts_per_request=10, max_sequences_per_request=8)
    )
    assert_openai_error(
        httpx.post(srv.url + "/v1/completions", json=_cmpl(prompt=["a"] * 3, n=3)),
        400,
        "n",
        "too_many_sequences",
    )
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 9, "max_tokens": 2}
    assert_openai_error(
        httpx.post(srv.url + "/v1/chat/completions", json=chat), 400, "n", "too_many_sequences"
    )
    assert_openai_error(httpx.post(srv.url + "/v1/completions", json=_cmpl(n=0)), 400, "n")
    assert not backend.requests
    assert httpx.post(srv.url + "/v1/completions", json=_cmpl(prompt=["a"] * 2, n=4)).status_code == 200


def test_20mb_chat_body_is_refused_fast_with_413(server_factory: Callable[..., ServerThread]) -> None:  # noqa: F811
    backend = FakeBackend()
    srv = server_factory(backend)  # the default cap
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "x" * (20 * 1000 * 1000)}]}
    ).encode()
    t0 = time.monotonic()
    try:
        resp = httpx.post(
            srv.url + "/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=10,
        )
    except httpx.WriteError:  # the server may answer and close before the client wrote it all
        resp = None
    took = time.monotonic() - t0
    if resp is not None:
        assert_openai_error(resp, 413, code="request_too_large")
    assert took < 3, f"took {took:.1f} s"
    assert not backend.requests
