"""generation_config.json's sampling values fill what a request leaves unset, through the real
router app (the official openai client); a value the request sets wins."""

from __future__ import annotations

import json

import openai
import pytest

from pdserve.errors import ConfigError
from pdserve.models.config import generation_defaults
from tests.services.test_router_api import MODEL, FakeBackend, backend, server_factory, tokenizer

__all__ = ["backend", "server_factory", "tokenizer"]  # fixtures used here

DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}


def test_generation_defaults_are_read_from_the_checkpoint(tmp_path) -> None:
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({**DEFAULTS, "do_sample": True, "eos_token_id": [2, 7], "max_length": 10})
    )
    assert generation_defaults(tmp_path) == DEFAULTS
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ConfigError, match=r"generation_config\.json"):
        generation_defaults(tmp_path)


def test_unset_fields_take_the_defaults(server_factory, backend: FakeBackend) -> None:
    server = server_factory(backend, generation_defaults=DEFAULTS)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=10) as client:
        msgs = [{"role": "user", "content": "hi"}]
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)  # type: ignore[arg-type]
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0, top_p=0.5)
    chat, completion = (r.sampling_params for r in backend.requests)
    got = {k: getattr(chat, k) for k in DEFAULTS}
    assert got == DEFAULTS
    assert (completion.temperature, completion.top_p) == (0.0, 0.5)  # set by the request
    assert (completion.top_k, completion.repetition_penalty) == (20, 1.1)
