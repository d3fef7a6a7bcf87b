"""Structured outputs through real router / prefill / decode processes with the openai client:
``chat.completions.parse`` with pydantic models, on the local path and through P→D."""

from __future__ import annotations

from enum import StrEnum

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

pytest.importorskip("xgrammar")

from tests.e2e.cluster import make_cluster_config, running_cluster

pytestmark = pytest.mark.slow


class Color(StrEnum):
    red = "red"
    green = "green"


class Point(BaseModel):
    x: int = Field(ge=-5, le=5)
    y: int = Field(ge=0, le=3)


class Nested(BaseModel):
    origin: Point
    tip: Point


class WithEnum(BaseModel):
    color: Color
    ok: bool


class WithArray(BaseModel):
    tags: list[Color] = Field(max_length=3)


class Bounded(BaseModel):
    score: float = Field(ge=0.0, le=1.0)
    count: int = Field(ge=1, le=9)


SCHEMAS = [Nested, WithEnum, WithArray, Bounded]
# the nodes' grammar_compile_timeout_s: the schemas above take milliseconds; the slow one below
# took just under 3 s on a quiet 2-core host (a 3 s limit let it through once), ~12 s on CI
GRAMMAR_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    cfg = make_cluster_config(
        tiny_models["llama"],
        router={"local_prefill_max_tokens": 48},
        all={"grammar_compile_timeout_s": GRAMMAR_TIMEOUT_S},
    )
    with running_cluster(cfg, tmp_path_factory.mktemp("structured-e2e")) as rc:
        yield rc


def _path_count(rc, path: str) -> float:
    text = httpx.get(rc.cluster.router_url + "/metrics").text
    key = f'pdserve:router_requests_by_path_total{{path="{path}"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))


def _messages(pd: bool, salt: int = 0) -> list[dict[str, str]]:
    # Short prompts prefill on decode (local); long ones go through prefill -> decode, each with
    # its own first block (a prefix decode has seen would be prefilled there).
    text = f"{salt} give me json" + " and more" * (40 if pd else 0)
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("pd", [False, True], ids=["local", "pd"])
def test_parse_returns_valid_objects(cluster, pd) -> None:
    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)
    path = "disaggregated" if pd else "local"
    before = _path_count(cluster, path)
    for j, model in enumerate(SCHEMAS):
        kw = dict(model=cluster.model_name, messages=_messages(pd, j), max_tokens=200, temperature=0.0)
        resp = client.chat.completions.parse(response_format=model, **kw)
        parsed = resp.choices[0].message.parsed
        assert isinstance(parsed, model), resp.choices[0].message.content
        model.model_validate_json(resp.choices[0].message.content)
        with client.chat.completions.stream(response_format=model, **kw) as stream:
            final = stream.get_final_completion()
        assert isinstance(final.choices[0].message.parsed, model)
        assert final.choices[0].message.content == resp.choices[0].message.content  # greedy: same
    # Every request took that path (the stream repeats its prompt: decode has seen it then).
    expected = 2 * len(SCHEMAS) if not pd else len(SCHEMAS)
    assert _path_count(cluster, path) - before >= expected, httpx.get(
        cluster.cluster.router_url + "/metrics"
    ).text


@pytest.mark.parametrize("pd", [False, True], ids=["local", "pd"])
def test_regex_and_choice_hold_for_50_seeded_samples(cluster, pd) -> None:
    """n=50 seeded samples (seed + i each) at temperature 1, through the router's fan-out."""
    import json
    import re

    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)
    pattern = r"[a-z]{2,6}-[0-9]{1,3}(\.(ok|no))?"
    choices = ["alpha", "beta", "gamma delta", "épsilon"]
    path = "disaggregated" if pd else "local"
    before = _path_count(cluster, path)
    for j, extra in enumerate(({"regex": pattern}, {"choice": choices})):
        prompt = _messages(pd, 40 + 2 * j + pd)[0]["content"]
        resp = client.completions.create(
            model=cluster.model_name,
            prompt=prompt,
            n=50,
            seed=1234,
            temperature=1.0,
            max_tokens=24,
            extra_body={"structured_outputs": extra},
        )
        texts = [c.text for c in resp.choices]
        assert len(texts) == 50
        if "regex" in extra:
            assert all(re.fullmatch(pattern, t) for t in texts), texts
        else:
            assert set(texts) <= set(choices), json.dumps(texts)
        assert len(set(texts)) > 1  # seeded samples differ (seed + i): the constraint is not one string
    # The first sequence of each request takes the path; the others may find decode warm.
    assert _path_count(cluster, path) - before >= 2


