"""Prefill context parallelism on CPU (gloo): ``pcp: N`` must generate what ``pcp: 1`` generates.

Each pcp N engine is this process (rank 0) plus N-1 spawned worker ranks; long prompt chunks are
split zig-zag over the ranks and their K/V all-gathered per layer (pdserve/pcp). A 512-token step
budget chunks the long prompts, so steps mix split chunks, replicated short prompts and decodes;
a second call hits the first call's prefix and splits a chunk after cached context.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.pcp.runner import PCPModelRunner, PCPWorkerError

FULL = bool(os.environ.get("PDSERVE_FULL_TESTS"))
COMMON: dict[str, Any] = dict(device="cpu", dtype="float32", max_num_batched_tokens=512, max_model_len=2048)
NEW_TOKENS = 8


def _prompts(lengths: list[int], seed: int, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _params(n: int) -> list[SamplingParams]:
    """Greedy rows, one seeded row (every rank samples the same gathered rows) and one scoring
    its prompt (prompt logprobs: every row of a split chunk is gathered)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=NEW_TOKENS, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=1)
    return [seeded if i == 1 else scored if i == 2 else greedy for i in range(n)]


def _generate(
    model: Path, pcp: int, batches: list[list[list[int]]], **kw: Any
) -> tuple[list[list[int]], list[float], int]:
    """Tokens of every prompt (batch after batch, each run to completion), the prompt logprobs
    of the scored prompts' tokens, and the prompt tokens rank 0 computed of split chunks (0 at
    pcp 1); every block is free again afterwards."""
    tokens: list[list[int]] = []
    scores: list[float] = []
    with LLM(str(model), pcp=pcp, **(COMMON | kw)) as llm:
        for prompts in batches:
            outs = llm.generate(prompts, _params(len(prompts)))
            tokens += [o.outputs[0].token_ids for o in outs]
            for o in outs:
                positions = o.prompt_logprobs or []
                scores += [
                    pos[tok].logprob for tok, pos in zip(o.prompt_token_ids, positions, strict=False) if pos
                ]
        llm.engine.kv.process_deferred_frees()
        assert llm.engine.kv.pool.num_used_blocks == 0
        runner = llm.engine.runner
        split = 0
        if pcp > 1:
            assert isinstance(runner, PCPModelRunner) and runner.pcp is not None
            split = runner.pcp.num_split_tokens
    assert all(len(t) == NEW_TOKENS for t in tokens)
    return tokens, scores, split


def _check(model: Path, pcp: int, lengths: list[int], seed: int, **kw: Any) -> None:
    first = _prompts(lengths, seed)
    # shares 640 tokens (40 blocks) with the longest prompt: a prefix hit, then a split chunk
    longest = max(first, key=len)
    second = [longest[:640] + _prompts([300], seed + 1)[0]]
    batches = [first, second]
    want, want_scores, _ = _generate(model, 1, batches, **kw)
    got, scores, split = _generate(model, pcp, batches, **kw)
    assert got == want
    assert len(scores) == len(want_scores) == (lengths[2] - 1 if len(lengths) > 2 else 0)
    assert scores == pytest.approx(want_scores, abs=1e-4)
    computed = sum(lengths) + 300  # prompt tokens computed (the second prompt's 640 are a hit)
    # rank 0 computed about 1/pcp of the split tokens (prompts shorter than pcp blocks replicate)
    assert 0.7 * computed / pcp < split < 1.3 * computed / pcp, (split, computed)


def test_pcp2_equals_pcp1(tiny_models: Any) -> None:
    # step 1: the 20-token prompt (replicated) and 492 tokens of the 700 (split); step 2: a decode,
    # the 700's last 208 and the 301 (both split); then decodes, then the prefix hit
    _check(tiny_models["llama"], 2, [20, 700, 301], seed=3)


FULL_CASES = [
    ("llama", 2, [300, 1200, 2000 - NEW_TOKENS, 45]),
    ("llama", 4, [300, 900, 1500, 2000 - NEW_TOKENS]),
    ("qwen3", 4, [320, 1000, 63]),
    ("qwen2", 3, [1700, 500]),
]


@pytest.mark.skipif(not FULL, reason="~40 s on 2 cores: PDSERVE_FULL_TESTS=1 (pcp 2 runs by default)")
@pytest.mark.parametrize(("arch", "pcp", "lengths"), FULL_CASES, ids=lambda v: str(v))
def test_pcp_matrix_equals_pcp1(tiny_models: Any, arch: str, pcp: int, lengths: list[int]) -> None:
    _check(tiny_models[arch], pcp, lengths, seed=11)


@pytest.mark.skipif(not FULL, reason="~20 s on 2 cores: PDSERVE_FULL_TESTS=1")
def test_pcp_whole_prompt_in_one_step(tiny_models: Any) -> None:
    """A 2,000-token budget: each prompt is one split chunk (no chunked prefill)."""
    _check(tiny_models["llama"], 4, [1900, 700], seed=7, max_num_batched_tokens=2048)


@pytest.mark.skipif(not FULL, reason="~20 s on 2 cores: PDSERVE_FULL_TESTS=1")
def test_pcp_with_ngram_speculation_equals_pcp1(tiny_models: Any) -> None:
    """n-gram drafts (from rank 0's token histories) verified on the replicated decode rows of
    a pcp 2 engine after split prefills: greedy tokens equal pcp 1 without speculation."""
    base = _prompts([40], 5)[0]
    prompts = [base * 15, (base[:25] * 30)[:700], base * 8]  # repetitive: the lookup finds drafts
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(str(tiny_models["llama"]), **COMMON) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    with LLM(str(tiny_models["llama"]), pcp=2, speculative=spec, **COMMON) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.spec is not None and llm.engine.spec.stats.num_drafts > 0
        runner = llm.engine.runner
        assert isinstance(runner, PCPModelRunner) and runner.pcp is not None and runner.pcp.num_split_steps
    assert got == want


@pytest.mark.skipif(not FULL, reason="~10 s on 2 cores: PDSERVE_FULL_TESTS=1")
def test_lost_rank_is_reported_by_rank(tiny_models: Any) -> None:
    llm = LLM(str(tiny_models["llama"]), pcp=2, **COMMON)
    runner = llm.engine.runner
    assert isinstance(runner, PCPModelRunner)
    (proc,) = runner.workers._procs
    proc.kill()
    proc.join(10)
    with pytest.raises(PCPWorkerError, match="PCP rank 1"):
        llm.generate(_prompts([400], 1), _params(1)[0])
    llm.close()
    assert not proc.is_alive()
