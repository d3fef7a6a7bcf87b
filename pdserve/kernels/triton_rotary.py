"""Triton rotary embedding for q and k in one launch. Imported only by ``rotary._triton``.

One program per token: it gathers the token's cos/sin row from the cache once, then rotates its q
heads and its k heads in blocks of BLOCK_H heads x D/2 lanes (both halves of a head at a time):

    grid = (num_tokens,)
    program t:  pos = positions[t];  cos, sin = cache[pos, :D/2], cache[pos, D/2:]
                for each block of q heads, then of k heads:
                    out[t, h, :D/2] = x1*cos - x2*sin;  out[t, h, D/2:] = x2*cos + x1*sin

q and k may be strided views (of the fused qkv output); the last dim must be unit-stride. The
outputs are fresh contiguous tensors. No host reads, no data-dependent shapes: graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.backend import TRITON_DTYPES
from pdserve.kernels.rotary import MAX_ROTARY_HEAD_DIM, POSITION_DTYPES

# Lanes (heads x D/2) per block per half: 4096 fp32 = 16 values per thread per half at 8 warps.
_TILE = 4096


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    tok,
    x_tok_stride,
    x_head_stride,
    cos,  # [1, HALF_PAD] fp32
    sin,
    d,  # [1, HALF_PAD] lane index within a half
    d_mask,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    for h0 in range(0, NUM_HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        mask = (h < NUM_HEADS) & d_mask
        src = x_ptr + tok * x_tok_stride + h * x_head_stride + d
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        dst = out_ptr + tok * (NUM_HEADS * 2 * HALF) + h * (2 * HALF) + d
        tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    q_out_ptr,
    k_out_ptr,
    q_tok_stride,
    q_head_stride,
    k_tok_stride,
    k_head_stride,
    cache_stride,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, HALF_PAD)[None, :]  # [1, HALF_PAD]
    d_mask = d < HALF
    row = cache_ptr + pos * cache_stride + d
    cos = tl.load(row, mask=d_mask, other=0.0)
    sin = tl.load(row + HALF, mask=d_mask, other=0.0)
    _rotate_heads(q_ptr, q_out_ptr, tok, q_tok_stride, q_head_stride, cos, sin, d, d_mask,
                  NUM_Q_HEADS, HALF, BLOCK_HQ)  # fmt: skip
    _rotate_heads(k_ptr, k_out_ptr, tok, k_tok_stride, k_head_stride, cos, sin, d, d_mask,
                  NUM_KV_HEADS, HALF, BLOCK_HK)  # fmt: skip


def _block_heads(num_heads: int, half_pad: int) -> int:
    return max(1, min(triton.next_power_of_2(num_heads), _TILE // half_pad))


def rotary_fwd(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [n, H, D], k: [n, Hkv, D] (unit last stride); positions [n]; cache [P, D] fp32."""
    n, num_q_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1, f"head_dim must be unit-stride: {q.stride()} {k.stride()}"
    assert k.shape == (n, num_kv_heads, dim), f"k {tuple(k.shape)} vs q {tuple(q.shape)}"
    assert q.dtype in TRITON_DTYPES and k.dtype == q.dtype, f"dtypes {q.dtype} {k.dtype}"
    assert dim % 2 == 0 and dim <= MAX_ROTARY_HEAD_DIM, f"head_dim {dim}"
    assert positions.shape == (n,) and positions.dtype in POSITION_DTYPES, f"positions {positions.shape}"
    assert positions.stride(0) == 1 or n <= 1, f"positions must be contiguous, stride {positions.stride()}"
    assert cos_sin_cache.shape[1] == dim and cos_sin_cache.stride(1) == 1, f"cache {cos_sin_cache.shape}"
    assert cos_sin_cache.dtype == torch.float32, f"cache dtype {cos_sin_cache.dtype}"
    assert q.device == k.device == positions.device == cos_sin_cache.device
    q_out = torch.empty((n, num_q_heads, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((n, num_kv_heads, dim), dtype=k.dtype, device=k.device)
    if n == 0:
        return q_out, k_out
    half = dim // 2
    half_pad = triton.next_power_of_2(half)
    block_hq = _block_heads(num_q_heads, half_pad)
    lanes = block_hq * half_pad
    num_warps = 1 if lanes <= 256 else 2 if lanes <= 1024 else 4 if lanes <= 2048 else 8
    _rotary_kernel[(n,)](
        q, k, positions, cos_sin_cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, HALF_PAD=half_pad,
        BLOCK_HQ=block_hq, BLOCK_HK=_block_heads(num_kv_heads, half_pad), num_warps=num_warps,
    )  # fmt: skip
    return q_out, k_out
