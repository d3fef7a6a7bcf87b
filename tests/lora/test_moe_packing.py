"""Expert LoRA packed into the fused MoE layout reads the stored scale: an rsLoRA adapter (whose
alpha / r and alpha / sqrt(r) differ) gives the rsLoRA result on the dense path and on the packed
expert path of the fused MoE forward, against a reference that computes alpha / sqrt(r) itself."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pdserve.lora.apply import LoRAStep
from pdserve.lora.moe import EXPERT_NAMES, ExpertLoRASlots
from pdserve.lora.peft import load_peft_adapter
from pdserve.models.fused_moe import fused_moe, select_experts

E, H, INTER, R, ALPHA, TOP_K = 4, 8, 6, 4, 8.0, 2
PREFIX = "model.layers.0.mlp.experts"
CPU = torch.device("cpu")


def _rslora_folder(tmp_path, gated: bool):
    parts = {"gate_proj": (H, INTER), "up_proj": (H, INTER), "down_proj": (INTER, H)}
    if not gated:
        del parts["gate_proj"]
    tensors = {}
    for x in range(E):
        for name, (i, o) in parts.items():
            tensors[f"base_model.model.{PREFIX}.{x}.{name}.lora_A.weight"] = torch.randn(R, i)
            tensors[f"base_model.model.{PREFIX}.{x}.{name}.lora_B.weight"] = torch.randn(o, R)
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    cfg = {"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "use_rslora": True, "bias": "none"}
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    targets = {f"{PREFIX}.{x}.{n}": s for x in range(E) for n, s in parts.items()}
    return load_peft_adapter("rs", tmp_path, targets, max_lora_rank=8), tensors


def _reference(x, logits, w13, w2, tensors, scale, gated):
    """Per token, per chosen expert, with the LoRA weights and ``scale`` applied explicitly."""
    out = torch.zeros_like(x)
    probs = torch.softmax(logits, -1)
    for t in range(x.shape[0]):
        w, idx = torch.topk(probs[t], TOP_K)
        w = w / w.sum()
        for wk, e in zip(w.tolist(), idx.tolist(), strict=True):

            def lin(v, base, name, e=e):
                key = f"base_model.model.{PREFIX}.{e}.{name}"
                a, b = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]
                return v @ base.T + scale * (v @ a.T) @ b.T

            if gated:
                g = lin(x[t], w13[e, :INTER], "gate_proj")
                u = lin(x[t], w13[e, INTER:], "up_proj")
                h = F.silu(g) * u
            else:
                h = F.gelu(lin(x[t], w13[e], "up_proj"))
            out[t] += wk * lin(h, w2[e], "down_proj")
    return out


@pytest.mark.parametrize("gated", [True, False])
def test_packed_experts_use_the_stored_rslora_scale(tmp_path, gated):
    torch.manual_seed(0)
    adapter, tensors = _rslora_folder(tmp_path, gated)
    rs, plain = ALPHA / math.sqrt(R), ALPHA / R
    assert rs != plain
    # the dense path: each module's stored scale is rsLoRA's
    assert [m.scale for m in adapter.modules.values()] == pytest.approx([rs] * len(adapter.modules))
    x = torch.randn(5, H)
    logits = torch.randn(5, E)
    w13 = torch.randn(E, (2 if gated else 1) * INTER, H) * 0.3
    w2 = torch.randn(E, H, INTER) * 0.3
    slots = ExpertLoRASlots(
        [(PREFIX, EXPERT_NAMES["qwen3_moe"])], E, H, INTER, 2, 8, torch.float32, CPU, gated
    )
    slots.set_slot(1, adapter.modules)
    slots.step = LoRAStep.build([(1, 4), (-1, 1)], 2, "segmented", torch.float32, CPU)  # last row: base
    topk_weights, topk_ids = select_experts(logits, TOP_K, renormalize=True)
    got = fused_moe(x, topk_weights, topk_ids, w13, w2, slots, gated=gated)
    want = _reference(x, logits, w13, w2, tensors, rs, gated)
    want[4] = _reference(x[4:], logits[4:], w13, w2, tensors, 0.0, gated)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    wrong = _reference(x, logits, w13, w2, tensors, plain, gated)
    assert (got[:4] - wrong[:4]).abs().max() > 1e-2  # alpha / r would be visibly different


def test_expert_lora_skipped_when_no_row_adapts_the_experts(tmp_path):
    torch.manual_seed(0)
    adapter, _ = _rslora_folder(tmp_path, gated=True)
    slots = ExpertLoRASlots([(PREFIX, EXPERT_NAMES["qwen3_moe"])], E, H, INTER, 2, 8, torch.float32, CPU)
    slots.set_slot(0, adapter.modules)
    slots.set_slot(1, {})  # an adapter of attention layers only
    topk_ids = torch.tensor([[0, 1], [2, 3], [1, 0]])
    slots.step = LoRAStep.build([(1, 2), (-1, 1)], 2, "segmented", torch.float32, CPU)
    assert slots.assignment_ids(topk_ids) is None  # no LoRA GEMMs in this layer
    slots.step = LoRAStep.build([(1, 1), (0, 1), (-1, 1)], 2, "segmented", torch.float32, CPU)
    ids = slots.assignment_ids(topk_ids)
    assert ids is not None and ids.tolist() == [1 * E + 0, 1 * E + 1, 2, 3, -1, -1]
    slots.clear_slot(0)
    assert slots.assignment_ids(topk_ids) is None
