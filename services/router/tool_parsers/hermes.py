"""Hermes-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

A block whose body is not a JSON object with a string ``name`` stays in the content as written
(the client sees what the model said; never a 500). Streaming holds back only text that could
be the start of ``<tool_call>`` or an open block, so content is never delayed by more than that.
"""

from __future__ import annotations

import json

from services.router.tool_parsers.base import ParsedOutput, ToolCall, ToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _call_of(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _partial_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesToolParser(ToolParser):
    def __init__(self) -> None:
        self._buf = ""

    def parse(self, text: str) -> ParsedOutput:
        p = HermesToolParser()
        a, b = p.feed(text), p.finish()
        return ParsedOutput(a.content + b.content, a.tool_calls + b.tool_calls)

    def feed(self, piece: str) -> ParsedOutput:
        self._buf += piece
        out = ParsedOutput("")
        while True:
            start = self._buf.find(OPEN)
            if start < 0:
                keep = _partial_prefix_len(self._buf, OPEN)
                out.content += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return out
            end = self._buf.find(CLOSE, start + len(OPEN))
            if end < 0:  # an open block: emit what precedes it, hold the rest
                out.content += self._buf[:start]
                self._buf = self._buf[start:]
                return out
            out.content += self._buf[:start]
            block = self._buf[start : end + len(CLOSE)]
            call = _call_of(self._buf[start + len(OPEN) : end])
            if call is None:
                out.content += block
            else:
                out.tool_calls.append(call)
            self._buf = self._buf[end + len(CLOSE) :]

    def finish(self) -> ParsedOutput:
        rest, self._buf = self._buf, ""
        return ParsedOutput(rest)
