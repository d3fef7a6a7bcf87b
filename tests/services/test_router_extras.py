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
    app = create_app(FakeBackend(), tokenizer, [MODEL], MAX_MODEL_LEN, hidden_size=HIDDEN, detokenize="node")
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


def _schema(num_properties: int) -> dict:
    return {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(num_properties)}}


def test_a_1mb_schema_is_a_400_naming_the_limit_in_under_a_second(url: str) -> None:
    """20,000 string properties (~1 MB): refused before anything parses it (parsing alone took
    2.1 s on the event loop; compiling it froze a decode node for minutes)."""
    import json
    import time

    schema = _schema(20_000)
    size = len(json.dumps(schema).encode())
    assert size > 500_000
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}},
    }
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    elapsed_s = time.monotonic() - t0
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "router.max_grammar_bytes" in err["message"] and "65536" in err["message"], err
    assert "over 65536 bytes" in err["message"] and err["code"] == "grammar_too_large", err
    assert err["param"] == "response_format"
    assert elapsed_s < 1.0, elapsed_s
    extra = {"structured_outputs": {"json": schema}}
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    # a forced tool call's constraint is built from the tool's parameters: the same limit
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    forced = {**body, "response_format": None, "tools": [tool], "tool_choice": "required"}
    r = httpx.post(url + "/v1/chat/completions", json=forced, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert r.json()["error"]["code"] == "grammar_too_large"
    # under the limit the same shape passes the size check (the fake backend answers)
    small = {
        **body,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": _schema(20)}},
    }
    assert httpx.post(url + "/v1/chat/completions", json=small, timeout=30).status_code == 200


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


def _stream_choice(url: str, body: dict) -> tuple[str, dict, dict]:
    """The text, logprobs (runs concatenated) and usage of a one-choice stream."""
    import json

    text, lp, usage = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body) as s:
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            for c in ev["choices"]:
                text += c["text"]
                for k, v in (c["logprobs"] or {}).items():
                    lp[k] += v
    return text, lp, usage


@pytest.mark.parametrize("max_tokens", [3, 0])
def test_echo_with_logprobs_shape(url: str, tokenizer: Any, max_tokens: int) -> None:
    prompt = "hello there friend"
    ids = tokenizer.encode(prompt)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 2}
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    num = len(ids) + max_tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == num
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(ids)] == [-0.5 * j for j in range(1, len(ids))]  # the fake's
    assert lp["tokens"][: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
    offsets = [0]
    for tok in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert lp["text_offset"] == offsets
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == max_tokens and usage["prompt_tokens"] == len(ids)
    if max_tokens == 0:
        assert choice["text"] == prompt and choice["finish_reason"] == "length"
    text, slp, susage = _stream_choice(url, body)
    assert (text, slp) == (choice["text"], lp)
    assert susage["completion_tokens"] == max_tokens


def test_max_tokens_zero_without_echo_is_a_400(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_usage_reports_cached_tokens(url: str) -> None:
    body = {"model": MODEL, "prompt": "cached words " * 12, "max_tokens": 2}
    first = httpx.post(url + "/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    again = httpx.post(url + "/v1/completions", json=body).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == (again["prompt_tokens"] // 16) * 16 > 0
    _, _, streamed = _stream_choice(url, body)
    assert streamed["prompt_tokens_details"] == again["prompt_tokens_details"]


def test_echo_logprobs_batch_and_n_pick_each_choices_prompt(url: str, tokenizer: Any) -> None:
    prompts = ["one two", "three four five six"]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 1, "echo": True, "logprobs": 1}
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 4
    for c in choices:
        ids = tokenizer.encode(prompts[c["index"] // 2])
        lp = c["logprobs"]
        assert c["text"].startswith(prompts[c["index"] // 2])
        assert lp["tokens"][: len(ids)] == [tokenizer.decode([t]) for t in ids]
        assert lp["token_logprobs"][: len(ids)] == [None] + [-0.5 * j for j in range(1, len(ids))]
        assert len(lp["tokens"]) == len(ids) + 1
