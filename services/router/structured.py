"""The request's structured-output constraint: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` extra mapped to SamplingParams.structured ``(kind, spec)``.

At most one constraint per request; the grammar itself is checked when SamplingParams is built
(pdserve.engine.structured.check), which turns a bad schema or regex into a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any

from services.router.errors import APIError

_EXTRA_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _spec_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def from_response_format(response_format: dict[str, Any] | None) -> tuple[str, str] | None:
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", "")
    if kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict | bool):
            raise APIError(
                400, "response_format.json_schema must be an object with a 'schema'", param="response_format"
            )
        return ("json_schema", json.dumps(js.get("schema", {})))
    raise APIError(
        400,
        f"response_format type {kind!r} is not supported; one of 'text', 'json_object', 'json_schema'",
        param="response_format.type",
    )


def from_extra(structured_outputs: dict[str, Any] | None) -> tuple[str, str] | None:
    if not structured_outputs:
        return None
    given = {k: v for k, v in structured_outputs.items() if v is not None}
    unknown = sorted(set(given) - set(_EXTRA_KINDS))
    if unknown:
        raise APIError(
            400,
            f"structured_outputs: unsupported key(s) {unknown}; one of {sorted(_EXTRA_KINDS)}",
            param="structured_outputs",
        )
    if len(given) != 1:
        raise APIError(
            400,
            "structured_outputs: give exactly one of json, regex, choice, grammar",
            param="structured_outputs",
        )
    ((key, value),) = given.items()
    if key in ("regex", "grammar") and not isinstance(value, str):
        raise APIError(400, f"structured_outputs.{key} must be a string", param=f"structured_outputs.{key}")
    if key == "choice" and not isinstance(value, list):
        raise APIError(
            400, "structured_outputs.choice must be a list of strings", param="structured_outputs.choice"
        )
    return (_EXTRA_KINDS[key], _spec_text(value))


def structured_of(
    response_format: dict[str, Any] | None, extra: dict[str, Any] | None
) -> tuple[str, str] | None:
    a, b = from_response_format(response_format), from_extra(extra)
    if a is not None and b is not None:
        raise APIError(
            400, "give either response_format or structured_outputs, not both", param="structured_outputs"
        )
    return a if a is not None else b
