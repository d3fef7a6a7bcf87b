"""The router's /tokenize, /detokenize, /openapi.json, /docs and the structured-output 400s
(real uvicorn server thread, fake generation backend)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from services.router.app import create_app
from tests.services.test_router_api import HIDDEN, MAX_MODEL_LEN, MODEL, FakeBackend, ServerThread


@pytest.fixture(scope="module")
def tokenizer(tiny_models: Any) -> Any:
    return AutoTokenizer.from_pretrained(tiny_models["qwen3"])


@pytest.fixture(scope="module")
def url(tokenizer: Any):
    app = create_app(FakeBackend(), tokenizer, [MODEL], MAX_MODEL_LEN, hidden_size=HIDDEN)
    with ServerThread(app) as s:
        yield s.url


def test_tokenize_detokenize_round_trip(url: str, tokenizer: Any) -> None:
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode("hello world", add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    r = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == tokenizer.decode(body["tokens"])
    chat = httpx.post(
        url + "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)


def test_tokenize_errors_are_openai_400s(url: str) -> None:
    r = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": [10**9]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    r = httpx.post(url + "/tokenize", json={"model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert httpx.post(url + "/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    # Found by bench/fuzz.py: an empty conversation made the chat template raise (a 500).
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages"), r.text


def test_openapi_documents_the_extras(url: str) -> None:
    spec = httpx.get(url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(spec["paths"])
    props = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"structured_outputs", "response_format", "top_k"} <= set(props)
    assert httpx.get(url + "/docs").status_code == 200


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"structured_outputs": {"regex": "[a-"}}, "regex"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "json_schema",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"response_format": {"type": "yaml"}}, "yaml"),
    ],
)
def test_bad_constraint_is_a_400_naming_it(url: str, extra: dict, needle: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_echo_prepends_the_prompt_streaming_and_not(url: str) -> None:
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 3, "echo": True}
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    plain = httpx.post(url + "/v1/completions", json={**body, "echo": False}).json()["choices"][0]["text"]
    assert r.json()["choices"][0]["text"] == "hello there" + plain
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    import json

    assert "".join(json.loads(e)["choices"][0]["text"] for e in events) == "hello there" + plain
    r = httpx.post(url + "/v1/completions", json={**body, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
