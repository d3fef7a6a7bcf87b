"""Speculative decoding with weights after a PCP prefill (CPU, gloo): greedy tokens of ``pcp: N``
with a draft model or an MTP module equal ``pcp: 1`` without speculation.

draft_model: every rank holds the draft model; a request's first catch-up (its whole prompt and
first token) is split over the ranks as the target's prefill was, the draft model's K/V
all-gathered, so rank 0 computes about 1/N of those rows and its draft KV of the prompt must
equal pcp 1's KV of the same checkpoint (the target drafts for itself here, so the draft model's
KV is the target's). Later draft forwards run on rank 0 and the drafts reach the other ranks
inside the step that verifies them; nearly every draft must be accepted. mtp: every rank
computes the module for the rows of a split prompt chunk whose hidden states it holds, the
module's K/V all-gathered as the target's, so rank 0's MTP KV (what a P/D transfer moves, what
rank 0 drafts from) must equal the pcp 1 engine's, and so must the module's output at the
prompt's last position. A 512-token step budget chunks the 700-token prompt into two split
chunks (the second attends to the first's KV on every rank) beside a replicated short prompt.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.pcp.runner import PCPModelRunner
from pdserve.spec_decode.draft_model import DraftModelDrafter

FULL = bool(os.environ.get("PDSERVE_FULL_TESTS"))
COMMON: dict[str, Any] = dict(device="cpu", dtype="float32", max_num_batched_tokens=512, max_model_len=2048)
MTP = {"method": "mtp", "num_speculative_tokens": 3}


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _prompt_kv(cache: torch.Tensor, block_ids: list[int], n: int) -> torch.Tensor:
    """Positions [0, n) of a request's KV in ``cache`` ([blocks, L, 2, block_size, Hkv, D]),
    as [L, 2, n, Hkv, D]."""
    kv = cache[block_ids]  # [blocks, L, 2, block_size, Hkv, D]
    return kv.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, :n].clone()


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy tokens of every prompt through the engine's steps, and per request: with MTP, at
    the step that sampled its first token, (the module's output g at the last prompt position,
    the MTP KV of the prompt's positions [2, P, Hkv, D]); otherwise, at the step that emitted
    its second token (a draft model's first catch-up ran in it), the KV of positions [0, P]
    ([L, 2, P + 1, Hkv, D]): the draft model's when there is one, else the target's."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        eng.add_request(p, params, f"r{i}")
        tokens[f"r{i}"] = []
    drafter = eng.runner.drafter
    mtp = drafter is not None and hasattr(drafter, "states")
    first: dict[str, Any] = {}
    while eng.has_unfinished():
        for d in eng.step():
            rid = d.request_id
            n = len(prompts[int(rid[1:])])
            ids = eng.kv.block_ids(rid)
            if not tokens[rid] and mtp:
                assert drafter is not None
                kv = drafter.kv_cache[ids][:, 0]  # [blocks, 2, block_size, Hkv, D]
                kv = kv.transpose(0, 1).flatten(1, 2)[:, :n].clone()
                first[rid] = (drafter.states[rid].hidden.clone(), kv)
            elif tokens[rid] and not mtp and rid not in first:
                cache = eng.runner.kv_cache if drafter is None else drafter.kv_cache
                first[rid] = _prompt_kv(cache, list(ids), n + 1)
            tokens[rid] += d.token_ids
    eng.kv.process_deferred_frees()
    assert eng.kv.pool.num_used_blocks == 0
    return [tokens[f"r{i}"] for i in range(len(prompts))], first


@pytest.fixture(scope="module")
def mtp_model(tiny_model_factory: Any) -> Path:
    return tiny_model_factory("llama", mtp=True)


def _baseline(
    model: Path, prompts: list[list[int]], max_tokens: int, **kw: Any
) -> tuple[list[list[int]], Any]:
    with LLM(str(model), **(COMMON | kw)) as llm:
        return _run(llm, prompts, max_tokens)


def _check_draft_model(model: Path, pcp: int, lengths: list[int], max_tokens: int, **kw: Any) -> None:
    prompts = _prompts(lengths, seed=pcp)
    want, want_kv = _baseline(model, prompts, max_tokens, **kw)
    spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    with LLM(str(model), pcp=pcp, speculative=spec, **(COMMON | kw)) as llm:
        got, kv = _run(llm, prompts, max_tokens)
        runner, st = llm.engine.runner, llm.engine.spec.stats
        assert isinstance(runner, PCPModelRunner) and runner.pcp.num_split_steps > 0
        drafter = runner.drafter
        assert isinstance(drafter, DraftModelDrafter) and drafter.num_forwards > 0
        block_size = runner.block_size
    assert got == want
    # the target drafting for itself: its drafts are its own greedy tokens (fp32 rounding aside)
    assert st.num_draft_tokens >= 3 * len(prompts) and st.num_accepted_tokens >= 0.9 * st.num_draft_tokens, st
    # first catch-ups (prompt + first token) long enough to split: rank 0 computed ~1/pcp of them
    split = [n + 1 for n in lengths if n + 1 >= pcp * block_size]
    assert split and drafter.num_split_forwards >= 1
    assert abs(drafter.num_split_tokens - sum(split) / pcp) <= len(split), (drafter.num_split_tokens, split)
    assert sorted(kv) == sorted(want_kv)
    for rid, ref in want_kv.items():
        torch.testing.assert_close(kv[rid], ref, atol=1e-4, rtol=1e-4, msg=f"{rid}: draft KV of the prompt")


def _check_mtp(model: Path, pcp: int, lengths: list[int], max_tokens: int, **kw: Any) -> None:
    prompts = _prompts(lengths, seed=pcp + 1)
    want, _ = _baseline(model, prompts, max_tokens, **kw)
    with LLM(str(model), speculative=MTP, **(COMMON | kw)) as llm:
        ref_tokens, ref = _run(llm, prompts, max_tokens)
    with LLM(str(model), pcp=pcp, speculative=MTP, **(COMMON | kw)) as llm:
        got, first = _run(llm, prompts, max_tokens)
        runner, st = llm.engine.runner, llm.engine.spec.stats
        assert isinstance(runner, PCPModelRunner) and runner.pcp.num_split_steps > 0
        assert st.num_drafts > 0
    assert got == want == ref_tokens
    assert sorted(first) == sorted(ref)
    for rid, (g, kv) in first.items():
        torch.testing.assert_close(kv, ref[rid][1], atol=1e-4, rtol=1e-4, msg=f"{rid}: MTP KV")
        torch.testing.assert_close(g, ref[rid][0], atol=1e-4, rtol=1e-4, msg=f"{rid}: MTP output")


def test_pcp2_draft_model_equals_pcp1(mtp_model: Path) -> None:
    # the MTP checkpoint serves as a plain target here (its MTP layer is not loaded)
    _check_draft_model(mtp_model, 2, [700, 20], max_tokens=10)


def test_pcp2_mtp_equals_pcp1(mtp_model: Path) -> None:
    _check_mtp(mtp_model, 2, [700, 20], max_tokens=10)


FULL_CASES = [(4, [300, 1300, 2000 - 16, 45]), (2, [1999 - 16, 333])]


@pytest.mark.skipif(not FULL, reason="~15 s on 2 cores: PDSERVE_FULL_TESTS=1 (pcp 2 runs by default)")
@pytest.mark.parametrize(("pcp", "lengths"), FULL_CASES, ids=str)
def test_pcp_draft_model_matrix(mtp_model: Path, pcp: int, lengths: list[int]) -> None:
    _check_draft_model(mtp_model, pcp, lengths, max_tokens=16)


@pytest.mark.skipif(not FULL, reason="~15 s on 2 cores: PDSERVE_FULL_TESTS=1 (pcp 2 runs by default)")
@pytest.mark.parametrize(("pcp", "lengths"), FULL_CASES, ids=str)
def test_pcp_mtp_matrix(mtp_model: Path, pcp: int, lengths: list[int]) -> None:
    _check_mtp(mtp_model, pcp, lengths, max_tokens=16)


def _staggered(llm: LLM, long: list[int], short: list[int]) -> tuple[list[int], list[int]]:
    """Greedy tokens of ``long`` (60 new) and of ``short`` (40 new), the short one added once the
    long one emitted 5 tokens: while both run, ``disable_by_batch_size: 2`` keeps drafts off."""
    eng = llm.engine
    eng.add_request(long, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), "long")
    tokens: dict[str, list[int]] = {"long": [], "short": []}
    added = False
    while eng.has_unfinished():
        for d in eng.step():
            tokens[d.request_id] += d.token_ids
        if not added and len(tokens["long"]) >= 5:
            eng.add_request(short, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), "short")
            added = True
    return tokens["long"], tokens["short"]


@pytest.mark.skipif(not FULL, reason="~15 s on 2 cores: PDSERVE_FULL_TESTS=1")
def test_pcp2_late_catch_up_stays_on_rank_0(mtp_model: Path) -> None:
    """A catch-up from a later position (drafts were off for ~40 steps under
    ``disable_by_batch_size``) is long enough to split but reads draft KV that rank 0 alone
    wrote: it runs on rank 0, so only the first catch-up is split, and the drafts after it are
    still the target's own tokens."""
    long, short = _prompts([600, 20], seed=9)
    with LLM(str(mtp_model), **COMMON) as llm:
        want = _staggered(llm, long, short)
    spec = {"method": "draft_model", "model": str(mtp_model), "num_speculative_tokens": 3}
    with LLM(str(mtp_model), pcp=2, speculative=spec | {"disable_by_batch_size": 2}, **COMMON) as llm:
        got = _staggered(llm, long, short)
        drafter, st = llm.engine.runner.drafter, llm.engine.spec.stats
        assert isinstance(drafter, DraftModelDrafter)
        assert llm.engine.spec.num_steps_off >= 30  # the late catch-up spans 30+ tokens (> 2 blocks)
    assert got == want
    assert drafter.num_split_forwards == 1 and abs(drafter.num_split_tokens - 601 / 2) <= 1
    assert st.num_draft_tokens >= 12 and st.num_accepted_tokens >= 0.9 * st.num_draft_tokens, st
