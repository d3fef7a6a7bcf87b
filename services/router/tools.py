"""Tool calling in chat: ``tools`` / ``tool_choice`` to a constraint, and outputs to ``tool_calls``.

``required`` and a named function are enforced with structured outputs: a named function's
output is its parameters' JSON (the schema of ``function.parameters``); ``required`` outputs
``{"name": ..., "arguments": {...}}`` constrained to one of the tools. ``auto`` leaves the
output free and parses it with the configured parser (services/router/tool_parsers, default
Hermes). ``none``: no
tool calls. Streaming holds a forced call until the output is complete, then sends it as one
``delta.tool_calls`` (the reassembled stream equals the non-streaming answer).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from services.router.errors import APIError
from services.router.tool_parsers import get_parser


@dataclass(frozen=True)
class ToolMode:
    kind: str  # "named" | "required" | "auto"
    name: str | None  # the forced function (named)
    structured: tuple[str, str] | None
    parser: str = "hermes"  # auto: the tool-call parser (RouterConfig.tool_call_parser)


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(
                400, "each tool must be {'type': 'function', 'function': {'name': ...}}", param=f"tools.{j}"
            )
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise APIError(
                400,
                "function.parameters must be a JSON schema object",
                param=f"tools.{j}.function.parameters",
            )
        out[fn["name"]] = params
    return out


def tool_mode(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parser: str = "hermes"
) -> ToolMode | None:
    """None: no tool handling (no tools, or tool_choice none)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    fns = _functions(tools)
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):
        return ToolMode("auto", None, None, parser)
    if tool_choice == "required":
        alts = [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "arguments": p},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for n, p in fns.items()
        ]
        schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
        return ToolMode("required", None, ("json_schema", json.dumps(schema)))
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in fns:
            raise APIError(
                400, f"tool_choice names {name!r}, which is not in tools {sorted(fns)}", param="tool_choice"
            )
        return ToolMode("named", name, ("json_schema", json.dumps(fns[name])))
    raise APIError(
        400,
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', ...}",
        param="tool_choice",
    )


def _call(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def tool_message(mode: ToolMode, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished output."""
    if mode.kind == "named":
        assert mode.name is not None
        return None, [_call(0, mode.name, text)]
    if mode.kind == "required":
        try:
            obj = json.loads(text)
            return None, [_call(0, obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))]
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []  # cut off by max_tokens: what the model said, as content
    parsed = get_parser(mode.parser).parse(text)
    calls = [_call(i, c.name, c.arguments) for i, c in enumerate(parsed.tool_calls)]
    return (parsed.content or None) if calls else parsed.content, calls
