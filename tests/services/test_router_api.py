"""The router's OpenAI HTTP layer against a fake backend, driven by the official openai client.

The fake backend is deterministic: sequence ``k`` of a request emits token
``(sum(prompt) + seed + k) % 200 + 10`` with text ``" w<id>"``, one token per delta, up to
max_tokens ("length"). It can be told to refuse (CapacityError), to fail after one token, or to
stall after one token; it records every request and every cancellation (the router closing or
cancelling its generator before the natural end).
"""

from __future__ import annotations

import asyncio
import base64
import importlib.metadata
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
import uvicorn
from safetensors.torch import save as save_safetensors
from transformers import AutoTokenizer

from pdserve.engine.outputs import GenerationDelta, TokenLogprob
from pdserve.errors import CapacityError
from services.router.app import create_app
from services.router.backend import BackendRequest

MODEL = "tiny-qwen3"
MAX_MODEL_LEN = 128
HIDDEN = 64


def fake_token_ids(
    prompt_token_ids: list[int], num_embeds: int, seed: int | None, max_tokens: int
) -> list[int]:
    start = (sum(prompt_token_ids) or 7 * num_embeds) + (seed or 0)
    return [(start + k) % 200 + 10 for k in range(max_tokens)]


def fake_text(token_ids: list[int]) -> str:
    return "".join(f" w{t}" for t in token_ids)


