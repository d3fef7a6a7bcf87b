"""n-gram speculative decoding on CUDA: with CUDA graphs captured (steps without drafts replay
them, steps with drafts run eagerly with 1 + m tokens a row through the Triton attention) the
greedy tokens equal the engine's without speculation, and asynchronous scheduling is off."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampling_params import SamplingParams

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@requires_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_equal_with_cuda_graphs(dtype, tiny_models, make_llm) -> None:
    prompts = [{"prompt_token_ids": [(i * 7 + j) % 50 + 5 for j in range(3 + i * 9)] * 3} for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=1 + 37 * i, ignore_eos=True) for i in range(8)]
    kw = {"device": "cuda", "dtype": dtype, "kv_cache_memory_bytes": 64 << 20, "max_model_len": 512}
    base = make_llm(tiny_models["llama"], **kw)
    spec = make_llm(tiny_models["llama"], speculative=SPEC, **kw)
    assert spec.engine.runner.cuda_graphs is not None and not spec.engine.async_scheduling
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == want
    stats = spec.engine.spec.stats
    assert stats.num_drafts > 0
    # sampled rows: seeded replay on the device
    sp = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=64, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in spec.generate(prompts[:4], sp)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts[:4], sp)] == first
