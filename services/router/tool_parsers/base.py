"""What every tool-call parser returns: the plain content and the calls found in model output."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments


@dataclass
class ParsedOutput:
    content: str  # text outside the calls (and any call that did not parse)
    tool_calls: list[ToolCall] = field(default_factory=list)


class ToolParser:
    """Parse a whole output (``parse``) or a stream of text pieces (``feed`` then ``finish``)."""

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def feed(self, piece: str) -> ParsedOutput:
        """The content and calls completed by this piece; text that may still start a call is held."""
        raise NotImplementedError

    def finish(self) -> ParsedOutput:
        """Whatever is held at the end of the stream (an unterminated call is content)."""
        raise NotImplementedError