class FakeBackend:
    def __init__(self) -> None:
        self.mode = "ok"  # "ok" | "full" | "fail" | "stall"
        self.requests: list[BackendRequest] = []
        self.cancelled: list[str] = []
        self.cancel_seen = threading.Event()  # set from the server thread
        self.seen_prompts: set[tuple[int, ...]] = set()  # a repeat reports whole blocks as cached
        self.forced_tokens: list[int] | None = None  # emit these token ids instead

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    async def check_capacity(self) -> None:
        if self.mode == "full":
            raise CapacityError("all decode nodes are full")

    async def generate(self, req: BackendRequest) -> AsyncIterator[GenerationDelta]:
        self.requests.append(req)
        sp = req.sampling_params
        assert sp.n == 1 and sp.max_tokens is not None
        num_embeds = 0 if req.prompt_embeds is None else req.prompt_embeds.shape[0]
        token_ids = fake_token_ids(req.prompt_token_ids, num_embeds, sp.seed, sp.max_tokens)
        if self.forced_tokens is not None:
            token_ids = self.forced_tokens[: sp.max_tokens]
        key = tuple(req.prompt_token_ids)
        cached = (len(key) // 16) * 16 if key in self.seen_prompts else 0
        self.seen_prompts.add(key)
        finished_normally = False
        try:
            for k, tid in enumerate(token_ids):
                if k == 1 and self.mode == "stall":
                    await asyncio.sleep(3600)
                if k == 1 and self.mode == "fail":
                    yield GenerationDelta(
                        req.request_id, [], "", finish_reason="error", error="decode node d0 died"
                    )
                    finished_normally = True
                    return
                lps = None
                if sp.logprobs is not None:
                    top = tuple((tid + j, -0.25 * (j + 1)) for j in range(sp.logprobs))
                    lps = [TokenLogprob(tid, -0.25, top)]
                last = k == len(token_ids) - 1
                # Prompt logprobs of token j: -0.5 * j, its top-N (t + m, -0.1 * (m + 1)).
                plp = None
                if k == 0 and sp.prompt_logprobs is not None:
                    ks = range(sp.prompt_logprobs)
                    plp = [
                        TokenLogprob(t, -0.5 * j, tuple((t + m, -0.1 * (m + 1)) for m in ks))
                        for j, t in enumerate(req.prompt_token_ids[1:], start=1)
                    ]
                yield GenerationDelta(
                    req.request_id,
                    [tid],
                    fake_text([tid]) if sp.detokenize else "",  # a node sends no text then
                    logprobs=lps,
                    finish_reason="length" if last else None,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_output_tokens=k + 1,
                    num_cached_tokens=cached,
                    prompt_logprobs=plp,
                )
                await asyncio.sleep(0)
            finished_normally = True
        finally:
            if not finished_normally:
                self.cancelled.append(req.request_id)
                self.cancel_seen.set()


class ServerThread:
    """uvicorn on a free 127.0.0.1 port in a background thread."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_models: Any) -> Any:
    return AutoTokenizer.from_pretrained(tiny_models["qwen3"])


@pytest.fixture(scope="module")
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture(scope="module")
def server_factory(tokenizer: Any) -> Iterator[Callable[..., ServerThread]]:
    servers: list[ServerThread] = []

    def start(backend: FakeBackend, **kwargs: Any) -> ServerThread:
        # The fake's text (" w12 w13") is a node's: the router takes it as it is, unless a test
        # asks the router to detokenize (router.detokenize's default).
        kwargs.setdefault("detokenize", "node")
        app = create_app(backend, tokenizer, [MODEL], MAX_MODEL_LEN, hidden_size=HIDDEN, **kwargs)
        servers.append(ServerThread(app).__enter__())
        return servers[-1]

    yield start
    for s in servers:
        s.__exit__()


@pytest.fixture(scope="module")
def server(server_factory: Callable[..., ServerThread], backend: FakeBackend) -> ServerThread:
    return server_factory(backend)


@pytest.fixture(autouse=True)
def _fresh_backend(backend: FakeBackend) -> None:
    backend.reset()


@pytest.fixture
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10) as c:
        yield c


@pytest.fixture
async def aclient(server: ServerThread) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10
    ) as c:
        yield c


def embeds_b64(t: torch.Tensor) -> str:
    return base64.b64encode(save_safetensors({"embeds": t.contiguous()})).decode()


# --- happy paths, official client -------------------------------------------------------------


def test_models_health_and_version(client: openai.OpenAI, server: ServerThread) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    version = httpx.get(server.url + "/version")  # vLLM's route: the package version
    assert version.status_code == 200 and version.json() == {"version": importlib.metadata.version("pdserve")}


def test_completion_text_prompt(client: openai.OpenAI, tokenizer: Any, backend: FakeBackend) -> None:
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5, temperature=0)
    prompt_ids = tokenizer.encode("hello world")
    expected = fake_token_ids(prompt_ids, 0, None, 5)
    assert out.id.startswith("cmpl-") and out.model == MODEL and out.created > 0
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [(0, fake_text(expected), "length")]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        len(prompt_ids),
        5,
        len(prompt_ids) + 5,
    )
    (req,) = backend.requests
    assert req.prompt_token_ids == prompt_ids and req.sampling_params.temperature == 0.0
    assert backend.cancelled == []


def test_completion_batch_of_token_ids_with_n2_and_seed(client: openai.OpenAI, backend: FakeBackend) -> None:
    out = client.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], n=2, seed=100, max_tokens=3)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    # choice p * n + i: prompt p, seed + i.
    for c, (prompt, seed) in zip(
        out.choices, [([1, 2, 3], 100), ([1, 2, 3], 101), ([4, 5], 100), ([4, 5], 101)], strict=True
    ):
        assert c.text == fake_text(fake_token_ids(prompt, 0, seed, 3))
    assert sorted(r.sampling_params.seed for r in backend.requests) == [100, 100, 101, 101]
    assert all(r.sampling_params.n == 1 for r in backend.requests)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 12)


def test_completion_stream_with_usage_matches_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="abc", max_tokens=6)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="abc", max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    )
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (full.usage.prompt_tokens, 6)
    assert all(c.usage is None for c in body)
    assert "".join(c.choices[0].text for c in body) == full.choices[0].text
    assert body[-1].choices[0].finish_reason == "length"


def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(v == -0.25 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_renders_template_and_content_parts(
    client: openai.OpenAI, tokenizer: Any, backend: FakeBackend
) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
    ]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=4)
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\nthere"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    (req,) = backend.requests
    assert req.prompt_token_ids == prompt_ids
    assert out.id.startswith("chatcmpl-")
    (choice,) = out.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == fake_text(fake_token_ids(prompt_ids, 0, None, 4))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), 4)


def test_chat_default_max_tokens_fills_the_context(client: openai.OpenAI, backend: FakeBackend) -> None:
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    (req,) = backend.requests
    assert req.sampling_params.max_tokens == MAX_MODEL_LEN - len(req.prompt_token_ids)
    assert out.usage.total_tokens == MAX_MODEL_LEN


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob == -0.25 and isinstance(entry.token, str)
        assert entry.bytes == list(entry.token.encode()) or entry.token.startswith("bytes:")
        assert [t.logprob for t in entry.top_logprobs] == [-0.25, -0.5]


def test_chat_logprob_bytes_of_split_characters(
    client: openai.OpenAI, backend: FakeBackend, tokenizer
) -> None:
    """Byte-level BPE tokens that each hold part of a multi-byte character: no U+FFFD in
    ``token`` (``bytes:\\xHH`` instead), and the tokens' bytes join to the text."""
    text = "é€😊 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    partial = [t for t in ids if "\ufffd" in tokenizer.decode([t])]
    assert partial, "the tokenizer should split these characters"
    backend.forced_tokens = ids
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=len(ids),
        logprobs=True,
        top_logprobs=1,
    )
    content = out.choices[0].logprobs.content
    assert bytes(b for e in content for b in e.bytes) == text.encode()
    assert not any("\ufffd" in e.token for e in content)
    for e, tid in zip(content, ids, strict=True):
        if tid in partial:
            assert e.token == "bytes:" + "".join(f"\\x{b:02x}" for b in e.bytes)
        else:
            assert e.token == tokenizer.decode([tid]) and e.bytes == list(e.token.encode())


