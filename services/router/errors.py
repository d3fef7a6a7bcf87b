"""Errors at the HTTP edge, in OpenAI's JSON shape (tier three of STYLE's error tiers).

Every non-2xx answer of the router has the body
``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``,
whatever raised it: our own checks, pydantic validation, an unknown route, a typed pdserve error.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.errors import (
    CapacityError,
    InvalidRequestError,
    PdserveError,
    PromptTooLongError,
    UnsupportedError,
)

logger = logging.getLogger(__name__)

# OpenAI's error "type" per status.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error to answer with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def to_api_error(exc: Exception) -> APIError:
    """Map a typed pdserve error (or an APIError) to what the client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param=exc.field or "messages", code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.field)
    if isinstance(exc, UnsupportedError):
        return APIError(400, str(exc), code="unsupported")
    if isinstance(exc, CapacityError):
        return APIError(503, str(exc) or "no serving capacity now; retry later", code="capacity_exhausted")
    if isinstance(exc, PdserveError):
        return APIError(500, str(exc))
    raise TypeError(f"not a client-facing error: {exc!r}")


# pydantic names the member of a union a value failed in its loc ("prompt", "list[int]", 0):
# no field of the request, so param leaves it out.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "dict", "list", "none"})


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_union_tag(p)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {msg}", None
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    @app.exception_handler(CapacityError)
    @app.exception_handler(UnsupportedError)
    async def _pdserve_error(_: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers malformed requests with 400, not FastAPI's default 422.
        message, param = _validation_message(exc)
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        phrase = (
            HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else ""
        )
        message = exc.detail if isinstance(exc.detail, str) else phrase
        return APIError(exc.status_code, message, code=phrase.lower().replace(" ", "_") or None).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not a client error: answer in OpenAI's shape; Starlette re-raises it for the log.
        return APIError(500, f"internal error: {type(exc).__name__}").response()
