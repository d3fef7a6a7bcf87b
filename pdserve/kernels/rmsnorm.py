"""RMSNorm family: dispatching functions, pure-torch twins and the one capability predicate.

Call sites (models) use only ``rms_norm``, ``fused_add_rms_norm`` and ``gated_rms_norm``. Each
asks ``triton_unsupported_reason`` (the predicate behind ``triton_can_run``) whether the Triton
kernel can compute the case; the backend setting (``pdserve.kernels.backend``: auto, torch,
triton) decides whether it is asked at all.

The twins compute in fp32 and return the input dtype; they are the CPU path and the test
reference. ``triton_rmsnorm`` (which imports triton) is loaded only when a Triton path is taken,
so the CPU engine never pays triton's import and tests can set TRITON_INTERPRET=1 first.
"""

from __future__ import annotations

from types import ModuleType
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from pdserve.errors import UnsupportedError
from pdserve.kernels import cpu_native_rowwise
from pdserve.kernels.backend import TRITON_DTYPES, device_unsupported_reason, wants_native, wants_triton

Activation = Literal["silu", "sigmoid"]

# One program normalises one row held in a single block of next_power_of_2(hidden) lanes; past
# 16384 the row no longer fits in registers (and no supported model is that wide).
MAX_HIDDEN = 16384

_triton_impl: ModuleType | None = None


# ----------------------------------------------------------------------------- capability


