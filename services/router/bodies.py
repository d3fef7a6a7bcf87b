"""Request bodies parsed once, for every route: JSON that is proper Unicode, or a 400 naming the field.

``CheckedJSONRoute`` is the app's route class: before FastAPI validates a body against a route's
pydantic model, it parses it here with pydantic's Rust parser (jiter), which also refuses lone
UTF-16 surrogates (``"a\\ud800b"`` is valid JSON but no valid text; the Rust tokenizer raised
TypeError on it, a 500). A refused body is parsed again with the stdlib parser to tell invalid
JSON (400) from a lone surrogate, whose 400 names the field (``messages.0.content``), so every
string of every route (prompts, message content, stop strings, tool fields, dict keys) is
checked in one place.

Measured on the 2-core dev host, a 15 MB body of one string: jiter 23 ms, ``json.loads`` 42 ms
(what FastAPI used); both hold the GIL, so running them on a thread would not free the event loop.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from services.router.errors import APIError

logger = logging.getLogger(__name__)


class _ParsedRequest(Request):
    """A request whose ``json()`` is ``parse_json_body`` of its body (cached, as Starlette's)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class CheckedJSONRoute(APIRoute):
    """Parses a non-empty body before FastAPI does, so its APIError reaches the app's handlers
    (inside FastAPI's handler any parse error becomes a generic 400 without a field)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            parsed = _ParsedRequest(request.scope, request.receive)
            if await parsed.body():
                await parsed.json()
            return await handler(parsed)

        return checked


def parse_json_body(body: bytes) -> Any:
    """The body's JSON value; APIError 400 for invalid JSON or a string that is not valid Unicode."""
    try:
        return pydantic_core.from_json(body)
    except ValueError as e:
        fast_error = str(e)
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"request body is not valid JSON: {e}") from e
    found = find_lone_surrogate(value)
    if found is None:
        # jiter refused what the stdlib accepts (stricter in corner cases): take the stdlib's value.
        logger.debug("jiter refused a body json.loads accepts: %s", fast_error)
        return value
    path, text, is_key = found
    where = f"a key of {path or 'the body'}" if is_key else path or "the body"
    raise APIError(
        400,
        f"{where} is not valid Unicode: {_describe(text)}; "
        "send UTF-8 text (a character outside the BMP as a \\uD8xx\\uDCxx pair)",
        param=path or None,
        code="invalid_unicode",
    )


def find_lone_surrogate(value: Any) -> tuple[str, str, bool] | None:
    """(dotted path, the string, whether it is a key of that path) of the first string or key
    holding a lone surrogate, else None.

    Iterative, so a deeply nested body cannot exhaust the recursion limit.
    """
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not _is_unicode(v):
                return path, v, False
        elif isinstance(v, dict):
            items = list(v.items())
            for k, _ in items:
                if not _is_unicode(k):
                    return path, k, True
            stack.extend((_join(path, k), x) for k, x in reversed(items))
        elif isinstance(v, list):
            stack.extend((_join(path, str(i)), x) for i, x in reversed(list(enumerate(v))))
    return None


def _is_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _describe(text: str) -> str:
    for i, ch in enumerate(text):
        if 0xD800 <= ord(ch) <= 0xDFFF:
            return f"a lone surrogate \\u{ord(ch):04x} at character {i}"
    raise AssertionError("no surrogate in a string that failed to encode")