async def test_chat_stream_n2_async(aclient: openai.AsyncOpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "hello"}]
    full = await aclient.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, n=2, seed=3)
    stream = await aclient.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        n=2,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    texts = {0: "", 1: ""}
    first_seen: dict[int, Any] = {}
    for c in body:
        assert c.object == "chat.completion.chunk" and c.usage is None and len(c.choices) == 1
        ch = c.choices[0]
        first_seen.setdefault(ch.index, ch.delta)
        texts[ch.index] += ch.delta.content or ""
    assert all(d.role == "assistant" for d in first_seen.values())
    assert texts == {c.index: c.message.content for c in full.choices}
    assert texts[0] != texts[1]  # seed + i


def test_raw_sse_framing(server: ServerThread) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}
    body.update(logprobs=True, top_logprobs=1)
    resp = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = resp.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" not in c for c in chunks)  # only with include_usage
    assert [len(c["choices"][0]["logprobs"]["content"]) for c in chunks[1:]] == [1, 1]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]


def test_extras_reach_sampling_params(client: openai.OpenAI, backend: FakeBackend) -> None:
    client.completions.create(
        model=MODEL,
        prompt="abc",
        max_tokens=4,
        stop="END",
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        top_p=0.9,
        extra_body={
            "ignore_eos": True,
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "min_tokens": 2,
            "stop_token_ids": [7],
        },
    )
    sp = backend.requests[0].sampling_params
    assert (sp.stop, sp.stop_token_ids, sp.ignore_eos, sp.top_k, sp.min_p) == (["END"], [7], True, 5, 0.1)
    assert (sp.repetition_penalty, sp.min_tokens, sp.top_p) == (1.2, 2, 0.9)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.max_tokens) == (0.5, -0.5, 4)


def test_prompt_embeds(client: openai.OpenAI, backend: FakeBackend) -> None:
    embeds = torch.randn(4, HIDDEN, dtype=torch.bfloat16)
    out = client.completions.create(
        model=MODEL, prompt="", max_tokens=2, extra_body={"prompt_embeds": embeds_b64(embeds)}
    )
    (req,) = backend.requests
    assert req.prompt_token_ids == [] and req.prompt_embeds is not None
    assert torch.equal(req.prompt_embeds, embeds)
    assert out.usage.prompt_tokens == 4
    assert out.choices[0].text == fake_text(fake_token_ids([], 4, None, 2))


# --- errors ------------------------------------------------------------------------------------


def assert_openai_error(
    resp: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["type"], str)
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body


def _cmpl(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kw}


