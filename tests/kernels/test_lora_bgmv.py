"""The LoRA BGMV Triton kernels (interpreter on CPU) equal the torch segmented apply."""

from __future__ import annotations

import torch

from pdserve.lora.apply import LoRASlots, LoRAStep
from pdserve.lora.peft import LoRAModuleWeights


def test_bgmv_equals_segmented(force_triton, device):
    torch.manual_seed(0)
    shards = [("q_proj", 0, 24), ("k_proj", 24, 8)]
    slots = LoRASlots(20, shards, max_loras=3, max_rank=8, dtype=torch.float32, device=torch.device(device))
    for s, rank in enumerate((8, 3, 5)):
        w = [
            LoRAModuleWeights(torch.randn(rank, 20), torch.randn(size, rank), rank, 0.5 + s)
            for _, _, size in shards
        ]
        slots.set_slot(s, [w[0], w[1] if s != 1 else None])
    chunks = [(2, 1), (-1, 2), (0, 1), (1, 1), (2, 1)]
    x = torch.randn(6, 20, device=device)
    y = torch.randn(6, 32, device=device)
    slots.step = LoRAStep.build(chunks, 3, "segmented", torch.float32, torch.device(device))
    want = slots.add_delta(x, y.clone())
    slots.step = LoRAStep.build(chunks, 3, "bgmv", torch.float32, torch.device(device))
    got = slots.add_delta(x, y.clone())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1:3], y[1:3])  # base rows untouched
