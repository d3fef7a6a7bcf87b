"""Structured outputs in the engine: every seeded sample satisfies its regex / choice / schema."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("xgrammar")

from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError


def _texts(llm, structured: tuple[str, str], n: int, max_tokens: int = 48) -> list[str]:
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured=structured)
        for s in range(n)
    ]
    outs = llm.generate(["The answer is"] * n, params)
    return [o.text for o in outs]


def test_regex_and_choice_hold_for_50_seeded_samples(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["llama"], max_model_len=256)
    pattern = r"[a-c]{2,5}-[0-9]{3}"
    for text in _texts(llm, ("regex", pattern), 50):
        assert re.fullmatch(pattern, text), text
    choices = ["red", "green", "blue sky"]
    got = _texts(llm, ("choice", json.dumps(choices)), 50)
    assert all(t in choices for t in got), got
    assert len(set(got)) > 1  # sampled, not one forced answer


def test_json_schema_output_validates(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["llama"], max_model_len=512)
    schema = {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["color", "n"],
        "additionalProperties": False,
    }
    for text in _texts(llm, ("json_schema", json.dumps(schema)), 8, max_tokens=200):
        obj = json.loads(text)
        assert obj["color"] in ("red", "green") and 0 <= obj["n"] <= 9, obj


@pytest.mark.parametrize(
    ("structured", "needle"),
    [
        (("regex", "[a-"), "regex"),
        (("json_schema", "{not json"), "json_schema"),
        (("choice", "[]"), "choice"),
    ],
)
def test_invalid_constraint_names_the_problem(structured, needle) -> None:
    with pytest.raises(InvalidRequestError, match=needle):
        SamplingParams(structured=structured)
