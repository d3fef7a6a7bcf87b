"""Triton ``silu_and_mul``. Imported only by ``activation._triton``.

    grid = (rows, cdiv(I, BLOCK))      program (r, c): columns [c*BLOCK, (c+1)*BLOCK) of row r
    out[r, j] = silu(x[r, j]) * x[r, I + j]      in fp32, rounded once to the output dtype

Rows may be strided (unit column stride); the output is a fresh contiguous [rows, I] tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.backend import TRITON_DTYPES

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_row_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    src = x_ptr + row * x_row_stride + cols
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + inter, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * inter + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_fwd(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, 2*I] with unit column stride -> [rows, I]."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.shape[1] > 0, f"x shape {tuple(x.shape)}"
    assert x.stride(1) == 1, f"columns must be unit-stride, strides {x.stride()}"
    assert x.dtype in TRITON_DTYPES, f"dtype {x.dtype}"
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows:
        block = min(_BLOCK, triton.next_power_of_2(inter))
        grid = (rows, triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            x, out, x.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 1
        )
    return out
