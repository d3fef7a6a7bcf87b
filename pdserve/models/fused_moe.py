"""Fused MoE: the router's top-k and the experts' GEMMs of one step, with expert LoRA.

Experts live in the fused layout (vLLM's, and transformers 5's parameter names):

    gate_up_proj  [E, 2I, H]   cat(gate, up) of every expert
    down_proj     [E, H, I]

A step's ``n`` rows each pick ``k`` experts; every (row, expert) pair is one *assignment*
(``n * k`` of them, row-major). The forward is a few calls of one grouped GEMM:

    moe_gemm(x, w, ids, src)[i] = x[src[i]] @ w[ids[i]].T     (0 where ids[i] < 0)

    h = moe_gemm(x, gate_up_proj, topk_ids, row of i)     [n*k, 2I]
      + LoRA: moe_gemm(moe_gemm(x, A13, lora_ids, row) * s13, B13, lora_ids)
    a = silu(gate) * up                                    [n*k, I]
    y = moe_gemm(a, down_proj, topk_ids)                   [n*k, H]  (+ LoRA the same way)
    out = sum over k of topk_weights * y                   [n, H]

Expert LoRA is the same GEMM over ``slots * E`` "experts": ``lora_ids = slot * E + expert``
(-1 for base-model rows), its stacks packed by ``pdserve.lora.moe`` with each adapter's stored
scale. ``moe_gemm`` has a torch twin (rows grouped by id, one GEMM per id present: the CPU
path and the reference) and a Triton kernel (``fused_moe_triton``) chosen by the kernel
backend and ``moe_gemm_unsupported_reason``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.errors import UnsupportedError
from pdserve.kernels import silu_and_mul
from pdserve.kernels.backend import TRITON_DTYPES, device_unsupported_reason, wants_triton

_triton_impl: ModuleType | None = None


class ExpertLoRADelta(Protocol):
    """What the MoE forward needs of its served adapters (``pdserve.lora.moe.ExpertLoRASlots``)."""

    def assignment_ids(self, topk_ids: torch.Tensor) -> torch.Tensor | None:
        """[n*k] ``slot * E + expert`` per assignment, -1 for base-model rows; None: no adapter row."""
        ...

    def stacks(self, proj: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``proj`` "gate_up" | "down": (a [S*E, R, in], b [S*E, out, R], scale [S*E, R])."""
        ...


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [n, k] in the logits' dtype, expert ids [n, k] int64): softmax in fp32 over all
    experts, the top k, divided by their sum when ``renormalize`` (transformers' routers)."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [n, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [n, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def moe_gemm_unsupported_reason(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why the Triton kernel cannot compute ``moe_gemm(x, w, ...)``, or None if it can."""
    reason = device_unsupported_reason(x, w)
    if reason is not None:
        return reason
    if x.dtype not in TRITON_DTYPES or w.dtype != x.dtype:
        return f"dtypes {x.dtype} / {w.dtype} must be one of fp16/bf16/fp32, the same for both"
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        return f"shapes {tuple(x.shape)} x {tuple(w.shape)} are not [M, K] x [E, N, K]"
    if x.stride(1) != 1 or w.stride(2) != 1:
        return "the K dimension of x and w must be contiguous"
    return None


def moe_gemm_torch(
    x: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # [E, N, K]
    ids: torch.Tensor,  # [T] int64, -1: no expert (the row stays 0)
    src: torch.Tensor | None = None,  # [T] int64 row of x per assignment; None: row i
) -> torch.Tensor:
    """The twin: [T, N] with row i = x[src[i]] @ w[ids[i]].T, grouped by id (one GEMM each)."""
    out = x.new_zeros(ids.shape[0], w.shape[1])
    if ids.numel() == 0:
        return out
    order = torch.argsort(ids, stable=True)
    present, counts = torch.unique_consecutive(ids[order], return_counts=True)
    start = 0
    for e, c in zip(present.tolist(), counts.tolist(), strict=True):
        rows = order[start : start + c]
        start += c
        if e < 0:
            continue
        xr = x[rows if src is None else src[rows]]  # [c, K]
        out[rows] = xr @ w[e].T
    return out


def _triton() -> ModuleType:
    global _triton_impl
    if _triton_impl is None:
        from pdserve.models import fused_moe_triton

        _triton_impl = fused_moe_triton
    return _triton_impl


def moe_gemm(
    x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, src: torch.Tensor | None = None
) -> torch.Tensor:
    """``moe_gemm_torch``'s result, on the Triton kernel where the backend asks for it."""
    if not wants_triton(x):
        return moe_gemm_torch(x, w, ids, src)
    reason = moe_gemm_unsupported_reason(x, w)
    if reason is not None:
        raise UnsupportedError(
            f"no fused MoE kernel for {tuple(x.shape)} x {tuple(w.shape)} {x.dtype} on {x.device}: {reason}; "
            "use the torch backend (kernels.set_backend('torch')) or a supported case"
        )
    return _triton().moe_gemm(x, w, ids, src)


def _lora_delta(
    x: torch.Tensor,  # [M, in]
    stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    lora_ids: torch.Tensor,  # [T]
    src: torch.Tensor | None,
) -> torch.Tensor:
    """Computed in the stacks' dtype (fp32 on the CPU, as the dense LoRA apply), then cast."""
    a, b, scale = stacks  # [S*E, R, in], [S*E, out, R], [S*E, R]
    xa = moe_gemm(x.to(a.dtype), a, lora_ids, src)  # [T, R]
    xa = xa * scale[lora_ids.clamp(min=0)]  # each assignment's adapter's stored scales
    return moe_gemm(xa, b, lora_ids).to(x.dtype)  # [T, out]; 0 for base rows


def fused_moe(
    x: torch.Tensor,  # [n, H]
    topk_weights: torch.Tensor,  # [n, k]
    topk_ids: torch.Tensor,  # [n, k] int64
    gate_up_proj: torch.Tensor,  # [E, 2I, H]
    down_proj: torch.Tensor,  # [E, H, I]
    lora: ExpertLoRADelta | None = None,
    gated: bool = True,
) -> torch.Tensor:
    """The MoE layer's output [n, H] in x's dtype (see the module docstring). ``gated=False``:
    experts without a gate (gate_up_proj holds only ``up`` [E, I, H]; GELU), the rule kept
    for non-gated expert LoRA packing."""
    n, k = topk_ids.shape
    ids = topk_ids.reshape(-1)  # [n*k]
    src = torch.arange(n, device=x.device).repeat_interleave(k)  # x's row of each assignment
    lora_ids = lora.assignment_ids(topk_ids) if lora is not None else None
    h = moe_gemm(x, gate_up_proj, ids, src)  # [n*k, 2I]
    if lora is not None and lora_ids is not None:
        h = h + _lora_delta(x, lora.stacks("gate_up"), lora_ids, src)
    act = silu_and_mul(h) if gated else F.gelu(h)  # [n*k, I]
    y = moe_gemm(act, down_proj, ids)  # [n*k, H]
    if lora is not None and lora_ids is not None:
        y = y + _lora_delta(act, lora.stacks("down"), lora_ids, None)
    return (y.view(n, k, -1) * topk_weights.to(y.dtype).unsqueeze(-1)).sum(dim=1)


class FusedMoE(nn.Module):
    """One layer's experts (parameters named as transformers 5 names them)."""

    # The slot stacks of served adapters' expert LoRA (pdserve.lora.manager attaches them).
    lora: ExpertLoRADelta | None = None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:  # [n, H]
        return fused_moe(x, topk_weights, topk_ids, self.gate_up_proj, self.down_proj, self.lora)
