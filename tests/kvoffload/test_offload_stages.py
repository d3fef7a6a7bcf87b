"""The offload tier on an engine of 2 processes (LLM, CPU): pipeline stages (each its layers) or
TP ranks (each its KV heads) copy their own share of a block into their columns of the shared
host pool; an evicted conversation comes back from the tier, computes only the remainder and
answers as transformers does."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from pdserve.kvoffload.spec import KVOffloadSpec
from pdserve.kvoffload.stages import block_bytes_of
from tests.kvoffload.test_offload_engine import BLOCK, _check_answer, _conversation, tier_settings

FULL = os.environ.get("PDSERVE_FULL_TESTS") == "1"
FULL_ONLY = pytest.mark.skipif(not FULL, reason="PDSERVE_FULL_TESTS=1")


PP2 = {"pipeline_parallel_size": 2}
TP2 = {"tensor_parallel_size": 2}


@pytest.mark.parametrize(
    ("parallel", "tier", "async_scheduling"),
    [
        (PP2, "cpu", False),
        pytest.param(PP2, "disk", False, marks=FULL_ONLY),
        pytest.param(PP2, "cpu", True, marks=FULL_ONLY),
        pytest.param(TP2, "cpu", False, marks=FULL_ONLY),
        pytest.param(TP2, "disk", True, marks=FULL_ONLY),
    ],
    ids=["pp-cpu", "pp-disk", "pp-cpu-async", "tp-cpu", "tp-disk-async"],
)
def test_stages_and_ranks_offload_their_own_share(
    parallel: dict[str, int], tier: str, async_scheduling: bool, tiny_models, make_llm, tmp_path
) -> None:
    model_dir = tiny_models["llama"]
    llm = make_llm(
        model_dir,
        device="cpu",  # two processes: one GPU each under NCCL, which a one-GPU host lacks
        **tier_settings(tier, tmp_path),
        **parallel,
        async_scheduling=async_scheduling,
    )
    eng = llm.engine
    assert eng.offload is not None and eng.offload.stages is not None
    mgr = eng.offload.manager
    stage0_bytes = block_bytes_of(eng.runner.offload_runner())
    assert mgr.host.block_bytes == 2 * stage0_bytes  # a slot holds both processes' shares
    prompt, got, prefilled = _conversation(llm, eng.arch.vocab_size, evict_tokens=2)
    assert mgr.hit_tokens[tier] == 13 * BLOCK, mgr.hit_tokens  # turn 1's 13 full blocks
    assert prefilled == len(prompt) - 13 * BLOCK
    _check_answer(model_dir, prompt, got)
    assert eng.offload.copier.pool.shape[1] == stage0_bytes  # stage 0 copies its columns only
    if tier == "cpu":  # process 1's columns of the rows hold its K/V, copied by process 1
        rows = list(mgr.host.entries.values())
        assert rows and all(any(mgr.host.view(s)[stage0_bytes:]) for s in rows)
    _stores_before_remote_writes(eng, stage0_bytes)


def _stores_before_remote_writes(eng: Any, stage0_bytes: int) -> None:
    """Stores in a step whose remote KV writes come next run in every process at once (their
    own copy of the step's spec then carries none)."""
    host = eng.offload.manager.host
    taken = host.take_slot()
    assert taken is not None
    slot = taken[0]
    host.view(slot)[:] = bytes(host.block_bytes)
    block_id = eng.kv.pool.num_blocks - 1  # written by the evicting prompts: not zeros on any stage
    spec = KVOffloadSpec(stores=[(block_id, slot)])
    eng.offload.execute(spec, before_remote_writes=True)
    assert spec.stores == []
    row = host.view(slot)
    assert any(row[stage0_bytes:]), "process 1 did not store its columns"
    kv0 = eng.runner.offload_runner().kv_cache
    assert bytes(row[:stage0_bytes]) == kv0[block_id].contiguous().view(torch.uint8).numpy().tobytes()
    host.release(slot)
