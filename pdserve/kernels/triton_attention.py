"""Triton paged attention: one attention kernel for any mix of query lengths, and its launch.

Imported only by ``pdserve.models.attention_backend`` when the Triton path is taken (it imports
triton), and by cudnn_prefill.py for the requests cuDNN leaves. The torch path
(``pdserve.models.attention_torch``) is the CPU path and the reference these kernels are tested
against. The KV write is triton_kv_write.py; the split count and the merge of split partials
are triton_kv_splits.py.

Attention grid (one program per query tile x KV head x KV split)::

    axis 0  query tiles. Request r owns ceil(q_len_r / BLOCK_Q) tiles starting at
                tile_start(r) = query_start_loc[r] // BLOCK_Q + r   (BLOCK_Q > 1: an upper bound,
                                                                   spare tiles exit at once)
                tile_start(r) = r                                  (BLOCK_Q == 1: decode launches,
                                                                   every request has one token)
    axis 1  KV heads. One program computes the G = H / Hkv query heads that share its KV head;
            row m of the [BLOCK_M, D] query tile is (token q0 + m // G_PAD, head kv_head*G + m % G_PAD).
    axis 2  KV splits (flash-decoding). Keys [0, kv_end) of a tile are cut into NUM_SPLITS runs of
            ceil(kv_end / NUM_SPLITS) rounded up to BLOCK_N; each program writes an unnormalised
            partial (acc, running max, running sum) and ``merge_kv_splits`` combines them.
            The cut depends only on kv_end and NUM_SPLITS, so a request's result does not depend
            on the grid size (a CUDA graph captured for a padded batch computes what eager does).

Everything the kernels read per step (lengths, block tables, slots) comes from device tensors;
the launch shape depends only on (num_tokens, num_seqs, BLOCK_Q, NUM_SPLITS), so one capture
serves every step of that shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_kv_splits import merge_kv_splits
from pdserve.kernels.triton_kv_write import check_kv_cache

MAX_HEAD_DIM = 256
MAX_QUERIES_PER_KV = 64
LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The request whose tiles hold ``tile``: the last r with tile_start(r) <= tile."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# num_seqs and the block table's row stride follow the batch: left to specialize (== 1, % 16),
# every new combination compiled the kernel again on the engine thread while serving (~0.3-1 s;
# bench/gpu_jit_variants.py counts the variants).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    scale_log2,
    num_seqs,
    num_heads,
    stride_q_tok,
    stride_q_head,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_pos,
    stride_kv_head,
    stride_bt,
    stride_o_tok,
    stride_o_head,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if BLOCK_Q == 1:
        seq = tile
        tile_in_seq = 0
    else:
        seq = _find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q)
        tile_in_seq = tile - (tl.load(qsl_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q0 = tile_in_seq * BLOCK_Q
    if q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # keys cached before this step's first query token

    rows = tl.arange(0, BLOCK_M)
    q_local = q0 + rows // G_PAD  # [BLOCK_M] query token index within the request
    g = rows % G_PAD
    row_valid = (g < G) & (rows // G_PAD < BLOCK_Q) & (q_local < q_len)
    head = kv_head * G + g  # [BLOCK_M]
    d = tl.arange(0, D_PAD)
    d_valid = d < HEAD_DIM
    q_tok = (q_start + q_local).to(tl.int64)
    q = tl.load(
        q_ptr + q_tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [BLOCK_M, D_PAD]
    q_pos = ctx_len + q_local  # [BLOCK_M] absolute positions; a query sees keys <= its own

    # Keys this tile reads: [0, kv_end); its last query token sees up to its own position.
    kv_end = tl.minimum(ctx_len + q0 + BLOCK_Q, seq_len)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, kv_end)
    else:
        lo = 0
        hi = kv_end

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    n_off = tl.arange(0, BLOCK_N)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_kv_head
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + n_off  # [BLOCK_N]
        k_valid = k_pos < hi
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        base = blk * stride_kv_block + (k_pos % BLOCK_SIZE) * stride_kv_pos + head_off  # [BLOCK_N]
        kv_mask = k_valid[:, None] & d_valid[None, :]
        k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        v = tl.load(kv_ptr + stride_kv_kv + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = row_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l == 0: no key (padding row) -> 0
        o_ptrs = out_ptr + q_tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials: acc [num_tokens, H, NUM_SPLITS, D_PAD], (max, sum) [num_tokens, H, NUM_SPLITS, 2]
        idx = (q_tok * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_acc_ptr + idx[:, None] * D_PAD + d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + idx * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + idx * 2 + 1, l_i, mask=row_valid)


# ----------------------------------------------------------------------------- wrappers


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    num_splits: int,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    block_q: int | None = None,
) -> torch.Tensor:
    """Causal attention of each request's query tokens over its paged context (already written).

    q: [num_tokens, H, D]; kv_cache: [num_blocks, 2, block_size, Hkv, D]; block_tables:
    [num_seqs, width] int32; seq_lens: [num_seqs] int32; query_start_loc: [num_seqs + 1] int32.
    ``max_query_len`` is an upper bound used only to pick the tile shape (1: decode tiles).
    ``block_n``, ``num_warps``, ``num_stages`` and (prefill tiles only) ``block_q``, the query
    tokens per tile, override the launch heuristics (benchmarks).
    Returns [num_tokens, H, D] in q.dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    check_kv_cache(kv_cache, num_kv_heads, head_dim)
    num_seqs = seq_lens.shape[0]
    assert q.stride(-1) == 1, f"q strides {q.stride()}"
    assert q.dtype == kv_cache.dtype, f"q {q.dtype} vs kv_cache {kv_cache.dtype}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads over {num_kv_heads} KV heads"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, f"{tuple(block_tables.shape)}"
    assert block_tables.dtype == seq_lens.dtype == query_start_loc.dtype == torch.int32
    assert block_tables.stride(1) == 1, f"block_tables strides {block_tables.stride()}"
    assert query_start_loc.shape == (num_seqs + 1,), f"query_start_loc {tuple(query_start_loc.shape)}"
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, f"num_splits {num_splits}"
    group = num_heads // num_kv_heads
    assert group <= MAX_QUERIES_PER_KV and head_dim <= MAX_HEAD_DIM, (group, head_dim)

    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    g_pad = triton.next_power_of_2(group)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if max_query_len == 1:
        block_q, num_tiles = 1, num_tokens
        block_m = max(16, g_pad)
    else:
        block_q = block_q or max(1, 64 // g_pad)
        block_m = max(16, block_q * g_pad)
        num_tiles = num_tokens // block_q + num_seqs
        num_splits = 1  # prefill tiles have enough programs; partials would cost more than they save
    block_n = block_n or (64 if d_pad <= 128 else 32)
    if num_splits > 1:
        part_acc = torch.empty(
            (num_tokens, num_heads, num_splits, d_pad), dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty((num_tokens, num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q,
        kv_cache,
        out,
        part_acc,
        part_ml,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * LOG2E,
        num_seqs,
        num_heads,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        G=group,
        G_PAD=g_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_N=block_n,
        BLOCK_SIZE=kv_cache.shape[2],
        NUM_SPLITS=num_splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps or 4,
        # 2 stages for prefill tiles: 0.53 vs 0.59 ms on 8 x 2k-token prompts (H200 sweep).
        num_stages=num_stages or (3 if max_query_len == 1 else 2),
    )
    if num_splits > 1:
        merge_kv_splits(part_acc, part_ml, out)
    return out


__all__ = ["MAX_HEAD_DIM", "MAX_QUERIES_PER_KV", "paged_attention"]
