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
from pdserve.kernels.triton_kv_write import check_kv_cache

# Lanes (heads x D/2) per block per half: 4096 fp32 = 16 values per thread per half at 8 warps.
_TILE = 4096


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,  # the token's output row: head h at out_ptr + h * out_head_stride
    tok,
    x_tok_stride,
    x_head_stride,
    out_head_stride,
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
        dst = out_ptr + h * out_head_stride + d
        tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_q(
    q_ptr, pos_ptr, cache_ptr, q_out_ptr, tok, q_tok_stride, q_head_stride, cache_stride,
    NUM_Q_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_HQ: tl.constexpr,
):  # fmt: skip
    """Token ``tok``'s cos/sin row (gathered once) and its rotated q heads; returns the row and
    lane index for the caller's k heads."""
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, HALF_PAD)[None, :]  # [1, HALF_PAD]
    d_mask = d < HALF
    row = cache_ptr + pos * cache_stride + d
    cos = tl.load(row, mask=d_mask, other=0.0)
    sin = tl.load(row + HALF, mask=d_mask, other=0.0)
    _rotate_heads(q_ptr, q_out_ptr + tok * (NUM_Q_HEADS * 2 * HALF), tok, q_tok_stride, q_head_stride,
                  2 * HALF, cos, sin, d, d_mask, NUM_Q_HEADS, HALF, BLOCK_HQ)  # fmt: skip
    return cos, sin, d, d_mask


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
    cos, sin, d, d_mask = _rotate_q(q_ptr, pos_ptr, cache_ptr, q_out_ptr, tok, q_tok_stride, q_head_stride,
                                    cache_stride, NUM_Q_HEADS, HALF, HALF_PAD, BLOCK_HQ)  # fmt: skip
    _rotate_heads(k_ptr, k_out_ptr + tok * (NUM_KV_HEADS * 2 * HALF), tok, k_tok_stride, k_head_stride,
                  2 * HALF, cos, sin, d, d_mask, NUM_KV_HEADS, HALF, BLOCK_HK)  # fmt: skip


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cache_ptr,
    q_out_ptr,
    kv_ptr,
    slot_ptr,
    k_out_ptr,  # STORE_K: the rotated k also goes here, [n, Hkv, D] contiguous
    q_tok_stride,
    q_head_stride,
    k_tok_stride,
    k_head_stride,
    v_tok_stride,
    v_head_stride,
    cache_stride,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_pos,
    stride_kv_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    STORE_K: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    cos, sin, d, d_mask = _rotate_q(q_ptr, pos_ptr, cache_ptr, q_out_ptr, tok, q_tok_stride, q_head_stride,
                                    cache_stride, NUM_Q_HEADS, HALF, HALF_PAD, BLOCK_HQ)  # fmt: skip
    if STORE_K:
        _rotate_heads(k_ptr, k_out_ptr + tok * NUM_KV_HEADS * (2 * HALF), tok, k_tok_stride, k_head_stride,
                      2 * HALF, cos, sin, d, d_mask, NUM_KV_HEADS, HALF, BLOCK_HK)  # fmt: skip
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:  # slot < 0: padding row of a captured batch, nothing to store
        dst = kv_ptr + (slot // BLOCK_SIZE) * stride_kv_block + (slot % BLOCK_SIZE) * stride_kv_pos
        _rotate_heads(k_ptr, dst, tok, k_tok_stride, k_head_stride, stride_kv_head, cos, sin, d, d_mask,
                      NUM_KV_HEADS, HALF, BLOCK_HK)  # fmt: skip
        for h0 in range(0, NUM_KV_HEADS, BLOCK_HK):  # v: copied as it is, half by half
            h = h0 + tl.arange(0, BLOCK_HK)[:, None]
            mask = (h < NUM_KV_HEADS) & d_mask
            src = v_ptr + tok * v_tok_stride + h * v_head_stride + d
            v_dst = dst + stride_kv_kv + h * stride_kv_head + d
            tl.store(v_dst, tl.load(src, mask=mask).to(kv_ptr.dtype.element_ty), mask=mask)
            tl.store(v_dst + HALF, tl.load(src + HALF, mask=mask).to(kv_ptr.dtype.element_ty), mask=mask)


def _block_heads(num_heads: int, half_pad: int) -> int:
    return max(1, min(triton.next_power_of_2(num_heads), _TILE // half_pad))


def _check(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    n, _, dim = q.shape
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


def _launch_shape(num_q_heads: int, num_kv_heads: int, dim: int) -> dict[str, int]:
    half = dim // 2
    half_pad = triton.next_power_of_2(half)
    block_hq = _block_heads(num_q_heads, half_pad)
    lanes = block_hq * half_pad
    num_warps = 1 if lanes <= 256 else 2 if lanes <= 1024 else 4 if lanes <= 2048 else 8
    return dict(
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, HALF_PAD=half_pad,
        BLOCK_HQ=block_hq, BLOCK_HK=_block_heads(num_kv_heads, half_pad), num_warps=num_warps,
    )  # fmt: skip


def rotary_fwd(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [n, H, D], k: [n, Hkv, D] (unit last stride); positions [n]; cache [P, D] fp32."""
    _check(q, k, positions, cos_sin_cache)
    n, num_q_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((n, num_q_heads, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((n, num_kv_heads, dim), dtype=k.dtype, device=k.device)
    if n == 0:
        return q_out, k_out
    _rotary_kernel[(n,)](
        q, k, positions, cos_sin_cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        **_launch_shape(num_q_heads, num_kv_heads, dim),
    )  # fmt: skip
    return q_out, k_out


def rotary_store_kv_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotated q ([n, H, D], fresh); rotated k and v stored at ``slot_mapping`` in ``kv_cache`` (one
    layer's view [num_blocks, 2, block_size, Hkv, D], head_dim unit-stride; mutated in place).
    ``k_out`` ([n, Hkv, D] contiguous): the rotated k is also written there, token order (the
    cuDNN prefill path reads the step's keys from it instead of gathering them from the cache)."""
    _check(q, k, positions, cos_sin_cache)
    n, num_q_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    assert v.shape == k.shape and v.stride(2) == 1, f"v {tuple(v.shape)} strides {v.stride()}"
    check_kv_cache(kv_cache, num_kv_heads, dim)
    assert kv_cache.dtype == k.dtype == v.dtype, f"kv_cache {kv_cache.dtype} vs k {k.dtype} v {v.dtype}"
    assert slot_mapping.shape == (n,) and slot_mapping.dtype == torch.int64, f"slots {slot_mapping.shape}"
    assert kv_cache.device == q.device == slot_mapping.device == v.device
    q_out = torch.empty((n, num_q_heads, dim), dtype=q.dtype, device=q.device)
    if k_out is not None:
        assert k_out.shape == k.shape and k_out.is_contiguous() and k_out.dtype == k.dtype, "k_out"
    if n == 0:
        return q_out
    _rotary_store_kv_kernel[(n,)](
        q, k, v, positions, cos_sin_cache, q_out, kv_cache, slot_mapping, q_out if k_out is None else k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[2], STORE_K=k_out is not None, **_launch_shape(num_q_heads, num_kv_heads, dim),
    )  # fmt: skip
    return q_out
