"""LoRA on MoE experts packed into the fused expert layout, and the slot stacks the fused MoE
forward (``pdserve.models.fused_moe``) reads.

Fused layout (vLLM's): ``gate_up_proj`` [E, 2I, H] = cat(gate, up) per expert, ``down_proj``
[E, H, I]. An adapter's expert modules pack the same way, each rank block scaled by the module's
stored ``LoRAModuleWeights.scale`` (never re-derived here: an rsLoRA adapter keeps alpha / sqrt(r)):

    a13 [E, 2R, H]   a fused gate_up LoRA (PEFT target_parameters) in columns [0, r); per-expert
                     gate / up modules: gate's rank block in [0, R), up's in [R, 2R)
    b13 [E, 2I, 2R]  fused: one block over all 2I rows; per-expert: block-diagonal
    s13 [E, 2R]      the stored scales, per rank column (0 where unused)
    a2 [E, R, I], b2 [E, H, R], s2 [E, R]

Module names: ``{experts}.{e}.gate_up_proj`` / ``{experts}.{e}.down_proj`` (``peft.py`` splits
a target_parameters adapter per expert into these), or per-expert modules of the transformers 4
layout (``{experts}.{e}.gate_proj / up_proj / down_proj``; Mixtral's ``block_sparse_moe.experts.
{e}.w1 / w3 / w2``). Non-gated experts (``up`` then ``down``, no third projection, e.g. a GELU
MLP) pack ``up`` alone into a13 / b13 with its own stored scale (``gated=False``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdserve.config.lora import LoRAConfig
from pdserve.lora.apply import LoRAStep
from pdserve.lora.peft_experts import ExpertTarget
from pdserve.lora.weights import LoRAModuleWeights
from pdserve.models.fused_moe import FusedMoE

# per-expert module names of the transformers 4 layout: (gate, up, down)
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
        fused = modules.get(f"{experts_prefix}.{x}.gate_up_proj") if gated else None
        if fused is not None:
            a13[x, : fused.rank], b13[x, :, : fused.rank], s13[x, : fused.rank] = (
                fused.a,
                fused.b,
                fused.scale,
            )
        for i, part in enumerate(parts if fused is None else []):
            w = modules.get(f"{experts_prefix}.{x}.{part}")
            if w is None:
                continue
            col, row = i * r, i * inter
            a13[x, col : col + w.rank] = w.a
            b13[x, row : row + inter, col : col + w.rank] = w.b
            s13[x, col : col + w.rank] = w.scale  # the stored value
        w = modules.get(f"{experts_prefix}.{x}.{down}") or modules.get(f"{experts_prefix}.{x}.down_proj")
        if w is not None:
            a2[x, : w.rank], b2[x, :, : w.rank], s2[x, : w.rank] = w.a, w.b, w.scale
    return PackedExpertLoRA(a13, b13, s13, a2, b2, s2)


class ExpertLoRASlots:
    """One MoE layer's expert LoRA of every slot: [max_loras, ...] stacks of ``PackedExpertLoRA``;
    ``aliases`` are the (experts prefix, per-expert names) an adapter may name this layer by."""

    def __init__(
        self,
        aliases: list[tuple[str, tuple[str, str, str]]],
        num_experts: int,
        hidden: int,
        inter: int,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        gated: bool = True,
    ) -> None:
        self.aliases, self.gated = aliases, gated
        self.num_experts, self.hidden, self.inter, self.max_rank = num_experts, hidden, inter, max_rank
        w = (2 if gated else 1) * max_rank
        s, e = max_loras, num_experts

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.a13, self.b13, self.s13 = (
            zeros(s, e, w, hidden),
            zeros(s, e, w // max_rank * inter, w),
            zeros(s, e, w),
        )
        self.a2, self.b2, self.s2 = (
            zeros(s, e, max_rank, inter),
            zeros(s, e, hidden, max_rank),
            zeros(s, e, max_rank),
        )
        self.step: LoRAStep | None = None  # set by the manager around each forward
        self.has_lora = [False] * max_loras  # per slot: the adapter adapts some expert of this layer

    def set_slot(self, slot: int, modules: dict[str, LoRAModuleWeights]) -> None:
        """Pack one adapter's expert modules of this layer into ``slot`` (zeros if it has none)."""
        prefix, names = self.aliases[0]
        for alias_prefix, alias_names in self.aliases:
            if any(k.startswith(alias_prefix + ".") for k in modules):
                prefix, names = alias_prefix, alias_names
                break
        p = pack_expert_lora(
            modules, prefix, self.num_experts, self.hidden, self.inter, self.max_rank, names, self.gated
        )
        for dst, src in (
            (self.a13, p.a13), (self.b13, p.b13), (self.s13, p.s13), (self.a2, p.a2), (self.b2, p.b2), (self.s2, p.s2)
        ):  # fmt: skip
            dst[slot] = src.to(dst.dtype)
        self.has_lora[slot] = bool(p.s13.any() or p.s2.any())

    def clear_slot(self, slot: int) -> None:
        for t in (self.a13, self.b13, self.s13, self.a2, self.b2, self.s2):
            t[slot].zero_()
        self.has_lora[slot] = False

    # -- fused_moe.ExpertLoRADelta ---------------------------------------------------------------
    def assignment_ids(self, topk_ids: torch.Tensor) -> torch.Tensor | None:
        step = self.step
        if step is None or not any(self.has_lora[s] for s in step.slots_present):
            return None  # no row's adapter adapts this layer's experts: no LoRA GEMMs
        slots = step.row_slots  # [n]
        assert slots.shape[0] == topk_ids.shape[0], (tuple(slots.shape), tuple(topk_ids.shape))
        ids = slots[:, None] * self.num_experts + topk_ids  # [n, k]
        return torch.where(slots[:, None] >= 0, ids, -1).reshape(-1)

    def stacks(self, proj: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if proj == "gate_up":
            a, b, s = self.a13, self.b13, self.s13
        else:
            assert proj == "down", proj
            a, b, s = self.a2, self.b2, self.s2
        return a.flatten(0, 1), b.flatten(0, 1), s.flatten(0, 1)  # [S*E, ...]


def attach_expert_slots(
    model: nn.Module,
    config: LoRAConfig,
    dtype: torch.dtype,
    device: torch.device,
    targets: dict[str, tuple[int, int]],
    expert_targets: dict[str, ExpertTarget],
) -> list[ExpertLoRASlots]:
    """Give every ``FusedMoE`` of ``model`` its slot stacks (``module.lora``), and register what
    an adapter may name: the per-expert modules of the transformers 4 layout in ``targets``, the
    fused 3-D parameters in ``expert_targets``."""
    family = getattr(getattr(model, "cfg", None), "model_type", "")
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, FusedMoE):
            continue
        e, two_inter, hidden = module.gate_up_proj.shape
        inter = two_inter // 2
        aliases = [(name, EXPERT_NAMES["qwen3_moe"])]
        if family == "mixtral":
            aliases.append(
                (name.replace(".mlp.experts", ".block_sparse_moe.experts"), EXPERT_NAMES["mixtral"])
            )
        for prefix, (gate, up, down) in aliases:
            for x in range(e):
                targets[f"{prefix}.{x}.{gate}"] = targets[f"{prefix}.{x}.{up}"] = (hidden, inter)
                targets[f"{prefix}.{x}.{down}"] = (inter, hidden)
        expert_targets[name] = ExpertTarget(
            e, (("gate_up_proj", hidden, two_inter), ("down_proj", inter, hidden))
        )
        slots = ExpertLoRASlots(
            aliases, e, hidden, inter, config.max_loras, config.max_lora_rank, dtype, device
        )
        module.lora = slots
        out.append(slots)
    return out
