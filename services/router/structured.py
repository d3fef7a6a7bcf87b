"""The request's structured-output constraint: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` extra mapped to SamplingParams.structured ``(kind, spec)``.

At most one constraint per request; one longer than router.max_grammar_bytes is a 400 naming the
limit and its size before anything parses it (parsing alone took 2.1 s for a 1 MB schema); the
grammar itself is checked when SamplingParams is built (pdserve.engine.grammar_spec.check), which
turns a bad schema or regex into a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.engine.grammar_spec import DEFAULT_MAX_GRAMMAR_BYTES
from services.router.errors import APIError

_EXTRA_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _spec_text(value: Any, max_bytes: int | None = None) -> str:
    """``value`` as the spec's text (JSON for anything but a string). With ``max_bytes``, the
    encoding stops once past it (the text is then longer than the limit, not complete): a 1 MB
    schema costs 0.2 s to dump whole, a limit's worth a fraction of that."""
    if isinstance(value, str):
        return value
    if max_bytes is None:
        return json.dumps(value)
    parts: list[str] = []
    num_chars = 0
    for chunk in json.JSONEncoder().iterencode(value):
        parts.append(chunk)
        num_chars += len(chunk)
        if num_chars > max_bytes:  # ASCII output (ensure_ascii): one byte per character
            break
    return "".join(parts)


def from_response_format(
    response_format: dict[str, Any] | None, max_bytes: int | None = None
) -> tuple[str, str] | None:
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
        return ("json_schema", _spec_text(js.get("schema", {}), max_bytes))
    raise APIError(
        400,
        f"response_format type {kind!r} is not supported; one of 'text', 'json_object', 'json_schema'",
        param="response_format.type",
    )


def from_extra(
    structured_outputs: dict[str, Any] | None, max_bytes: int | None = None
) -> tuple[str, str] | None:
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
    return (_EXTRA_KINDS[key], _spec_text(value, max_bytes))


def structured_of(
    response_format: dict[str, Any] | None,
    extra: dict[str, Any] | None,
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
) -> tuple[str, str] | None:
    a, b = from_response_format(response_format, max_grammar_bytes), from_extra(extra, max_grammar_bytes)
    if a is not None and b is not None:
        raise APIError(
            400, "give either response_format or structured_outputs, not both", param="structured_outputs"
        )
    got = a if a is not None else b
    if got is not None:
        refuse_large(got, max_grammar_bytes, "response_format" if a is not None else "structured_outputs")
    return got


def refuse_large(structured: tuple[str, str], max_grammar_bytes: int, param: str) -> None:
    """A 400 naming router.max_grammar_bytes when the constraint's spec is longer (the spec may be
    cut short just past the limit: ``_spec_text``)."""
    kind, spec = structured
    if len(spec.encode()) > max_grammar_bytes:
        kind = "JSON schema" if kind == "json_schema" else kind
        raise APIError(
            400,
            f"the {kind} constraint is over {max_grammar_bytes} bytes long; at most "
            f"router.max_grammar_bytes={max_grammar_bytes} bytes are accepted: send a smaller one",
            param=param,
            code="grammar_too_large",
        )
