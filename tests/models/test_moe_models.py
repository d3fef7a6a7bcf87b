"""Mixtral- and Qwen3-MoE-shaped models: greedy tokens equal transformers' (fp32, prompts of 3
to 80 tokens, chunked prefill beside decodes), both checkpoint layouts of the experts load into
the same fused parameters, and settings the forward does not implement are refused."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import ConfigError, UnsupportedError
from pdserve.models.config import ModelArchConfig
from pdserve.models.fused_moe_block import SparseMoeBlock
from pdserve.models.loader import load_model
from pdserve.models.make_model import TINY_MOE
from tests.engine.test_engine_parity import NEW_TOKENS, _reference, compare_greedy

LENGTHS = [3, 17, 41, 80]


@pytest.mark.parametrize(
    "arch",
    [
        pytest.param(
            "mixtral",
            marks=pytest.mark.skipif(
                not os.environ.get("PDSERVE_FULL_TESTS"),
                reason="PDSERVE_FULL_TESTS=1 (Mixtral's base-model prompts are compared with transformers "
                "in tests/lora/test_moe_lora.py)",
            ),
        ),
        "qwen3_moe",
    ],
)
def test_moe_greedy_matches_transformers(arch, tiny_model_factory, make_llm, capsys) -> None:
    model_dir = tiny_model_factory(arch)
    moe = ModelArchConfig.from_model_dir(model_dir).moe
    assert moe is not None and moe.num_experts == TINY_MOE["num_experts"]
    # Mixtral: every layer sparse, weights renormalised; the tiny Qwen3-MoE: last layer dense, not
    assert (moe.sparse_layers, moe.renormalize) == (
        ((True, True), True) if arch == "mixtral" else ((True, False), False)
    )
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
    llm = make_llm(model_dir, block_size=16, max_num_batched_tokens=48)  # chunks beside decodes
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    ties = compare_greedy(ours, _reference(model_dir, prompts))
    with capsys.disabled():
        print(f"\n{arch}: {len(prompts)} prompts x {NEW_TOKENS} tokens, {ties} near-tie stops")
    assert ties <= 1


def _to_fused(src_dir, dst_dir) -> int:
    """Rewrite a per-expert checkpoint with transformers 5's fused expert tensors; returns how
    many per-expert tensors were merged."""
    shutil.copytree(src_dir, dst_dir)
    (dst_file,) = dst_dir.glob("*.safetensors")
    tensors = load_file(dst_file)
    out, merged = {}, 0
    layers = sorted({k.split(".experts.")[0] for k in tensors if ".experts." in k})
    for layer in layers:
        e = TINY_MOE["num_experts"]
        part = {
            p: [tensors.pop(f"{layer}.experts.{x}.{p}.weight") for x in range(e)] for p in ("w1", "w3", "w2")
        }
        merged += 3 * e
        out[f"{layer.replace('block_sparse_moe', 'mlp')}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(part["w1"], part["w3"], strict=True)]
        )
        out[f"{layer.replace('block_sparse_moe', 'mlp')}.experts.down_proj"] = torch.stack(part["w2"])
    save_file({**tensors, **out}, dst_file)
    return merged


def test_fused_and_per_expert_checkpoints_load_the_same(tiny_model_factory, tmp_path) -> None:
    model_dir = tiny_model_factory("mixtral")
    names = set(load_file(next(model_dir.glob("*.safetensors"))))
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names  # what transformers saved
    assert _to_fused(model_dir, tmp_path / "fused") == 2 * 3 * TINY_MOE["num_experts"]
    a, _ = load_model(model_dir, torch.float32, "cpu")
    b, _ = load_model(tmp_path / "fused", torch.float32, "cpu")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    block = a.model.layers["0"].mlp
    assert isinstance(block, SparseMoeBlock)
    up = load_file(next(model_dir.glob("*.safetensors")))[
        "model.layers.0.block_sparse_moe.experts.3.w3.weight"
    ]
    torch.testing.assert_close(block.experts.gate_up_proj[3, up.shape[0] :], up)  # up after gate


def test_missing_expert_weight_is_refused(tiny_model_factory, tmp_path) -> None:
    model_dir = tiny_model_factory("qwen3_moe")
    dst = tmp_path / "broken"
    shutil.copytree(model_dir, dst)
    (f,) = dst.glob("*.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(tensors, f)
    with pytest.raises(ConfigError, match=r"experts\.gate_up_proj\[up5\]"):
        load_model(dst, torch.float32, "cpu")


@pytest.mark.parametrize(
    "change,error,words",
    [
        ({"sliding_window": 64}, UnsupportedError, "sliding_window=64"),
        ({"hidden_act": "gelu"}, UnsupportedError, "hidden_act 'gelu'"),
        ({"num_experts_per_tok": 9}, ConfigError, r"num_experts_per_tok=9 must be in \[1, 8\]"),
    ],
)
def test_unsupported_settings_refused(tiny_model_factory, tmp_path, change, error, words) -> None:
    model_dir = tiny_model_factory("mixtral")
    hf = json.loads((model_dir / "config.json").read_text())
    with pytest.raises(error, match=words):
        ModelArchConfig.from_hf({**hf, **change})
