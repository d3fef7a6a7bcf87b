"""Triton BGMV kernels (Punica's shape) for the LoRA apply on CUDA: each token row gathers its own
slot's A and B, so a batch of mixed adapters is two launches per layer.

    shrink  xa[n, :] = (x[n] @ a[slot[n]].T) * scale[slot[n]]     a [S, R', in], scale [S, R']
    expand  y[n, :] += xa[n] @ b_t[slot[n]]                        b_t [S, R', out]

Rows whose slot is -1 (the base model) are skipped. One program per (row, block of outputs):
decode-shaped steps (few rows) are what it is for; prefill rows of one adapter take the same
path (correct, not tuned). Imported only when the Triton path is taken.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, s_ptr, slot_ptr, out_ptr, K, R, stride_x, stride_as, stride_ar, stride_ss, stride_o,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    rb = tl.program_id(1)
    slot = tl.load(slot_ptr + row)
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    if slot < 0:
        tl.store(out_ptr + row * stride_o + offs_r, tl.zeros([BLOCK_R], dtype=tl.float32), mask=offs_r < R)
        return
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + row * stride_x + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :],
            mask=(offs_r[:, None] < R) & (offs_k[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * xv[None, :], axis=1)
    s = tl.load(s_ptr + slot * stride_ss + offs_r, mask=offs_r < R, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs_r, acc * s, mask=offs_r < R)


@triton.jit
def _expand_kernel(
    xa_ptr, b_ptr, slot_ptr, y_ptr, R, N, stride_xa, stride_bs, stride_br, stride_y,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    nb = tl.program_id(1)
    slot = tl.load(slot_ptr + row)
    if slot < 0:
        return
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        xa = tl.load(xa_ptr + row * stride_xa + offs_r, mask=offs_r < R, other=0.0)
        b = tl.load(
            b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
            mask=(offs_r[:, None] < R) & (offs_n[None, :] < N),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(b * xa[:, None], axis=0)
    y_old = tl.load(y_ptr + row * stride_y + offs_n, mask=offs_n < N, other=0.0)
    tl.store(y_ptr + row * stride_y + offs_n, (y_old.to(tl.float32) + acc).to(y_old.dtype), mask=offs_n < N)


def bgmv_add(
    x: torch.Tensor,  # [n, in]
    y: torch.Tensor,  # [n, out], updated in place
    a: torch.Tensor,  # [S, R', in]
    b_t: torch.Tensor,  # [S, R', out]
    scale: torch.Tensor,  # [S, R']
    row_slots: torch.Tensor,  # [n] int64, -1 = base
) -> torch.Tensor:
    n, k = x.shape
    s, r, _ = a.shape
    out = y.shape[1]
    assert x.is_contiguous() and y.is_contiguous() and a.is_contiguous() and b_t.is_contiguous()
    assert a.shape == (s, r, k) and b_t.shape == (s, r, out) and scale.shape == (s, r), (a.shape, b_t.shape)
    assert row_slots.shape == (n,) and row_slots.dtype == torch.int64
    xa = torch.empty(n, r, dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(min(r, 64)))
    _shrink_kernel[(n, triton.cdiv(r, block_r))](
        x, a, scale, row_slots, xa, k, r, x.stride(0), a.stride(0), a.stride(1), scale.stride(0), xa.stride(0),
        BLOCK_R=block_r, BLOCK_K=64,
    )  # fmt: skip
    _expand_kernel[(n, triton.cdiv(out, 64))](
        xa, b_t, row_slots, y, r, out, xa.stride(0), b_t.stride(0), b_t.stride(1), y.stride(0),
        BLOCK_R=block_r, BLOCK_N=64,
    )  # fmt: skip
    return y