_GOOD_EMBEDS = embeds_b64(torch.zeros(2, HIDDEN))
_BAD_EMBEDS = {
    "float64": embeds_b64(torch.zeros(3, HIDDEN, dtype=torch.float64)),
    "int": embeds_b64(torch.zeros(3, HIDDEN, dtype=torch.int32)),
    "nan": embeds_b64(torch.full((3, HIDDEN), math.nan)),
    "inf": embeds_b64(torch.full((3, HIDDEN), math.inf, dtype=torch.float16)),
    "hidden": embeds_b64(torch.zeros(3, HIDDEN + 1)),
    "3d": embeds_b64(torch.zeros(1, 3, HIDDEN)),
    "empty": embeds_b64(torch.zeros(0, HIDDEN)),
    "not_base64": "!!!not base64!!!",
    "not_safetensors": base64.b64encode(b"\x80\x04pickle?").decode(),
}


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        ("/v1/completions", _cmpl(temperature=-1), "temperature", None),
        ("/v1/completions", _cmpl(temperature="hot"), "temperature", None),  # pydantic: 400, not 422
        ("/v1/completions", _cmpl(prompt=""), "prompt", None),
        ("/v1/completions", _cmpl(prompt=[]), "prompt", None),
        ("/v1/completions", _cmpl(prompt=[1, 99999]), "prompt", None),
        ("/v1/completions", _cmpl(prompt=[1, -1]), "prompt", None),
        ("/v1/completions", _cmpl(max_tokens=0), "max_tokens", None),
        ("/v1/completions", _cmpl(max_tokens=MAX_MODEL_LEN), "max_tokens", "context_length_exceeded"),
        (
            "/v1/completions",
            _cmpl(prompt=list(range(1, MAX_MODEL_LEN + 1))),
            "max_tokens",
            "context_length_exceeded",
        ),
        (  # a prompt that fills the context, max_tokens unset (chat's default path)
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]},
            "max_tokens",
            "context_length_exceeded",
        ),
        ("/v1/completions", _cmpl(n=0), "n", None),
        ("/v1/completions", _cmpl(logprobs=21), "logprobs", None),
        ("/v1/completions", _cmpl(stream_options={"include_usage": True}), "stream_options", None),
        ("/v1/completions", {"prompt": "x"}, "model", None),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages", None),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 500},
            "max_completion_tokens",
            "context_length_exceeded",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
            None,
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
            "messages.0.content.0.type",
            "unsupported",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
            None,
            None,
        ),
    ]
    + [
        ("/v1/completions", _cmpl(prompt="", prompt_embeds=b64), "prompt_embeds", None)
        for b64 in _BAD_EMBEDS.values()
    ]
    + [
        (
            "/v1/completions",
            _cmpl(prompt="", prompt_embeds=embeds_b64(torch.zeros(MAX_MODEL_LEN, HIDDEN))),
            "max_tokens",
            "context_length_exceeded",
        ),
        ("/v1/completions", _cmpl(prompt="x", prompt_embeds=_GOOD_EMBEDS), "prompt", None),
    ],
    ids=lambda v: v if isinstance(v, str) and not v.startswith("/") and len(v) < 40 else None,
)
def test_bad_requests_are_400_in_openai_shape(
    server: ServerThread,
    backend: FakeBackend,
    path: str,
    body: dict[str, Any],
    param: str | None,
    code: str | None,
) -> None:
    assert_openai_error(httpx.post(server.url + path, json=body), 400, param, code)
    assert backend.requests == []


def test_invalid_json_is_400(server: ServerThread) -> None:
    resp = httpx.post(
        server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert_openai_error(resp, 400)


def test_oversized_body_is_413(server_factory: Callable[..., ServerThread]) -> None:
    srv = server_factory(FakeBackend(), max_body_bytes=1000)
    assert_openai_error(httpx.post(srv.url + "/v1/completions", json=_cmpl(prompt="x" * 2000)), 413)

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield json.dumps(_cmpl(prompt="x" * 2000)).encode()

    assert_openai_error(httpx.post(srv.url + "/v1/completions", content=chunked()), 413)
    assert httpx.post(srv.url + "/v1/completions", json=_cmpl()).status_code == 200


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", temperature=101)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=MAX_MODEL_LEN)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404 and e.value.code == "model_not_found"


def test_unknown_model_and_route_are_404(server: ServerThread) -> None:
    assert_openai_error(
        httpx.post(server.url + "/v1/completions", json=_cmpl(model="gpt-9")), 404, "model", "model_not_found"
    )
    assert_openai_error(httpx.get(server.url + "/v1/nothing"), 404)


def test_capacity_error_is_503(client: openai.OpenAI, server: ServerThread, backend: FakeBackend) -> None:
    backend.mode = "full"
    assert_openai_error(httpx.post(server.url + "/v1/completions", json=_cmpl()), 503)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 503
    assert backend.requests == []


def test_backend_error_is_500_or_error_event(
    client: openai.OpenAI, server: ServerThread, backend: FakeBackend
) -> None:
    backend.mode = "fail"
    resp = httpx.post(server.url + "/v1/completions", json=_cmpl())
    assert_openai_error(resp, 500)
    assert "decode node d0 died" in resp.json()["error"]["message"]
    stream = client.completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True)
    with pytest.raises(openai.APIError, match="decode node d0 died"):
        list(stream)


