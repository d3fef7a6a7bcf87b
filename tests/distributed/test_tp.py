"""Tensor parallelism on CPU (gloo): TP 2 must generate what TP 1 generates.

Each TP 2 engine is this process (rank 0) plus one spawned worker rank; the same code runs on
GPUs with NCCL. fp32 tiny checkpoints (4 heads, 2 KV heads: divisible by 2).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from pdserve.config.engine import ParallelConfig
from pdserve.distributed.workers import TPWorkerError
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tensor_parallel import TPModelRunner
from pdserve.errors import ConfigError

# 8 prompts of mixed lengths (3..66 tokens); a 32-token step budget chunks the long ones.
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(3 + 9 * i)] for i in range(8)]
COMMON: dict[str, Any] = dict(
    device="cpu", dtype="float32", max_num_batched_tokens=32, enable_chunked_prefill=True, max_model_len=256
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
SEEDED = [
    SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=32, ignore_eos=True) for i in range(8)
]


def _run(model_dir: Path, tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """(greedy tokens, seeded tokens) of PROMPTS; every block is free again afterwards, and the
    worker ranks have exited once the LLM is closed."""
    with LLM(str(model_dir), tensor_parallel_size=tp, **COMMON) as llm:
        greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        seeded = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SEEDED)]
        llm.engine.kv.process_deferred_frees()
        assert llm.engine.kv.pool.num_used_blocks == 0
        runner = llm.engine.runner
    if tp > 1:
        assert isinstance(runner, TPModelRunner)
        assert not any(p.is_alive() for p in runner.workers._procs)
    return greedy, seeded


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_matches_tp1(tiny_models: Any, arch: str) -> None:
    greedy1, seeded1 = _run(tiny_models[arch], tp=1)
    greedy2, seeded2 = _run(tiny_models[arch], tp=2)
    assert all(len(t) == 32 for t in greedy1 + seeded1)
    assert greedy2 == greedy1
    assert seeded2 == seeded1
    assert seeded1 != greedy1  # the seeded run really sampled


@pytest.mark.skipif(
    not os.environ.get("PDSERVE_FULL_TESTS"),
    reason="~8 s on 2 cores: PDSERVE_FULL_TESTS=1 runs it (asynchronous scheduling is tested on one runner and on pipeline stages; TP 2 equals TP 1 synchronously here)",
)
def test_tp2_async_matches_tp1_sync(tiny_models: Any) -> None:
    """Asynchronous scheduling under TP 2: rank 0 launches step N+1 before reading step N and the
    worker rank repeats that order (grammar rows: step N's tokens advance the matchers before
    N+1's masks). Greedy, seeded and regex-constrained rows give the synchronous TP 1 tokens."""
    regex = [
        SamplingParams(temperature=0.9, seed=7 + i, max_tokens=12, structured=("regex", "[ab]{3,20}"))
        for i in range(2)
    ]
    params = [GREEDY, SEEDED[1], regex[0], GREEDY, SEEDED[4], regex[1]]
    prompts = PROMPTS[: len(params)]
    outs = {}
    for tp, mode in ((1, False), (2, True)):
        with LLM(str(tiny_models["llama"]), tensor_parallel_size=tp, async_scheduling=mode, **COMMON) as llm:
            assert llm.engine.async_scheduling is mode
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            llm.engine.kv.process_deferred_frees()
            assert llm.engine.kv.pool.num_used_blocks == 0
    assert outs[2] == outs[1]
    assert all(3 <= len(outs[1][i]) <= 12 for i in (2, 5))


def test_tp_size_must_divide_heads(tiny_models: Any) -> None:
    # 2 KV heads cannot be split over 4 ranks; refused before any worker starts.
    with pytest.raises(ConfigError, match=r"num_key_value_heads=2.*use a tensor_parallel_size.*\[1, 2\]"):
        LLM(str(tiny_models["llama"]), tensor_parallel_size=4, **COMMON)


def test_parallel_config_validation() -> None:
    assert ParallelConfig(tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)


def test_worker_exits_on_close_and_loss_is_reported(tiny_models: Any) -> None:
    llm = LLM(str(tiny_models["llama"]), tensor_parallel_size=2, **COMMON)
    runner = llm.engine.runner
    assert isinstance(runner, TPModelRunner)
    (proc,) = runner.workers._procs
    assert proc.is_alive()
    proc.kill()  # a lost rank surfaces as an error at the next call, not a hang
    proc.join(10)
    with pytest.raises(TPWorkerError, match="TP rank 1"):
        llm.generate(PROMPTS[:1], GREEDY)
    llm.close()
    llm.close()  # idempotent
    assert not proc.is_alive()
    # a closed TP 2 engine's workers exit after it served: _run (test_tp2_matches_tp1) asserts it
