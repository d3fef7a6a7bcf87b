"""Triton RMSNorm kernels: plain, fused residual-add, and gated. Imported only by ``rmsnorm._triton``.

Layout shared by all three: one program per row; the row is loaded as one block of
``BLOCK = next_power_of_2(hidden)`` lanes (masked past ``hidden``), reduced in fp32, and written
once. Rows may be strided (a slice of a larger tensor): each operand carries its own row stride,
columns must be unit-stride. Outputs are fresh contiguous tensors; inputs are never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.rmsnorm import MAX_HIDDEN, TRITON_DTYPES

_ACT_SILU = 0
_ACT_SIGMOID = 1
_ACTIVATIONS = {"silu": _ACT_SILU, "sigmoid": _ACT_SIGMOID}


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    x_row_stride,
    y_row_stride,
    hidden,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    y = x * rstd * w
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    res_out_ptr,
    x_row_stride,
    res_row_stride,
    y_row_stride,
    res_out_row_stride,
    hidden,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    # Round the sum to the storage dtype first: the norm then reads exactly the residual that
    # the next layer gets (same contract as the torch twin).
    s = (x + r).to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + row * res_out_row_stride + cols, s, mask=mask)
    s = s.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s * s, axis=0) / hidden + eps)
    y = s * rstd * w
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    y_ptr,
    x_row_stride,
    z_row_stride,
    y_row_stride,
    hidden,
    eps,
    ACTIVATION: tl.constexpr,
    NORM_BEFORE_GATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * z_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:
        gate = z * tl.sigmoid(z)  # silu
    else:
        gate = tl.sigmoid(z)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM_BEFORE_GATE:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
        y = x * rstd * w * gate
    else:
        h = x * gate  # masked lanes: x == 0 so h == 0 and the sum is unaffected
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
        y = h * rstd * w
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _launch_config(hidden: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for one row of ``hidden`` elements."""
    block = triton.next_power_of_2(hidden)
    if block >= 8192:
        num_warps = 16
    elif block >= 2048:
        num_warps = 8
    else:
        num_warps = 4
    return block, num_warps


def _check_rows(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    assert t.dim() == 2, f"{name}: expected [rows, hidden], got {tuple(t.shape)}"
    assert t.shape == like.shape, f"{name}: shape {tuple(t.shape)} != {tuple(like.shape)}"
    assert t.stride(1) == 1, f"{name}: columns must be unit-stride, strides {t.stride()}"
    assert t.dtype in TRITON_DTYPES, f"{name}: dtype {t.dtype}"
    assert t.device == like.device, f"{name}: device {t.device} != {like.device}"


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> None:
    hidden = x.shape[1]
    assert 0 < hidden <= MAX_HIDDEN, f"hidden {hidden} outside 1..{MAX_HIDDEN}"
    assert weight.shape == (hidden,), f"weight: shape {tuple(weight.shape)} != ({hidden},)"
    assert weight.stride(0) == 1, f"weight: must be contiguous, stride {weight.stride()}"
    assert weight.dtype in TRITON_DTYPES, f"weight: dtype {weight.dtype}"
    assert weight.device == x.device, f"weight: device {weight.device} != {x.device}"


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [rows, hidden] (row-strided ok) -> y: [rows, hidden] contiguous, x.dtype."""
    _check_rows("x", x, x)
    _check_weight(weight, x)
    rows, hidden = x.shape
    y = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    block, num_warps = _launch_config(hidden)
    _rms_norm_kernel[(rows,)](
        x, weight, y, x.stride(0), y.stride(0), hidden, eps, BLOCK=block, num_warps=num_warps
    )
    return y


def fused_add_rms_norm_fwd(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [rows, hidden] -> (normed, x + residual), both new contiguous tensors."""
    _check_rows("x", x, x)
    _check_rows("residual", residual, x)
    assert residual.dtype == x.dtype, f"residual dtype {residual.dtype} != x dtype {x.dtype}"
    _check_weight(weight, x)
    rows, hidden = x.shape
    y = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    res_out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y, res_out
    block, num_warps = _launch_config(hidden)
    _fused_add_rms_norm_kernel[(rows,)](
        x,
        residual,
        weight,
        y,
        res_out,
        x.stride(0),
        residual.stride(0),
        y.stride(0),
        res_out.stride(0),
        hidden,
        eps,
        BLOCK=block,
        num_warps=num_warps,
    )
    return y, res_out


def gated_rms_norm_fwd(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    activation: str,
    norm_before_gate: bool,
) -> torch.Tensor:
    """x, z: [rows, hidden] -> y: [rows, hidden] contiguous, x.dtype (z may differ in dtype)."""
    _check_rows("x", x, x)
    _check_rows("z", z, x)
    _check_weight(weight, x)
    assert activation in _ACTIVATIONS, f"activation {activation!r}"
    rows, hidden = x.shape
    y = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    block, num_warps = _launch_config(hidden)
    _gated_rms_norm_kernel[(rows,)](
        x,
        z,
        weight,
        y,
        x.stride(0),
        z.stride(0),
        y.stride(0),
        hidden,
        eps,
        ACTIVATION=_ACTIVATIONS[activation],
        NORM_BEFORE_GATE=bool(norm_before_gate),
        BLOCK=block,
        num_warps=num_warps,
    )
    return y