def triton_unsupported_reason(x: torch.Tensor, hidden: int, *operands: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot compute this case, or None if they can.

    ``x`` is the activation, ``operands`` the other tensors of the call (weight, gate, residual),
    which must share its device and be fp16/bf16/fp32 too.
    """
    reason = device_unsupported_reason(x, *operands)
    if reason is not None:
        return reason
    for t in (x, *operands):
        if t.dtype not in TRITON_DTYPES:
            return f"dtype {t.dtype} is not one of fp16/bf16/fp32"
    if not 0 < hidden <= MAX_HIDDEN:
        return f"hidden size {hidden} is outside 1..{MAX_HIDDEN} (one row per block)"
    return None


def triton_can_run(x: torch.Tensor, hidden: int, *operands: torch.Tensor) -> bool:
    """The capability predicate: True iff the Triton kernels can compute this case."""
    return triton_unsupported_reason(x, hidden, *operands) is None


def _use_triton(x: torch.Tensor, *operands: torch.Tensor) -> bool:
    """Pick Triton or the twin for one call; raise if Triton is required but cannot run."""
    if not wants_triton(x):
        return False  # the CPU hot path: two compares, no triton import
    reason = triton_unsupported_reason(x, x.shape[-1], *operands)
    if reason is not None:
        raise UnsupportedError(
            f"no RMSNorm kernel for shape {tuple(x.shape)} {x.dtype} on {x.device}: {reason}; "
            "use the torch backend (kernels.set_backend('torch')) or a supported dtype/size"
        )
    return True


def _triton() -> ModuleType:
    global _triton_impl
    if _triton_impl is None:
        from pdserve.kernels import triton_rmsnorm

        _triton_impl = triton_rmsnorm
    return _triton_impl


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., hidden] -> [rows, hidden] with unit column stride; a view whenever possible."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _check_shapes(x: torch.Tensor, weight: torch.Tensor, *same_as_x: torch.Tensor) -> None:
    if weight.shape != (x.shape[-1],):
        raise UnsupportedError(f"weight shape {tuple(weight.shape)} must be ({x.shape[-1]},)")
    for t in same_as_x:
        if t.shape != x.shape:
            raise UnsupportedError(f"operand shape {tuple(t.shape)} must equal x's {tuple(x.shape)}")


# ----------------------------------------------------------------------------- torch twins


def _rms_normalize_fp32(xf: torch.Tensor, eps: float) -> torch.Tensor:
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _activation_fp32(z: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(z.float())
    if activation == "sigmoid":
        return torch.sigmoid(z.float())
    raise UnsupportedError(f"gate activation {activation!r} is not one of {get_args(Activation)}")


# torch's fused CPU kernel of the same formula: 13.6 against 22.9 us for one 128-wide bf16 row
# (docs/benchmarks.md, "The CPU decode step"), bit-identical to the ops below
# (tests/kernels/test_rmsnorm.py::test_the_cpu_fused_norm_equals_the_formula_bit_for_bit).
_FUSED_RMS_NORM = getattr(torch, "_fused_rms_norm", None)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / rms(x) * weight, computed in fp32, returned in x.dtype. x: [..., hidden]."""
    if _FUSED_RMS_NORM is not None and x.device.type == "cpu":
        return _FUSED_RMS_NORM(x.float(), [x.shape[-1]], weight.float(), eps)[0].to(x.dtype)
    return rms_norm_formula(x, weight, eps)


def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_torch`` as separate torch ops (the definition; every device)."""
    return (_rms_normalize_fp32(x.float(), eps) * weight.float()).to(x.dtype)


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual (in fp32, stored in x.dtype); returns (rms_norm(residual'), residual').

    The norm reads the *rounded* residual', so ``normed == rms_norm(residual')`` exactly as the
    next layer will see it. Inputs are not mutated.
    """
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_torch(new_residual, weight, eps), new_residual


def gated_rms_norm_torch(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    activation: Activation = "silu",
    norm_before_gate: bool = True,
) -> torch.Tensor:
    """norm_before_gate: rmsnorm(x) * w * act(z); else rmsnorm(x * act(z)) * w. All fp32 inside."""
    gate = _activation_fp32(z, activation)
    xf = x.float()
    if norm_before_gate:
        y = _rms_normalize_fp32(xf, eps) * weight.float() * gate
    else:
        y = _rms_normalize_fp32(xf * gate, eps) * weight.float()
    return y.to(x.dtype)


# ----------------------------------------------------------------------------- dispatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / rms(x) * weight, computed in fp32, returned in x.dtype. x: [..., hidden]."""
    if not _use_triton(x, weight):
        if wants_native(x):
            y = cpu_native_rowwise.rms_norm(x, weight, eps)
            if y is not None:
                return y
        return rms_norm_torch(x, weight, eps)
    _check_shapes(x, weight)
    y = _triton().rms_norm_fwd(_as_rows(x), weight.contiguous(), eps)  # [rows, hidden]
    return y.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual'). Inputs are not mutated."""
    if not _use_triton(x, residual, weight):
        if wants_native(x):
            pair = cpu_native_rowwise.fused_add_rms_norm(x, residual, weight, eps)
            if pair is not None:
                return pair
        return fused_add_rms_norm_torch(x, residual, weight, eps)
    _check_shapes(x, weight, residual)
    if residual.dtype != x.dtype:
        raise UnsupportedError(f"residual dtype {residual.dtype} must equal x's {x.dtype}")
    normed, new_residual = _triton().fused_add_rms_norm_fwd(
        _as_rows(x), _as_rows(residual), weight.contiguous(), eps
    )
    return normed.view(x.shape), new_residual.view(x.shape)


def gated_rms_norm(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    activation: str = "silu",
    norm_before_gate: bool = True,
) -> torch.Tensor:
    """norm_before_gate: rmsnorm(x) * w * act(z); else rmsnorm(x * act(z)) * w."""
    if not _use_triton(x, z, weight):
        return gated_rms_norm_torch(x, z, weight, eps, activation, norm_before_gate)  # type: ignore[arg-type]
    _check_shapes(x, weight, z)
    if activation not in get_args(Activation):
        raise UnsupportedError(f"gate activation {activation!r} is not one of {get_args(Activation)}")
    y = _triton().gated_rms_norm_fwd(
        _as_rows(x), _as_rows(z), weight.contiguous(), eps, activation, norm_before_gate
    )
    return y.view(x.shape)
