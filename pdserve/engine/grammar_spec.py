"""A request's structured-output constraint: its kinds, its size limit and its check.

A constraint is a ``(kind, spec)`` pair on SamplingParams (``KINDS``). It is checked where the
params are built (the router, or a node reading the proto: ``check``), and its size first
(``check_size``: the router's ``router.max_grammar_bytes``, a node's ``max_grammar_bytes``), so a
bad or oversized schema, regex or grammar is a 400 / INVALID_ARGUMENT naming the problem before
anything runs. ``_grammar`` turns a constraint into xgrammar's Grammar (the check, the engine's
``GrammarCompiler`` and the compile worker process); ``grammar_key`` is its cache key. xgrammar
(which imports torch) is imported only when a constraint is parsed.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

from pdserve.errors import InvalidRequestError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# OpenAI's ``json_object``: any JSON *object* (xgrammar's builtin JSON grammar also takes arrays
# and scalars at the top); strict_mode off so the object may hold any keys.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# The longest constraint spec (a JSON schema's text, a regex, an EBNF grammar) accepted by
# default: router.max_grammar_bytes at the router, max_grammar_bytes on a node. A 1 MB schema of
# 20,000 string properties took 2.1 s only to parse and did not compile in 9.5 minutes.
DEFAULT_MAX_GRAMMAR_BYTES = 65536


def grammar_key(kind: str, spec: str) -> str:
    """The cache key of a constraint: SHA-256 of its kind and spec."""
    return hashlib.sha256(f"{kind}\0{spec}".encode()).hexdigest()


def _grammar(kind: str, spec: str) -> Any:  # -> xgrammar.Grammar
    import xgrammar as xgr  # lazy: the scheduler's import path stays free of torch

    if kind == "json_object":
        return xgr.Grammar.from_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False)
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    if kind == "choice":
        choices = json.loads(spec)
        # EBNF string literals take JSON's escapes.
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in choices))
    raise AssertionError(kind)


def check_size(spec: str, max_bytes: int, setting: str, field: str = "response_format") -> None:
    """Raise InvalidRequestError naming ``setting`` when ``spec`` is longer than ``max_bytes``
    (UTF-8): checked before anything parses or compiles it."""
    num_bytes = len(spec.encode())
    if num_bytes > max_bytes:
        raise InvalidRequestError(
            f"the structured-output constraint (schema, regex or grammar) is {num_bytes} bytes; at "
            f"most {max_bytes} are accepted ({setting}): send a smaller one",
            field=field,
        )


@functools.lru_cache(maxsize=256)
def check(kind: str, spec: str) -> None:
    """Raise InvalidRequestError naming the problem when the constraint does not parse."""
    if kind not in KINDS:
        raise InvalidRequestError(f"structured_outputs: unknown kind {kind!r}; one of {KINDS}", field=kind)
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"choice: not a JSON list: {e}", field="choice") from e
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise InvalidRequestError("choice: must be a non-empty list of non-empty strings", field="choice")
    try:
        _grammar(kind, spec)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise InvalidRequestError(f"invalid {kind}: {msg}", field=kind) from e