def test_api_key(server_factory: Callable[..., ServerThread]) -> None:
    guarded = server_factory(FakeBackend(), api_key="sekret")
    assert_openai_error(httpx.get(guarded.url + "/v1/models"), 401, code="invalid_api_key")
    wrong = httpx.post(
        guarded.url + "/v1/completions", json=_cmpl(), headers={"Authorization": "Bearer nope"}
    )
    assert_openai_error(wrong, 401)
    with (
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError) as e,
    ):
        bad.models.list()
    assert e.value.status_code == 401
    with openai.OpenAI(base_url=guarded.url + "/v1", api_key="sekret", max_retries=0) as ok:
        assert ok.completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1
    assert httpx.get(guarded.url + "/health").status_code == 200
    assert httpx.get(guarded.url + "/version").status_code == 200  # open, as vLLM's
    assert httpx.get(guarded.url + "/metrics").status_code == 200


# --- cancellation and metrics --------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_disconnect_aborts_backend(server: ServerThread, backend: FakeBackend, path: str) -> None:
    backend.mode = "stall"
    body = {"model": MODEL, "max_tokens": 8, "stream": True, "n": 2}
    body.update(
        {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    )
    with httpx.Client(base_url=server.url) as http, http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        line = next(line for line in resp.iter_lines() if line.startswith("data: "))
        assert json.loads(line.removeprefix("data: "))["choices"]
    # Leaving the blocks closed the connection: both choices must be aborted promptly.
    deadline = time.monotonic() + 1.0
    while len(backend.cancelled) < 2:
        assert time.monotonic() < deadline, f"cancelled only {backend.cancelled}"
        time.sleep(0.01)


def test_non_stream_disconnect_aborts_backend(server: ServerThread, backend: FakeBackend) -> None:
    backend.mode = "stall"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=_cmpl(), timeout=0.3)
    assert backend.cancel_seen.wait(1.0), "the router did not abort the backend request"


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_per_app_registry(server_factory: Callable[..., ServerThread]) -> None:
    srv = server_factory(FakeBackend())
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as c:
        c.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, n=2)
        assert len(list(c.completions.create(model=MODEL, prompt=[1, 2], max_tokens=3, stream=True))) == 3
    text = httpx.get(srv.url + "/metrics").text
    # Three sequences: two choices of 4 tokens on [1, 2, 3], one of 3 tokens on [1, 2].
    assert _metric(text, "pdserve:time_to_first_token_seconds_count") == 3
    assert _metric(text, "pdserve:inter_token_latency_seconds_count") == 3 + 3 + 2
    assert _metric(text, "pdserve:e2e_request_latency_seconds_count") == 3
    assert 'pdserve:request_success_total{finished_reason="length"} 3.0' in text
    assert _metric(text, "pdserve:prompt_tokens_total") == 3 + 3 + 2
    assert _metric(text, "pdserve:generation_tokens_total") == 4 + 4 + 3
    assert _metric(text, "pdserve:num_requests_running") == 0


def test_the_router_makes_the_text_when_the_node_sends_token_ids_only(
    server_factory: Callable[..., ServerThread], tokenizer: Any
) -> None:
    """``router.detokenize: router`` (the default): a request without stop strings reaches the
    node with ``detokenize`` off (the fake then sends no text, as a node does) and the router
    decodes the ids incrementally: characters split over tokens come out whole, streamed chunks
    join to the non-streamed text, and both equal a full decode. With a stop string the node
    keeps making the text (the fake's words)."""
    backend = FakeBackend()
    srv = server_factory(backend, detokenize="router")
    text = "é€😊 ok, done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), "the tokenizer should split these"
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=10) as c:
        backend.forced_tokens = ids
        out = c.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=len(ids))
        assert out.choices[0].text == text
        assert backend.requests[-1].sampling_params.detokenize is False
        chunks = [
            ch.choices[0].text
            for ch in c.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=len(ids), stream=True)
            if ch.choices
        ]
        assert "".join(chunks) == text and not any("\ufffd" in t for t in chunks), chunks
        chat = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=len(ids)
        )
        assert chat.choices[0].message.content == text
        out = c.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3, stop=["zzz"])
        assert backend.requests[-1].sampling_params.detokenize is True
        assert out.choices[0].text == fake_text(ids[:3])
