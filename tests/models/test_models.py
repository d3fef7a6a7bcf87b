"""Our Llama / Qwen2 / Qwen3 against transformers on tiny random checkpoints (fp32)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from pdserve.models.config import IntermediateTensors
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.loader import load_model
from tests.models.helpers import allocate_kv_cache, build_metadata

ARCHS = ["llama", "qwen2", "qwen3"]
BLOCK_SIZE = 4
PROMPT_LEN = 41


def _prompt(vocab_size: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (PROMPT_LEN,), generator=gen)  # [PROMPT_LEN]


def _block_table(num_tokens: int, num_blocks: int, seed: int = 0) -> list[int]:
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    return blocks[: -(-num_tokens // BLOCK_SIZE)]


class _Stage:
    """A model stage plus its own KV cache, fed one request chunk by chunk."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, dtype: torch.dtype = torch.float32) -> None:
        cfg = model.cfg
        self.model = model
        num_layers = model.layer_end - model.layer_start
        self.cache = allocate_kv_cache(
            num_blocks, num_layers, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim, dtype
        )
        self.views = [self.cache[:, i] for i in range(num_layers)]


def _run_chunks(
    stages: list[_Stage], tokens: torch.Tensor, chunk_lens: list[int], table: list[int]
) -> torch.Tensor:
    """Feed one request through the pipeline in chunks; returns logits [num_tokens, vocab]."""
    logits, done = [], 0
    for chunk in chunk_lens:
        meta = build_metadata([chunk], [done + chunk], [table], BLOCK_SIZE)
        positions = torch.arange(done, done + chunk)
        out: torch.Tensor | IntermediateTensors | None = None
        for stage in stages:
            intermediate = out if isinstance(out, IntermediateTensors) else None
            out = stage.model(tokens[done : done + chunk], positions, stage.views, meta, intermediate)
        assert isinstance(out, torch.Tensor)
        logits.append(stages[-1].model.compute_logits(out))
        done += chunk
    return torch.cat(logits)


