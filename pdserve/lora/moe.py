"""LoRA on MoE experts packed into the fused expert layout, and a grouped torch MoE (CPU path).

Fused layout (vLLM's): ``w13`` [E, 2I, H] = cat(gate, up) per expert, ``w2`` [E, H, I]. An
adapter's per-expert modules pack the same way, each rank block scaled by the module's stored
``LoRAModuleWeights.scale`` (never re-derived here: an rsLoRA adapter keeps alpha / sqrt(r)):

    a13 [E, 2R, H]   gate's rank block in columns [0, R), up's in [R, 2R)
    b13 [E, 2I, 2R]  block-diagonal: gate rows read gate's block, up rows up's
    s13 [E, 2R]      the stored scales, per rank column (0 where unused)
    a2 [E, R, I], b2 [E, H, R], s2 [E, R]

Non-gated experts (``up`` then ``down``, no third projection, e.g. a GELU MLP) pack ``up`` alone
into a13 / b13 with its own stored scale (``gated=False``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.lora.peft import LoRAModuleWeights

# expert module names per family: (gate, up, down); Mixtral's w1 / w3 / w2
EXPERT_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


@dataclass
class PackedExpertLoRA:
    a13: torch.Tensor
    b13: torch.Tensor
    s13: torch.Tensor
    a2: torch.Tensor
    b2: torch.Tensor
    s2: torch.Tensor


def pack_expert_lora(
    modules: dict[str, LoRAModuleWeights],
    experts_prefix: str,  # e.g. "model.layers.0.mlp.experts"
    num_experts: int,
    hidden: int,
    inter: int,
    max_rank: int,
    names: tuple[str, str, str] = EXPERT_NAMES["qwen3_moe"],
    gated: bool = True,
) -> PackedExpertLoRA:
    """One adapter's expert LoRA in the fused layout (zeros for experts / projections it leaves)."""
    gate, up, down = names
    parts = [gate, up] if gated else [up]
    r, e = max_rank, num_experts
    a13 = torch.zeros(e, len(parts) * r, hidden)
    b13 = torch.zeros(e, len(parts) * inter, len(parts) * r)
    s13 = torch.zeros(e, len(parts) * r)
    a2, b2, s2 = torch.zeros(e, r, inter), torch.zeros(e, hidden, r), torch.zeros(e, r)
    for x in range(e):
        for i, part in enumerate(parts):
            w = modules.get(f"{experts_prefix}.{x}.{part}")
            if w is None:
                continue
            col, row = i * r, i * inter
            a13[x, col : col + w.rank] = w.a
            b13[x, row : row + inter, col : col + w.rank] = w.b
            s13[x, col : col + w.rank] = w.scale  # the stored value
        w = modules.get(f"{experts_prefix}.{x}.{down}")
        if w is not None:
            a2[x, : w.rank], b2[x, :, : w.rank], s2[x, : w.rank] = w.a, w.b, w.scale
    return PackedExpertLoRA(a13, b13, s13, a2, b2, s2)


def grouped_moe(
    x: torch.Tensor,  # [n, H]
    router_logits: torch.Tensor,  # [n, E]
    w13: torch.Tensor,  # [E, 2I, H] gated, [E, I, H] not
    w2: torch.Tensor,  # [E, H, I]
    top_k: int,
    renormalize: bool,  # Qwen3-MoE / Mixtral: True (top-k weights renormalised to sum 1)
    lora: PackedExpertLoRA | None = None,
    gated: bool = True,
) -> torch.Tensor:
    """The MoE layer on the CPU: rows grouped by expert, one GEMM pair per expert present."""
    weights = torch.softmax(router_logits.float(), dim=-1)
    topw, topi = torch.topk(weights, top_k, dim=-1)  # [n, k]
    if renormalize:
        topw = topw / topw.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in torch.unique(topi).tolist():
        rows, slot = (topi == e).nonzero(as_tuple=True)
        xe = x[rows].float()
        h = xe @ w13[e].T.float()
        if lora is not None:
            h = h + ((xe @ lora.a13[e].T) * lora.s13[e]) @ lora.b13[e].T
        if gated:
            g, u = h.chunk(2, dim=-1)
            h = F.silu(g) * u
        else:
            h = F.gelu(h)
        y = h @ w2[e].T.float()
        if lora is not None:
            y = y + ((h @ lora.a2[e].T) * lora.s2[e]) @ lora.b2[e].T
        out.index_add_(0, rows, y * topw[rows, slot, None])
    return out.to(x.dtype)
