"""Triton KV write: one step's new K/V stored at their slots of a layer's paged cache, and the
check of the cache view the Triton kernels index.

``write_kv_cache`` is called by ``pdserve.models.kv_store`` on the Triton path (through
``attention_backend.triton_kv_write_impl``, it imports triton); ``check_kv_cache`` also by
triton_attention.py and triton_rotary.py, whose kernels read or write the same layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.backend import TRITON_DTYPES


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kv_ptr,
    slot_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_pos,
    stride_kv_head,
    NUM_KV_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding row of a captured batch: nothing to store
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + tok * stride_k_tok + h[:, None] * stride_k_head + d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_v_tok + h[:, None] * stride_v_head + d[None, :], mask=mask)
    dst = kv_ptr + blk * stride_kv_block + off * stride_kv_pos + h[:, None] * stride_kv_head + d[None, :]
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


def check_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """Assert a layer's cache view is what the kernels index: [blocks, 2, block_size, Hkv, D]."""
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2, f"kv_cache shape {tuple(kv_cache.shape)}"
    assert kv_cache.shape[3:] == (num_kv_heads, head_dim), f"kv_cache shape {tuple(kv_cache.shape)}"
    assert kv_cache.stride(-1) == 1, f"kv_cache: head_dim must be unit-stride, strides {kv_cache.stride()}"
    assert kv_cache.dtype in TRITON_DTYPES, f"kv_cache dtype {kv_cache.dtype}"


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """kv_cache[slot] = (k, v) per token; slots < 0 are skipped. Mutates ``kv_cache`` in place.

    k, v: [num_tokens, Hkv, D] (rows may be strided); kv_cache: one layer's view
    [num_blocks, 2, block_size, Hkv, D]; slot_mapping: [num_tokens] int64.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    check_kv_cache(kv_cache, num_kv_heads, head_dim)
    assert v.shape == k.shape, f"v {tuple(v.shape)} vs k {tuple(k.shape)}"
    assert k.stride(-1) == 1 and v.stride(-1) == 1, f"k/v strides {k.stride()} {v.stride()}"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64, (
        f"slot_mapping {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
    )
    assert k.device == kv_cache.device == slot_mapping.device, "k, kv_cache, slot_mapping devices differ"
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        H_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
        num_warps=1 if num_kv_heads * head_dim <= 1024 else 4,
    )


__all__ = ["check_kv_cache", "write_kv_cache"]