@pytest.fixture(scope="module")
def hf_logits(tiny_models: Mapping[str, Path]) -> dict[str, torch.Tensor]:
    """transformers' prompt logits per arch (computed once)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for arch in ARCHS:
        ref = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()
        with torch.no_grad():
            out[arch] = ref(_prompt(ref.config.vocab_size)[None]).logits[0].float()
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_match_transformers(
    arch: str, tiny_models: Mapping[str, Path], hf_logits: dict[str, torch.Tensor]
) -> None:
    model, cfg = load_model(tiny_models[arch], torch.float32, "cpu")
    tokens = _prompt(cfg.vocab_size)
    num_blocks = 16
    table = _block_table(PROMPT_LEN, num_blocks)
    ref = hf_logits[arch]

    with torch.no_grad():
        single = _run_chunks([_Stage(model, num_blocks)], tokens, [PROMPT_LEN], table)
        chunked = _run_chunks([_Stage(model, num_blocks)], tokens, [7, 21, 13], table)

    assert single.shape == (PROMPT_LEN, cfg.vocab_size) and single.dtype == torch.float32
    rel_err = (single - ref).norm() / ref.norm()
    assert rel_err <= 1e-4, f"{arch}: relative error {rel_err:.2e} vs transformers"
    torch.testing.assert_close(chunked, single, rtol=1e-5, atol=1e-5)
    # The random model must not be near-flat: greedy comparisons need clear top-1 tokens.
    top2 = ref.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_pipeline_stages_match_full_model(arch: str, tiny_models: Mapping[str, Path]) -> None:
    full, cfg = load_model(tiny_models[arch], torch.float32, "cpu")
    first, _ = load_model(tiny_models[arch], torch.float32, "cpu", layer_start=0, layer_end=1)
    last, _ = load_model(tiny_models[arch], torch.float32, "cpu", layer_start=1, layer_end=2)
    assert first.is_first_stage and not first.is_last_stage and first.lm_head is None
    assert last.is_last_stage and not last.is_first_stage and last.model.embed_tokens is None
    assert first.layer_names == ["model.layers.0.self_attn"]
    assert last.layer_names == ["model.layers.1.self_attn"]

    tokens = _prompt(cfg.vocab_size, seed=1)
    table = _block_table(PROMPT_LEN, 12, seed=1)
    with torch.no_grad():
        expected = _run_chunks([_Stage(full, 12)], tokens, [30, 11], table)
        staged = _run_chunks([_Stage(first, 12), _Stage(last, 12)], tokens, [30, 11], table)
    torch.testing.assert_close(staged, expected, rtol=1e-6, atol=1e-6)


def test_mixed_batch_matches_separate_requests(tiny_models: Mapping[str, Path]) -> None:
    """One step holding a prefill chunk of request A and a decode token of request B."""
    model, cfg = load_model(tiny_models["qwen3"], torch.float32, "cpu")
    tok_a, tok_b = _prompt(cfg.vocab_size, seed=2)[:9], _prompt(cfg.vocab_size, seed=3)[:6]
    table_a, table_b = [5, 1, 7], [2, 6]
    stage = _Stage(model, 8)
    with torch.no_grad():
        alone_a = _run_chunks([_Stage(model, 8)], tok_a, [9], table_a)
        alone_b = _run_chunks([_Stage(model, 8)], tok_b, [5, 1], table_b)
        _run_chunks([stage], tok_b, [5], table_b)  # B's prompt is already cached
        meta = build_metadata([9, 1], [9, 6], [table_a, table_b], BLOCK_SIZE)
        ids = torch.cat([tok_a, tok_b[5:]])
        positions = torch.cat([torch.arange(9), torch.tensor([5])])
        hidden = model(ids, positions, stage.views, meta)
        batched = model.compute_logits(hidden)
    torch.testing.assert_close(batched[:9], alone_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched[9:], alone_b[5:], rtol=1e-5, atol=1e-5)


def test_inputs_embeds_replace_input_ids(tiny_models: Mapping[str, Path]) -> None:
    model, cfg = load_model(tiny_models["llama"], torch.float32, "cpu")
    tokens = _prompt(cfg.vocab_size)[:10]
    meta = build_metadata([10], [10], [[0, 1, 2]], BLOCK_SIZE)
    with torch.no_grad():
        by_ids = model(tokens, torch.arange(10), _Stage(model, 3).views, meta)
        embeds = model.model.embed_tokens(tokens)  # [10, hidden]
        by_embeds = model(None, torch.arange(10), _Stage(model, 3).views, meta, inputs_embeds=embeds)
    torch.testing.assert_close(by_embeds, by_ids)


def test_greedy_decode_matches_transformers_generate(tiny_models: Mapping[str, Path]) -> None:
    """Prefill then 8 one-token decode steps (the pure-decode attention path)."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_models["qwen2"]
    model, cfg = load_model(model_dir, torch.float32, "cpu")
    prompt = _prompt(cfg.vocab_size, seed=4)[:12]
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref.generate(
            prompt[None],
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            attention_mask=torch.ones(1, 12),
        )[0, 12:]
    stage = _Stage(model, 8)
    table = [6, 2, 7, 0, 3]
    tokens = prompt.clone()
    with torch.no_grad():
        logits = _run_chunks([stage], tokens, [12], table)
        for _ in range(8):
            tokens = torch.cat([tokens, logits[-1:].argmax(-1)])
            n = len(tokens)
            meta = build_metadata([1], [n], [table], BLOCK_SIZE)
            logits = model.compute_logits(model(tokens[-1:], torch.tensor([n - 1]), stage.views, meta))
    assert tokens[12:].tolist() == expected.tolist()


def test_bfloat16_close_to_float32(tiny_models: Mapping[str, Path]) -> None:
    model32, cfg = load_model(tiny_models["qwen3"], torch.float32, "cpu")
    model16, _ = load_model(tiny_models["qwen3"], torch.bfloat16, "cpu")
    assert model16.model.layers["0"].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    tokens = _prompt(cfg.vocab_size)[:16]
    meta = build_metadata([16], [16], [[1, 3, 0, 2]], BLOCK_SIZE)
    with torch.no_grad():
        ref = model32.compute_logits(model32(tokens, torch.arange(16), _Stage(model32, 4).views, meta))
        stage16 = _Stage(model16, 4, torch.bfloat16)
        out = model16.compute_logits(model16(tokens, torch.arange(16), stage16.views, meta))
    assert out.dtype == torch.float32
    assert (out - ref).norm() / ref.norm() < 0.05
