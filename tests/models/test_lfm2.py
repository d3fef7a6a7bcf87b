"""LFM2-shaped model (short depthwise convolutions beside attention; the convolutions' state in a
KV group of its own): greedy tokens equal transformers' for prompts of 5 to 600 tokens, with
chunked prefill (chunks start mid-block) and a prefix hit that resumes the state group at a
block boundary; its group frees what the kernel no longer reads."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine.kv_cache_groups import SHORT_CONV
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import ConfigError
from pdserve.models.config import ModelArchConfig
from pdserve.models.make_model import TINY_CONV_KERNEL
from tests.engine.test_engine_parity import NEW_TOKENS, compare_greedy
from tests.models.test_gemma3 import prompts_sharing_a_prefix

# The default run straddles the kernel (5) and the block size (17) and hits a cached prefix
# (70, then 150); PDSERVE_FULL_TESTS=1 adds both sides of a block boundary and long prompts.
FULL = [15, 16, 33, 300, 600] if os.environ.get("PDSERVE_FULL_TESTS") else []
LENGTHS = [5, 17, 70, *FULL, 150]


def reference_full_forward(model_dir, prompts: list[list[int]]) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' greedy tokens and logits, one whole-sequence forward per token (no cache):
    on a CPU its LFM2 cache path costs ~5x these forwards (a hub-kernel fallback per call); one
    torch thread, since the engine under test is idle meanwhile and a loaded 2-core host makes
    two threads slower than one."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        with torch.no_grad():
            for p in prompts:
                seq, logits = list(p), []
                for _ in range(NEW_TOKENS):
                    lg = ref(torch.tensor([seq]), use_cache=False).logits[0, -1]
                    logits.append(lg)
                    seq.append(int(lg.argmax()))
                out.append((seq[len(p) :], logits))
    finally:
        torch.set_num_threads(threads)
    return out


def test_lfm2_greedy_matches_transformers(tiny_model_factory, make_llm) -> None:
    model_dir = tiny_model_factory("lfm2", num_layers=4, max_position_embeddings=1024)
    arch = ModelArchConfig.from_model_dir(model_dir)
    assert arch.layer_types == ("conv", "full_attention", "conv", "conv")
    assert arch.conv_kernel_size == TINY_CONV_KERNEL and arch.conv_bias
    prompts = prompts_sharing_a_prefix(arch.vocab_size, LENGTHS)  # hit: 32 tokens, 2 blocks
    llm = make_llm(model_dir, block_size=16, max_num_batched_tokens=80)  # chunks of 80 tokens
    kv = llm.engine.kv
    assert kv.groups is not None and kv.coordinator.managers[1].spec.kind == SHORT_CONV
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # The last prompt runs alone, after the others: it hits the shared prefix they cached.
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts[:-1], params)]
    hits_before = kv.pool.num_hit_blocks
    ours += [o.outputs[0].token_ids for o in llm.generate(prompts[-1:], params)]
    assert kv.pool.num_hit_blocks - hits_before == 2  # the shared prefix's two blocks
    assert compare_greedy(ours, reference_full_forward(model_dir, prompts)) <= 1
    kv.process_deferred_frees()
    assert kv.groups.num_used_blocks == (0,)


def test_lfm2_state_group_holds_two_blocks_at_most(tiny_model_factory, make_llm) -> None:
    """Kernel 3: position p reads p - 2 .. p, so at most two blocks of the state group are held
    (one when p - 2 is in p's block), where the attention group holds all of them."""
    model_dir = tiny_model_factory("lfm2", num_layers=4, max_position_embeddings=1024)
    eng = make_llm(model_dir, block_size=16).engine
    req = eng.add_request(list(range(1, 101)), SamplingParams(max_tokens=40, ignore_eos=True), "r")
    held = []
    while eng.has_unfinished():
        eng.step()
        if eng.kv.holds("r"):
            held.append(
                (req.num_computed_tokens, len(eng.kv.block_ids("r")), eng.kv.groups.num_held_blocks("r"))
            )
    # After computing position 129 (130 computed): the attention group holds blocks 0..8 (9),
    # the state group blocks 7 and 8 (positions 127..129).
    assert (130, 9, (2,)) in held
    assert max(g[0] for _, _, g in held[1:]) <= 2


def test_lfm2_refused_where_groups_share_one_table(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("lfm2", num_layers=4, max_position_embeddings=1024)
    from pdserve.config.engine import EngineConfig

    with pytest.raises(ConfigError, match="short-convolution state"):
        LLMEngine(EngineConfig(str(model_dir)), shared_kv_table_reason="a test", load_tokenizer_=False)
