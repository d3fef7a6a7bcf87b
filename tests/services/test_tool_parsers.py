"""The Hermes tool-call parser on fixed strings, whole and split at every character."""

from __future__ import annotations

import json

import pytest

from services.router.tool_parsers import ToolCall, get_parser

TWO_CALLS = (
    'Let me check. <tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>\n'
    '<tool_call>{"name": "time", "arguments": {"tz": "CET", "n": 2}}</tool_call> done'
)
MALFORMED = 'x <tool_call>{"name": "weather", "arguments": {"city": </tool_call> y'


def _streamed(text: str, cut: int) -> tuple[str, list[ToolCall]]:
    p = get_parser("hermes")
    content, calls = "", []
    for piece in (text[:cut], text[cut:]):
        o = p.feed(piece)
        content, calls = content + o.content, calls + o.tool_calls
    o = p.finish()
    return content + o.content, calls + o.tool_calls


def test_multiple_calls() -> None:
    out = get_parser("hermes").parse(TWO_CALLS)
    assert [c.name for c in out.tool_calls] == ["weather", "time"]
    assert json.loads(out.tool_calls[1].arguments) == {"tz": "CET", "n": 2}
    assert out.content == "Let me check. \n done"


def test_malformed_json_is_content() -> None:
    out = get_parser("hermes").parse(MALFORMED)
    assert out.tool_calls == [] and out.content == MALFORMED


def test_unterminated_block_is_content() -> None:
    text = 'a <tool_call>{"name": "x"'
    assert get_parser("hermes").parse(text).content == text


@pytest.mark.parametrize("text", [TWO_CALLS, MALFORMED, "plain <tool text", "<tool_call"])
def test_streaming_split_at_every_position_equals_whole(text: str) -> None:
    whole = get_parser("hermes").parse(text)
    for cut in range(len(text) + 1):
        assert _streamed(text, cut) == (whole.content, whole.tool_calls), cut
    # one character at a time
    p = get_parser("hermes")
    content, calls = "", []
    for ch in text:
        o = p.feed(ch)
        content, calls = content + o.content, calls + o.tool_calls
    o = p.finish()
    assert (content + o.content, calls + o.tool_calls) == (whole.content, whole.tool_calls)


def test_unknown_parser_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="mistral"):
        get_parser("mistral")


def test_router_refuses_an_unknown_parser_at_start(tiny_models) -> None:
    from transformers import AutoTokenizer

    from pdserve.config.cluster import RouterConfig
    from pdserve.errors import ConfigError
    from services.router.app import create_app
    from tests.services.test_router_api import FakeBackend

    assert RouterConfig().tool_call_parser == "hermes"
    tok = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    with pytest.raises(ConfigError, match=r"'pythonic'.*\['hermes'\]"):
        create_app(FakeBackend(), tok, ["m"], 64, tool_call_parser="pythonic")
    create_app(FakeBackend(), tok, ["m"], 64, tool_call_parser="hermes")
