"""Greedy tokens of the whole engine (paged KV, chunked prefill, prefix cache, continuous
batching) equal transformers' ``generate`` on tiny random checkpoints, fp32."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.sampling_params import SamplingParams

NEW_TOKENS = 64
TIE_EPS = 1e-5
LENGTHS = [1, 2, 7, 16, 33, 90, 170, 310]


def _reference(model_dir, prompts: list[list[int]]) -> list[tuple[list[int], list[torch.Tensor]]]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref.generation_config.eos_token_id = None  # ignore_eos, as the engine does below
    out = []
    with torch.no_grad():
        for p in prompts:
            g = ref.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(
                    1, len(p), dtype=torch.long
                ),  # else pad id 0 in the prompt is masked
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            out.append((g.sequences[0, len(p) :].tolist(), [lg[0] for lg in g.logits]))
    return out


def compare_greedy(ours: list[list[int]], ref: list[tuple[list[int], list[torch.Tensor]]]) -> int:
    """Token equality, except at a true near-tie of the reference (then stop for that prompt).

    Returns the number of near-tie stops (printed by the caller)."""
    ties = 0
    for i, (got, (want, logits)) in enumerate(zip(ours, ref, strict=True)):
        assert len(got) == NEW_TOKENS
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            if a == b:
                continue
            top2 = torch.topk(logits[step], 2).values
            gap = float(top2[0] - top2[1])
            assert gap < TIE_EPS, (
                f"prompt {i} step {step}: ours {a} vs transformers {b} (top-2 gap {gap:.2e})"
            )
            ties += 1
            break
    return ties


def _prompts(vocab: int, shared_prefix: int = 0, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared_prefix)]
    out = []
    for n in LENGTHS:
        if shared_prefix and n > shared_prefix:
            out.append(prefix + [rng.randrange(vocab) for _ in range(n - shared_prefix)])
        else:
            out.append([rng.randrange(vocab) for _ in range(n)])
    return out


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers_chunked_and_prefix(
    arch: str, async_scheduling: bool, tiny_models, make_llm, capsys
) -> None:
    model_dir = tiny_models[arch]
    # A token budget below the longest prompt forces chunked prefill beside decodes.
    llm = make_llm(model_dir, max_num_batched_tokens=96, block_size=16, async_scheduling=async_scheduling)
    vocab = llm.engine.arch.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    total_ties = 0
    for shared in (0, 64):
        prompts = _prompts(vocab, shared_prefix=shared, seed=len(arch) + shared)
        hits_before = llm.engine.kv.pool.num_hit_blocks
        outs = llm.generate(prompts, params)
        ours = [o.outputs[0].token_ids for o in outs]
        total_ties += compare_greedy(ours, _reference(model_dir, prompts))
        if shared:
            assert llm.engine.kv.pool.num_hit_blocks > hits_before, "shared prefixes gave no prefix-cache hit"
            assert sum(o.num_cached_tokens for o in outs) > 0
    with capsys.disabled():
        print(f"\n[{arch}, {'async' if async_scheduling else 'sync'}] near-tie stops: {total_ties}")
    assert total_ties <= 2, f"{total_ties} near-ties: the tiny model's logits are too flat to test with"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_keeps_greedy_output(async_scheduling: bool, tiny_models, make_llm) -> None:
    """A cache too small for every request at once forces preemption by recompute; output is unchanged."""
    model_dir = tiny_models["llama"]
    prompts = _prompts(512, seed=7)[3:7]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = make_llm(model_dir, max_num_batched_tokens=512).generate(prompts, params)
    tight_llm = make_llm(
        model_dir,
        max_num_batched_tokens=512,
        num_blocks_override=16,
        max_model_len=256,
        async_scheduling=async_scheduling,
    )
    tight = tight_llm.generate(prompts, params)
    assert tight_llm.engine.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
