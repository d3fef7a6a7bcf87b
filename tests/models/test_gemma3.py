"""Gemma-3-text-shaped model (sliding-window and full-attention layers interleaved): greedy
tokens equal transformers' for prompts shorter than, straddling and far past the window, with
chunked prefill and prefix hits (so windows start mid-chunk and mid-block)."""

from __future__ import annotations

import os
import random

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import UnsupportedError
from pdserve.models.config import ModelArchConfig
from pdserve.models.make_model import TINY_SLIDING_WINDOW
from tests.engine.test_engine_parity import NEW_TOKENS, _reference, compare_greedy

W = TINY_SLIDING_WINDOW
# 600 tokens cost transformers' reference ~30 s on 2 cores: with PDSERVE_FULL_TESTS=1 only.
LENGTHS = (
    [5, W - 1, W + 1] + ([W, 300, 600] if os.environ.get("PDSERVE_FULL_TESTS") else []) + [2 * W + 7, 150]
)


def prompts_sharing_a_prefix(vocab: int, lengths: list[int]) -> list[list[int]]:
    """Random prompts; those longer than 60 tokens begin with the same 40 (two 16-token blocks)."""
    rng = random.Random(3)
    shared = [rng.randrange(vocab) for _ in range(40)]
    return [
        (shared + [rng.randrange(vocab) for _ in range(n - 40)])
        if n > 60
        else [rng.randrange(vocab) for _ in range(n)]
        for n in lengths
    ]


def test_gemma3_greedy_matches_transformers(tiny_model_factory, make_llm) -> None:
    model_dir = tiny_model_factory("gemma3", num_layers=4, max_position_embeddings=1024)
    arch = ModelArchConfig.from_model_dir(model_dir)
    assert arch.layer_types == ("sliding_attention", "full_attention") * 2 and arch.sliding_window == W
    prompts = prompts_sharing_a_prefix(arch.vocab_size, LENGTHS)  # a prefix hit past the window
    llm = make_llm(model_dir, block_size=16, max_num_batched_tokens=80)  # chunks of 80 tokens
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # The last prompt runs alone, after the others: it hits the shared prefix they cached.
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts[:-1], params)]
    ours += [o.outputs[0].token_ids for o in llm.generate(prompts[-1:], params)]
    assert compare_greedy(ours, _reference(model_dir, prompts)) <= 1
    assert llm.engine.kv.pool.num_hit_blocks > 0  # the shared prefix was hit
    assert llm.engine.kv.groups is not None  # the sliding layers had a block table of their own


def test_gemma3_long_decode_holds_only_the_window_blocks(tiny_model_factory, make_llm) -> None:
    """Past the window a sliding layer's table holds 3 blocks where a full-attention table (what
    every layer kept with one shared table) holds 16, and the pools are empty afterwards."""
    model_dir = tiny_model_factory("gemma3", num_layers=4, max_position_embeddings=1024)
    eng = make_llm(model_dir, block_size=16).engine
    rng = random.Random(4)
    prompt = [rng.randrange(eng.arch.vocab_size) for _ in range(150)]
    req = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True), "long")
    while len(req.output_token_ids) < 92:  # the last step scheduled computed position 240
        eng.step()
    assert req.num_computed_tokens == 241
    # Position 240 sees keys 209..240 (W = 32): blocks 13..15 of 16 (block size 16).
    assert len(eng.kv.block_ids("long")) == 16
    assert eng.kv.groups.num_held_blocks("long") == (3,)
    assert eng.kv.groups.num_used_blocks == (3,)
    while eng.has_unfinished():
        eng.step()
    eng.kv.process_deferred_frees()
    assert eng.kv.groups.num_used_blocks == (0,)


def test_other_models_refuse_sliding_windows() -> None:
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "max_position_embeddings": 8,
        "layer_types": ["sliding_attention"],
    }
    with pytest.raises(UnsupportedError, match="Gemma-3"):
        ModelArchConfig.from_hf(hf)
