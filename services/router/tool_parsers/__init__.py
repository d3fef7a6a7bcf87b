"""Tool-call parsers, one module per output format; ``get_parser(name)`` picks one by config."""

from __future__ import annotations

from pdserve.errors import ConfigError
from services.router.tool_parsers.base import ParsedOutput, ToolCall, ToolParser
from services.router.tool_parsers.hermes import HermesToolParser

PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser}


def check_parser(name: str) -> None:
    """Raise ConfigError (a ValueError) naming the supported parsers when ``name`` is not one."""
    if name not in PARSERS:
        raise ConfigError(f"unknown tool-call parser {name!r}; supported: {sorted(PARSERS)}")


def get_parser(name: str) -> ToolParser:
    check_parser(name)
    return PARSERS[name]()


__all__ = ["PARSERS", "ParsedOutput", "ToolCall", "ToolParser", "check_parser", "get_parser"]
