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


def test_gemma3_greedy_matches_transformers(tiny_model_factory, make_llm) -> None:
    model_dir = tiny_model_factory("gemma3", num_layers=4, max_position_embeddings=1024)
    arch = ModelArchConfig.from_model_dir(model_dir)
    assert arch.layer_types == ("sliding_attention", "full_attention") * 2 and arch.sliding_window == W
    rng = random.Random(3)
    shared = [rng.randrange(arch.vocab_size) for _ in range(40)]  # a prefix hit past the window
    prompts = [
        (shared + [rng.randrange(arch.vocab_size) for _ in range(n - 40)])
        if n > 60
        else [rng.randrange(arch.vocab_size) for _ in range(n)]
        for n in LENGTHS
    ]
    llm = make_llm(model_dir, block_size=16, max_num_batched_tokens=80)  # chunks of 80 tokens
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # The last prompt runs alone, after the others: it hits the shared prefix they cached.
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts[:-1], params)]
    ours += [o.outputs[0].token_ids for o in llm.generate(prompts[-1:], params)]
    assert compare_greedy(ours, _reference(model_dir, prompts)) <= 1
    assert llm.engine.kv.pool.num_hit_blocks > 0  # the shared prefix was hit


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
