"""Gated MLP activation ``silu_and_mul``: dispatch, torch twin and the one capability predicate.

    gate_up = [ gate | up ]   [..., 2*I]   (the fused gate_up_proj output)
    out     = silu(gate) * up  [..., I]

The twin is the model's former code path (``F.silu(gate) * up`` in the input dtype), so the CPU
path is unchanged; the Triton kernel computes in fp32 and rounds once. Which one runs follows the
backend setting (``pdserve.kernels.backend``) and ``silu_and_mul_unsupported_reason``; an
unsupported case on the Triton side raises.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from pdserve.errors import UnsupportedError
from pdserve.kernels import cpu_native_rowwise
from pdserve.kernels.backend import TRITON_DTYPES, device_unsupported_reason, wants_native, wants_triton

_triton_impl: ModuleType | None = None


def silu_and_mul_unsupported_reason(gate_up: torch.Tensor) -> str | None:
    """Why the Triton kernel cannot compute this case, or None if it can."""
    reason = device_unsupported_reason(gate_up)
    if reason is not None:
        return reason
    if gate_up.dtype not in TRITON_DTYPES:
        return f"dtype {gate_up.dtype} is not one of fp16/bf16/fp32"
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2 or gate_up.shape[-1] == 0:
        return f"last dim of {tuple(gate_up.shape)} must be 2*I with I >= 1"
    return None


def silu_and_mul_can_run(gate_up: torch.Tensor) -> bool:
    """The capability predicate: True iff the Triton kernel can compute this case."""
    return silu_and_mul_unsupported_reason(gate_up) is None


def _triton() -> ModuleType:
    global _triton_impl
    if _triton_impl is None:
        from pdserve.kernels import triton_activation

        _triton_impl = triton_activation
    return _triton_impl


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """The twin: [..., 2*I] -> silu(gate) * up [..., I], in gate_up's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)  # [..., I] each
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2*I] -> silu(gate) * up, a new contiguous [..., I] tensor; one launch on CUDA."""
    if not wants_triton(gate_up):
        if wants_native(gate_up):
            out = cpu_native_rowwise.silu_and_mul(gate_up)
            if out is not None:
                return out
        return silu_and_mul_torch(gate_up)
    reason = silu_and_mul_unsupported_reason(gate_up)
    if reason is not None:
        raise UnsupportedError(
            f"no silu_and_mul kernel for {tuple(gate_up.shape)} {gate_up.dtype} on {gate_up.device}: "
            f"{reason}; use the torch backend (kernels.set_backend('torch')) or a supported case"
        )
    rows = gate_up.reshape(-1, gate_up.shape[-1])  # a view whenever possible
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = _triton().silu_and_mul_fwd(rows)  # [rows, I]
    return out.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
