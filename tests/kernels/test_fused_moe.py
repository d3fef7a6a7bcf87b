"""The fused MoE: the grouped torch GEMM against a per-row loop, the Triton kernel (interpreter
on CPU) against the torch twin, with expert LoRA of two adapters and base rows in one step."""

from __future__ import annotations

import torch

from pdserve import kernels
from pdserve.lora.apply import LoRAStep
from pdserve.lora.moe import ExpertLoRASlots
from pdserve.lora.peft import LoRAModuleWeights
from pdserve.models.fused_moe import fused_moe, moe_gemm_torch, select_experts

E, H, INTER, TOP_K = 4, 24, 20, 2
PREFIX = "model.layers.0.mlp.experts"


def test_moe_gemm_torch_equals_per_row_loop():
    torch.manual_seed(0)
    x, w = torch.randn(5, 8), torch.randn(3, 6, 8)
    ids = torch.tensor([2, -1, 0, 2, 1, 0, -1])
    src = torch.tensor([0, 1, 4, 3, 3, 2, 0])
    got = moe_gemm_torch(x, w, ids, src)
    for i, (e, r) in enumerate(zip(ids.tolist(), src.tolist(), strict=True)):
        want = torch.zeros(6) if e < 0 else x[r] @ w[e].T
        torch.testing.assert_close(got[i], want)


def _slots(device: torch.device) -> ExpertLoRASlots:
    """Slot 0: a fused gate_up LoRA (PEFT target_parameters) on every expert, rank 3, and down on
    expert 1; slot 1: per-expert gate / up / down modules of the transformers 4 layout, rank 2."""
    slots = ExpertLoRASlots(
        [(PREFIX, ("gate_proj", "up_proj", "down_proj"))], E, H, INTER, 2, 4, torch.float32, device
    )

    def w(r: int, i: int, o: int, scale: float) -> LoRAModuleWeights:
        return LoRAModuleWeights(torch.randn(r, i) * 0.3, torch.randn(o, r) * 0.3, r, scale)

    fused = {f"{PREFIX}.{e}.gate_up_proj": w(3, H, 2 * INTER, 1.5) for e in range(E)}
    fused[f"{PREFIX}.1.down_proj"] = w(3, INTER, H, 0.7)
    per_expert = {
        f"{PREFIX}.{e}.{p}": w(2, H, INTER, 2.0) for e in range(E) for p in ("gate_proj", "up_proj")
    }
    per_expert |= {f"{PREFIX}.{e}.down_proj": w(2, INTER, H, 0.5) for e in range(E)}
    slots.set_slot(0, fused)
    slots.set_slot(1, per_expert)
    slots.step = LoRAStep.build([(0, 3), (-1, 2), (1, 3), (0, 1)], 2, "segmented", torch.float32, device)
    return slots


def test_triton_fused_moe_equals_torch(force_triton, device):
    torch.manual_seed(0)
    dev = torch.device(device)
    x = torch.randn(9, H, device=dev)
    w13 = torch.randn(E, 2 * INTER, H, device=dev) * 0.3
    w2 = torch.randn(E, H, INTER, device=dev) * 0.3
    topk_weights, topk_ids = select_experts(torch.randn(9, E, device=dev), TOP_K, renormalize=True)
    slots = _slots(dev)
    got = fused_moe(x, topk_weights, topk_ids, w13, w2, slots)  # the Triton kernel (force_triton)
    with kernels.use_backend("torch"):
        want = fused_moe(x, topk_weights, topk_ids, w13, w2, slots)
        base = fused_moe(x, topk_weights, topk_ids, w13, w2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[3:5], base[3:5], rtol=1e-4, atol=1e-4)  # base rows: no delta
    assert (want[:3] - base[:3]).abs().max() > 1e-2 and (want[5:] - base[5:]).abs().max() > 1e-2
