"""Tool-call parsers, one module per output format; ``get_parser(name)`` picks one by config."""

from __future__ import annotations

from services.router.tool_parsers.base import ParsedOutput, ToolCall, ToolParser
from services.router.tool_parsers.hermes import HermesToolParser

PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; supported: {sorted(PARSERS)}") from None


__all__ = ["PARSERS", "ParsedOutput", "ToolCall", "ToolParser", "get_parser"]
