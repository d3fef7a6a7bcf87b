"""A seeded request continued on another engine (P/D: prefill sampled its first token) draws
the same tokens as the whole request on one engine: the continuing engine skips the draws of the
tokens it was handed instead of restarting the seed's stream (found through two router workers:
seeded P/D answers differed from the colocated ones from the second token on)."""

from __future__ import annotations

import pytest

from pdserve.config.engine import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams


def _run(
    eng: LLMEngine, prompt: list[int], params: SamplingParams, first: list[int] | None = None
) -> list[int]:
    eng.add_request(prompt, params, "r", output_token_ids=first)
    out: list[int] = []
    while eng.has_unfinished():
        for d in eng.step():
            out.extend(d.token_ids)
    return out


@pytest.mark.parametrize("handed", [1, 3])
def test_a_seeded_request_continues_its_stream_on_another_engine(tiny_models, handed) -> None:
    cfg = EngineConfig(model=str(tiny_models["llama"]), device="cpu")
    prompt = [5, 17, 29, 41, 53, 65]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    whole = _run(LLMEngine(cfg), prompt, params)
    assert len(whole) == 16 and len(set(whole)) > 4  # really sampled, not one repeated token
    rest = _run(LLMEngine(cfg), prompt, params, first=whole[:handed])
    assert rest == whole[handed:]


def test_an_idle_engine_keeps_no_generator_of_finished_or_aborted_requests(tiny_models) -> None:
    """A seeded request's generator lives while it runs; once the engine is idle (no step to
    come), none is left, whether its requests finished or were aborted mid-way."""
    eng = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), device="cpu"))
    assert isinstance(eng.runner, ModelRunner)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    for i in range(3):
        eng.add_request([5, 17, 29, 41 + i], params, f"done-{i}")
    while eng.has_unfinished():
        eng.step()
    assert eng.runner.num_generators == 0
    eng.add_request([5, 17, 29], params, "cut")
    eng.step()
    assert eng.runner.num_generators == 1  # running: kept
    eng.abort(["cut"])
    assert not eng.has_unfinished() and eng.runner.num_generators == 0
