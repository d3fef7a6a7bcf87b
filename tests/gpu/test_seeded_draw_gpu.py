"""Seeded sampling on CUDA: every seeded row's draws come from the counter-based stream
(kernels/triton_seeded_draw.py) in one launch. A request's tokens do not depend on the batch
around it, a continuing engine (P/D: prefill sampled the first token) draws what the whole run
drew, and no per-request generator is kept."""

from __future__ import annotations

import pytest
import torch

from pdserve.config.engine import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _run(eng: LLMEngine, prompts: dict[str, list[int]], params: dict[str, SamplingParams], first=None):
    for rid, prompt in prompts.items():
        eng.add_request(prompt, params[rid], rid, output_token_ids=(first or {}).get(rid))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while eng.has_unfinished():
        for d in eng.step():
            out[d.request_id].extend(d.token_ids)
    return out


@pytest.mark.parametrize("handed", [1, 3])
def test_seeded_rows_are_batch_independent_and_continue_on_another_engine(tiny_models, handed) -> None:
    # Two engines live at once: each its own KV budget (the default takes 0.9 of the device).
    cache = CacheConfig(kv_cache_memory_bytes=256 << 20)
    cfg = EngineConfig(model=str(tiny_models["llama"]), device="cuda", cache=cache)
    eng = LLMEngine(cfg)
    assert isinstance(eng.runner, ModelRunner) and eng.runner.seeds.counter_draws
    prompt = [5, 17, 29, 41, 53, 65]
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = _run(eng, {"r": prompt}, {"r": sp})["r"]
    assert len(alone) == 16 and len(set(alone)) > 4  # really sampled
    noise = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    mixed = _run(
        eng,
        {"a": list(range(100, 140)), "r": prompt, "b": [9, 8, 7], "c": list(range(3, 60))},
        {"a": noise, "r": sp, "b": other, "c": noise},
    )
    assert mixed["r"] == alone
    # Every seeded row of a step draws its own stream (two here, in one launch).
    assert mixed["b"] == _run(eng, {"b": [9, 8, 7]}, {"b": other})["b"]
    assert eng.runner.num_generators == 0  # no generator kept on the counter-based path
    rest = _run(LLMEngine(cfg), {"r": prompt}, {"r": sp}, first={"r": alone[:handed]})["r"]
    assert rest == alone[handed:]