def test_invalid_regex_is_a_400_naming_it(cluster) -> None:
    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.completions.create(
            model=cluster.model_name,
            prompt="hi",
            max_tokens=4,
            extra_body={"structured_outputs": {"regex": "[a-"}},
        )


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["unit", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "clock",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["utc", "cet"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}


def _reassemble(stream) -> list[dict]:
    calls: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                cur = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                cur["name"] += tc.function.name or ""
                cur["arguments"] += tc.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "clock"}}, "required"])
def test_forced_tool_calls_through_pd(cluster, tool_choice) -> None:
    import json

    import jsonschema

    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)
    kw = dict(
        model=cluster.model_name,
        messages=_messages(pd=True, salt=7 if tool_choice == "required" else 8),
        tools=[WEATHER, CLOCK],
        tool_choice=tool_choice,
        max_tokens=120,
        temperature=0.0,
    )
    resp = client.chat.completions.create(**kw)
    calls = resp.choices[0].message.tool_calls
    assert calls and resp.choices[0].finish_reason == "tool_calls", resp
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in calls] == ["clock"]
    streamed = _reassemble(client.chat.completions.create(stream=True, **kw))
    assert streamed == [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]


# tool_choice auto: the output is free, and the router's configured parser (Hermes) finds the
# calls in it. The tiny random model would never write the format by itself, so a regex holds its
# output to two Hermes blocks after some text; what the router parses is still the model's output.
AUTO_REGEX = (
    r'Calling\. <tool_call>\{"name": "clock", "arguments": \{"tz": "(utc|cet)"\}\}</tool_call>'
    r'<tool_call>\{"name": "weather", "arguments": \{"unit": "(c|f)", "days": [1-7]\}\}</tool_call>'
)


def _reassemble_content(stream) -> tuple[str, list[dict], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                cur = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                cur["name"] += tc.function.name or ""
                cur["arguments"] += tc.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("pd", [False, True], ids=["local", "pd"])
def test_auto_tool_choice_parses_model_output(cluster, pd) -> None:
    import json

    import jsonschema

    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)
    path = "disaggregated" if pd else "local"
    before = _path_count(cluster, path)
    kw = dict(
        model=cluster.model_name,
        messages=_messages(pd, salt=30 + pd),
        tools=[WEATHER, CLOCK],
        tool_choice="auto",
        max_tokens=300,
        temperature=0.0,
        extra_body={"structured_outputs": {"regex": AUTO_REGEX}},
    )
    resp = client.chat.completions.create(**kw)
    assert _path_count(cluster, path) == before + 1
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls", resp
    assert msg.content == "Calling. "
    assert [c.function.name for c in msg.tool_calls] == ["clock", "weather"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for c in msg.tool_calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    content, calls, finish = _reassemble_content(client.chat.completions.create(stream=True, **kw))
    assert (content, finish) == (msg.content, "tool_calls")
    assert calls == [{"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls]
    # Output without a call block stays content: no tool_calls, the model's own finish reason.
    kw.pop("extra_body")
    plain = client.chat.completions.create(**{**kw, "max_tokens": 6})
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason in ("length", "stop") and plain.usage.completion_tokens <= 6


def test_a_schema_that_compiles_too_long_is_a_400_and_the_node_serves_on(cluster) -> None:
    """1,000 string properties (33 KB, under max_grammar_bytes) take ~3 s to compile on a quiet
    2-core host, ~12 s on the CI host: the decode node cancels the compile at grammar_compile_timeout_s and the request is a
    400 naming it; the node keeps serving, and json_object answers are objects."""
    import json
    import time

    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=60)
    props = {f"field_{i}": {"type": "string"} for i in range(1000)}
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "slow", "schema": {"type": "object", "properties": props}},
    }
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model=cluster.model_name, messages=_messages(False, 7), max_tokens=8, response_format=fmt
        )
    elapsed_s = time.monotonic() - t0
    assert f"grammar_compile_timeout_s={GRAMMAR_TIMEOUT_S:g}" in str(ei.value.message), ei.value.message
    assert elapsed_s < GRAMMAR_TIMEOUT_S + 20, elapsed_s  # the worker's first start, then the limit
    r = client.chat.completions.create(
        model=cluster.model_name,
        messages=_messages(False, 8),
        max_tokens=200,
        temperature=1.0,
        seed=3,
        response_format={"type": "json_object"},
    )
    text = r.choices[0].message.content or ""
    assert text.startswith("{"), text
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
