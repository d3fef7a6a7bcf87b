"""The native CPU kernels' row-wise wrappers: RMS norm (plain and fused with the residual add),
silu * up, the small-layer linear of a few bf16 rows, and the grammar bitmask on logits. Each
takes [rows, width] tensors, checks that the case is the C side's (dtype, layout, the work under
its cap) and makes one call into the library ``cpu_native`` loads, or returns None (False for
the bitmask) so that the caller takes its torch twin.

Callers: ``kernels.rmsnorm``, ``kernels.activation``, ``models.linear``, ``kernels.bitmask``.
"""

from __future__ import annotations

from types import ModuleType

import torch

from pdserve.kernels import cpu_native
from pdserve.kernels.backend import NEG_INF_BITS

# Caps on one call's work: past them torch's kernels (vectorised, threaded) are as fast or faster.
MAX_ROW_ELEMENTS = 1 << 16  # norms: rows x width
# silu * up: the portable C loop calls the C library's scalar expf, torch's kernel is vectorised:
# the native call wins only at one small row (1 x 512: 4.7 against 5.1 us; 16 x 512: 25.4 against 8.2)
MAX_SILU_ELEMENTS = 512
# ... and the AVX2 loop (cpu_activation.c, on a CPU with AVX2 + FMA: the module's SILU_SIMD)
MAX_SILU_ELEMENTS_SIMD = 1 << 20
MAX_LINEAR_ROWS = 4  # the small-layer GEMM (models/linear.py's fp32 route): rows of one call

_BF16 = torch.bfloat16


def _as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, width] with unit column stride (a 2-D view as it is, or a contiguous tensor
    flattened), or None. The callers' hot case is 2-D."""
    if x.dim() == 2:
        return x if x.stride(1) == 1 else None
    if x.dim() > 2 and x.is_contiguous():
        return x.view(-1, x.shape[-1])
    return None


def _row_stride(x: torch.Tensor) -> int:
    return x.stride(0) if x.shape[0] > 1 else x.shape[1]


def _weight_ok(weight: torch.Tensor, h: int) -> bool:
    return (
        weight.dtype is _BF16
        and weight.is_cpu
        and weight.dim() == 1
        and weight.shape[0] == h
        and weight.stride(0) == 1
    )


# The hot wrappers below are written for their cost: every attribute read of a tensor is
# ~0.1-0.3 us, and they run ~10 times a layer. Their callers have checked ``wants_native(x)``:
# backend auto, x a CPU bf16 tensor.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``rms_norm_torch`` in one call, or None when this case is not for the native kernel."""
    lib = cpu_native._lib if cpu_native._loaded else cpu_native.library()
    if lib is None or x.dtype is not _BF16 or x.requires_grad or not x.is_cpu:
        return None
    rows = _as_rows(x)
    if rows is None:
        return None
    n, h = rows.shape
    if h == 0 or n * h > MAX_ROW_ELEMENTS or not _weight_ok(weight, h):
        return None
    out = torch.empty(x.shape, dtype=_BF16)
    lib.rms_norm(rows.data_ptr(), _row_stride(rows), weight.data_ptr(), eps, out.data_ptr(), n, h)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``fused_add_rms_norm_torch`` in one call, or None when not for the native kernel."""
    lib = cpu_native._lib if cpu_native._loaded else cpu_native.library()
    if lib is None or x.dtype is not _BF16 or residual.dtype is not _BF16 or not x.is_cpu:
        return None
    if x.requires_grad or residual.requires_grad:
        return None
    rx, rr = _as_rows(x), _as_rows(residual)
    if rx is None or rr is None or not residual.is_cpu or rx.shape != rr.shape:
        return None
    n, h = rx.shape
    if h == 0 or n * h > MAX_ROW_ELEMENTS or not _weight_ok(weight, h):
        return None
    out = torch.empty(x.shape, dtype=_BF16)
    new_residual = torch.empty(x.shape, dtype=_BF16)
    lib.add_rms_norm(
        rx.data_ptr(), _row_stride(rx), rr.data_ptr(), _row_stride(rr), weight.data_ptr(), eps,
        out.data_ptr(), new_residual.data_ptr(), n, h,
    )  # fmt: skip
    return out, new_residual


def silu_cap(lib: ModuleType) -> int:
    """The most gate + up elements one ``silu_mul`` call takes (the AVX2 loop's cap or the scalar one's)."""
    return MAX_SILU_ELEMENTS_SIMD if lib.SILU_SIMD else MAX_SILU_ELEMENTS


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu_and_mul_torch`` in one call ([..., 2 I] -> [..., I]), or None."""
    lib = cpu_native._lib if cpu_native._loaded else cpu_native.library()
    if lib is None or gate_up.dtype is not _BF16 or gate_up.requires_grad or not gate_up.is_cpu:
        return None
    rows = _as_rows(gate_up)
    if rows is None:
        return None
    n, width = rows.shape
    if width == 0 or width % 2 or n * width > silu_cap(lib):
        return None
    inter = width // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=_BF16)
    lib.silu_mul(rows.data_ptr(), _row_stride(rows), out.data_ptr(), n, inter)
    return out


def linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear(x.float(), weight_t.t(), bias).to(bf16)`` in one call for a few bf16 rows
    (``MAX_LINEAR_ROWS``), or None. ``weight_t``: the fp32 copy ``models.linear`` keeps of a small
    layer, transposed ([in, out] contiguous: the kernel accumulates whole output rows)."""
    lib = cpu_native._lib if cpu_native._loaded else cpu_native.library()
    if lib is None or x.dtype is not _BF16 or x.requires_grad or not x.is_cpu or x.dim() != 2:
        return None
    rows, n_in = x.shape
    if rows > MAX_LINEAR_ROWS or x.stride(1) != 1 or weight_t.dtype is not torch.float32:
        return None
    if weight_t.dim() != 2 or weight_t.shape[0] != n_in or not weight_t.is_contiguous():
        return None
    n_out = weight_t.shape[1]
    if bias is not None and (
        bias.dtype is not torch.float32 or bias.shape != (n_out,) or bias.stride(0) != 1
    ):
        return None
    out = torch.empty((rows, n_out), dtype=_BF16)
    lib.linear(
        x.data_ptr(), _row_stride(x), weight_t.data_ptr(), None if bias is None else bias.data_ptr(),
        out.data_ptr(), rows, n_in, n_out,
    )  # fmt: skip
    return out


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> bool:
    """``kernels.apply_token_bitmask_`` on CPU logits (fp32, bf16 or fp16) in one call: the
    tokens row i of ``bitmask`` bans in ``logits[rows[i]]`` (row i when ``rows`` is None), and
    every column past the bitmask, := -inf, in place. False when not for the native kernel (then
    nothing was written). Any dtype the table names: the grammar mask runs on fp32 logits too.
    ``rows`` must be distinct, in-range int64 row indices (the model runner's)."""
    lib = cpu_native._lib if cpu_native._loaded else cpu_native.library()
    if lib is None or not logits.is_cpu or logits.dim() != 2 or logits.requires_grad:
        return False
    neg = NEG_INF_BITS.get(logits.dtype)  # signed; the C side keeps the dtype's low bits
    if neg is None or logits.stride(1) != 1 or bitmask.dtype is not torch.int32 or not bitmask.is_cpu:
        return False
    k = bitmask.shape[0]
    if bitmask.dim() != 2 or not bitmask.is_contiguous() or (rows is None and k > logits.shape[0]):
        return False
    if rows is not None and (
        rows.dtype is not torch.int64 or rows.shape != (k,) or not rows.is_contiguous() or not rows.is_cpu
    ):
        return False
    if k == 0:
        return True
    if rows is not None and not (0 <= int(rows.min()) and int(rows.max()) < logits.shape[0]):
        return False
    lib.apply_bitmask(
        logits.data_ptr(), logits.stride(0), logits.element_size(), neg, None if rows is None else rows.data_ptr(),
        k, bitmask.data_ptr(), bitmask.shape[1], logits.shape[1],
    )  # fmt: skip
    return True
