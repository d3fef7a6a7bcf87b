"""The offload tier on a pipeline-parallel engine (LLM, CPU, 2 stage processes): each stage
copies its own layers' blocks into its columns of the shared host pool; an evicted conversation
comes back from the tier, computes only the remainder and answers as transformers does."""

from __future__ import annotations

import os

import pytest

from tests.kvoffload.test_offload_engine import BLOCK, _check_answer, _conversation, tier_settings

FULL = os.environ.get("PDSERVE_FULL_TESTS") == "1"


@pytest.mark.parametrize(
    "tier",
    ["cpu", pytest.param("disk", marks=pytest.mark.skipif(not FULL, reason="PDSERVE_FULL_TESTS=1"))],
)
def test_pp_stages_offload_their_own_layers(tier: str, tiny_models, make_llm, tmp_path) -> None:
    model_dir = tiny_models["llama"]
    llm = make_llm(model_dir, **tier_settings(tier, tmp_path), pipeline_parallel_size=2)
    eng = llm.engine
    assert eng.offload is not None and eng.offload.stages is not None
    mgr = eng.offload.manager
    stage0_bytes = eng.runner.stage0.bytes_per_block()
    assert mgr.host.block_bytes == 2 * stage0_bytes  # a slot holds both stages' layers
    prompt, got, prefilled = _conversation(llm, eng.arch.vocab_size)
    assert mgr.hit_tokens[tier] == 13 * BLOCK, mgr.hit_tokens  # turn 1's 13 full blocks
    assert prefilled == len(prompt) - 13 * BLOCK
    _check_answer(model_dir, prompt, got)
    assert eng.offload.copier.pool.shape[1] == stage0_bytes  # stage 0 copies its columns only
    if tier == "cpu":  # stage 1's columns of the rows hold its layer's K/V, copied by stage 1
        rows = list(mgr.host.entries.values())
        assert rows and all(any(mgr.host.view(s)[stage0_bytes:]) for s in rows)
