"""Paged attention: metadata built by the model runner, and the torch path.

KV cache layout (fixed; the transfer code relies on it):

    whole stage cache: [num_blocks, num_local_layers, 2, block_size, num_kv_heads, head_dim]
    one layer's view:  kv_cache[:, i]  -> [num_blocks, 2, block_size, num_kv_heads, head_dim]
                       (index 0 = K, 1 = V; the view is non-contiguous in dim 0)

One block holds every local layer's K and V for ``block_size`` positions, so a run of
consecutive blocks is one contiguous byte range for all layers (few, large transfer descriptors).

Tokens of a step are laid out request after request:

    query tokens : | req0: q0 tokens | req1: q1 tokens | ... |      query_start_loc = [0, q0, q0+q1, ...]
    req i context: positions [seq_lens[i] - q_i, seq_lens[i])  are the new tokens; earlier ones
                   are already in the cache (computed earlier, prefix hit or remote KV).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    num_tokens: int  # total query tokens this step
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset for each new token's K/V
    query_start_loc: torch.Tensor  # [batch + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [batch] int32: context length after this step (computed + new)
    block_tables: torch.Tensor  # [batch, max_blocks_per_seq] int32, padded with 0
    query_lens_cpu: list[int]  # same as diff(query_start_loc), on the host
    seq_lens_cpu: list[int]  # same as seq_lens, on the host
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' K/V at their slots. Mutates ``kv_cache`` (a layer view) in place."""
    block_size = kv_cache.shape[2]
    block_ids = slot_mapping // block_size  # [num_tokens]
    offsets = slot_mapping % block_size  # [num_tokens]
    # Index the K and V halves separately: each is still a view of the stage cache, so index_put_
    # writes through to it even though the layer view is non-contiguous in dim 0.
    kv_cache[:, 0][block_ids, offsets] = k
    kv_cache[:, 1][block_ids, offsets] = v


def _gather_context(
    kv_cache: torch.Tensor, meta: AttentionMetadata, max_seq_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K, V of every request's whole context, padded to ``max_seq_len``, and the key-validity mask.

    Padded key slots are zeroed: they come from padding blocks or from the unwritten tail of a
    request's last block, which may hold NaN in a ``torch.empty`` cache (0 * NaN poisons softmax@V).
    """
    block_size = kv_cache.shape[2]
    num_ctx_blocks = -(-max_seq_len // block_size)
    assert meta.block_tables.shape[1] >= num_ctx_blocks, "block_tables too narrow for max_seq_len"
    block_table = meta.block_tables[:, :num_ctx_blocks].long()  # [B, nb]
    batch = block_table.shape[0]
    kv = kv_cache[block_table]  # [B, nb, 2, block_size, Hkv, D]
    kv = kv.transpose(1, 2).reshape(batch, 2, num_ctx_blocks * block_size, *kv.shape[-2:])
    kv = kv[:, :, :max_seq_len]  # [B, 2, max_seq, Hkv, D]
    key_pos = torch.arange(max_seq_len, device=kv.device)  # [max_seq]
    key_valid = key_pos[None, :] < meta.seq_lens[:, None]  # [B, max_seq]
    kv = kv.masked_fill(~key_valid[:, None, :, None, None], 0.0)
    # SDPA layout: [B, Hkv, max_seq, D]
    return kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2), key_valid


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write the new K/V into the cache, then causal attention over each request's whole context.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    kv_cache: one layer's view [num_blocks, 2, block_size, num_kv_heads, head_dim].
    Query i of request r sits at absolute position ``seq_len_r - q_len_r + i`` and sees keys at
    positions <= its own. Returns [num_tokens, num_heads, head_dim] in q.dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, two, _, num_kv_heads, cache_head_dim = kv_cache.shape
    assert two == 2 and cache_head_dim == head_dim, f"kv_cache shape {tuple(kv_cache.shape)}"
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), f"k {tuple(k.shape)}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads over {num_kv_heads} kv heads"
    assert meta.num_tokens == num_tokens and meta.slot_mapping.shape == (num_tokens,)
    assert kv_cache.dtype == k.dtype, f"kv_cache {kv_cache.dtype} vs k {k.dtype}"

    write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    batch = meta.batch_size
    group = num_heads // num_kv_heads
    key, value, key_valid = _gather_context(kv_cache, meta, meta.max_seq_len)

    if meta.max_query_len == 1:
        # Pure decode: one query per request, so the `group` query heads that share a KV head can
        # stand in as SDPA's query axis; no padding and no causal mask beyond the key validity.
        assert num_tokens == batch
        q_grouped = q.view(batch, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
        out = F.scaled_dot_product_attention(
            q_grouped, key, value, attn_mask=key_valid[:, None, None, :], scale=scale
        )  # [B, Hkv, G, D]
        return out.reshape(num_tokens, num_heads, head_dim).to(q.dtype)

    # Mixed batch: scatter queries into [B, max_q, H, D]
    #   token t of the step  ->  (batch_idx[t], pos_idx[t])
    max_q = meta.max_query_len
    device = q.device
    starts = meta.query_start_loc.long()  # [B + 1]
    query_lens = starts[1:] - starts[:-1]  # [B]
    batch_idx = torch.repeat_interleave(
        torch.arange(batch, device=device), query_lens, output_size=num_tokens
    )  # [num_tokens]
    pos_idx = torch.arange(num_tokens, device=device) - starts[batch_idx]  # [num_tokens]
    q_padded = q.new_zeros(batch, max_q, num_heads, head_dim)
    q_padded[batch_idx, pos_idx] = q

    # Query i of request r is at absolute position seq_len_r - q_len_r + i (padded rows continue
    # past seq_len_r; they see >= 1 key, so never produce NaN, and are dropped below).
    q_abs = (meta.seq_lens.long() - query_lens)[:, None] + torch.arange(max_q, device=device)  # [B, max_q]
    key_pos = torch.arange(meta.max_seq_len, device=device)
    mask = key_pos[None, None, :] <= q_abs[:, :, None]  # [B, max_q, max_seq]
    out = F.scaled_dot_product_attention(
        q_padded.transpose(1, 2),  # [B, H, max_q, D]
        key,
        value,
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=group > 1,
    )  # [B, H, max_q, D]
    return out.transpose(1, 2)[batch_idx, pos_idx].to(q.dtype)  # [num_tokens, H, D]
