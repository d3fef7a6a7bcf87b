"""The torch attention path: causal attention over the paged KV cache on any device, the path
``select_attention_backend`` picks on the CPU (attention_backend.py).

``attend_cached_torch`` is ``attend_cached``'s torch branch (paged_attention.py): the native CPU
kernel (``kernels.cpu_native_attention``) where it takes the step, else each request's context blocks
gathered with one ``index_select`` per layer (an index built once per step) and SDPA over them,
decode rows as one grouped call and only prefill rows padded. ``attend_cached_window`` is the
sliding-window form (gemma3.py), torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve import kernels
from pdserve.errors import UnsupportedError
from pdserve.kernels import cpu_native_attention
from pdserve.kernels.backend import HALF_DTYPES
from pdserve.models.attention import AttentionMetadata
from pdserve.models.kv_store import native_kv_ok


def _context_index(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks holding each request's context, and which of their slots are keys; computed
    once per step for all layers.

    Returns (block ids [B * nb], key_valid [B, nb * block_size]) with nb = ceil(max_seq_len /
    block_size). Slots past a request's seq_len (its last block's tail, padding blocks of the
    block table) are gathered but masked out.
    """
    cached = meta._ctx_index
    if cached is not None:
        return cached
    nb = -(-meta.max_seq_len // block_size)
    assert meta.block_tables.shape[1] >= nb, "block_tables too narrow for max_seq_len"
    blocks = meta.block_tables[:, :nb].reshape(-1).long()  # [B * nb]
    pos = torch.arange(nb * block_size, device=blocks.device)  # [nb * block_size]
    key_valid = pos[None, :] < meta.seq_lens[:, None]  # [B, nb * block_size]
    meta._ctx_index = (blocks, key_valid)
    return meta._ctx_index


def _gather_context(
    kv_cache: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K, V of every request's whole context in SDPA layout [B, Hkv, nb * block_size, D], and
    the key-validity mask [B, nb * block_size].

    Whole blocks are gathered with one index_select (row copies, about twice as fast on CPU as
    gathering single positions), then K and V are split out of each block.
    """
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    blocks, key_valid = _context_index(meta, block_size)
    batch = key_valid.shape[0]
    g = kv_cache.index_select(0, blocks).view(batch, -1, 2, block_size, num_kv_heads, head_dim)
    seq = g.shape[1] * block_size
    key = g[:, :, 0].reshape(batch, seq, num_kv_heads, head_dim)  # [B, S, Hkv, D]
    value = g[:, :, 1].reshape(batch, seq, num_kv_heads, head_dim)
    return key.transpose(1, 2), value.transpose(1, 2), key_valid


def attend_cached_torch(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """``attend_cached`` on the torch path (same shapes), this step's K/V already stored."""
    num_tokens, num_heads, head_dim = q.shape
    _, two, _, num_kv_heads, cache_head_dim = kv_cache.shape
    assert two == 2 and cache_head_dim == head_dim, f"kv_cache shape {tuple(kv_cache.shape)}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads over {num_kv_heads} kv heads"
    assert meta.num_tokens == num_tokens and meta.slot_mapping.shape == (num_tokens,)

    batch = meta.batch_size
    if kernels.wants_native(q) and not meta.static_bounds and native_kv_ok(meta, kv_cache):
        # prefill, decode and mixed steps alike, under the kernel's cap on work
        if meta.max_query_len == 1:
            scores = num_heads * batch * meta.max_seq_len  # a bound, cheaper than the sum
        else:
            scores = cpu_native_attention.attention_scores(meta.query_lens_cpu, meta.seq_lens_cpu, num_heads)
        out = cpu_native_attention.attention(
            q,
            kv_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            meta.max_seq_len,
            scale,
            scores,
        )
        if out is not None:
            return out
    if batch == 1 and q.dtype in HALF_DTYPES and q.device.type == "cpu" and not meta.static_bounds:
        out = _one_request_attention(q, kv_cache, meta, scale)
        if out is not None:
            return out
    key, value, key_valid = _gather_context(kv_cache, meta)

    if meta.max_query_len == 1:
        assert num_tokens == batch
        return _decode_attention(q, key, value, key_valid, num_kv_heads, scale)

    # Mixed batch. Decode rows (one query) take the grouped path; only the prefill rows are
    # padded to the longest query, so a prefill chunk beside many decodes costs what it costs.
    qlens = meta.query_lens_cpu
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    dec = [i for i, n in enumerate(qlens) if n == 1]
    pre = [i for i, n in enumerate(qlens) if n != 1]
    device = q.device
    out = q.new_empty(num_tokens, num_heads, head_dim)
    if dec:
        rows = torch.tensor(dec, device=device)
        tok = torch.tensor([starts[i] for i in dec], device=device)
        out[tok] = _decode_attention(q[tok], key[rows], value[rows], key_valid[rows], num_kv_heads, scale)
    rows = torch.tensor(pre, device=device)
    tok = torch.tensor([t for i in pre for t in range(starts[i], starts[i + 1])], device=device)
    out[tok] = _padded_attention(
        q[tok], key[rows], value[rows], [qlens[i] for i in pre], [meta.seq_lens_cpu[i] for i in pre], scale
    )
    return out


# CPU bf16 decode: below this many (request, KV head) pairs SDPA's kernel is as fast or faster
EAGER_BF16_MIN_ROWS = 8


def _one_request_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor | None:
    """A step of one request on the CPU in half precision, when it is a decode step that would
    take SDPA anyway (fewer KV heads than ``EAGER_BF16_MIN_ROWS``) or a fresh prompt: its keys
    cut to its length instead of masked, a fresh prompt as one causal call, so none of the
    general path's padding and mask building (a 48-token prompt of the tiny bench model: ~150 µs
    a layer less; docs/benchmarks.md, "The CPU decode step"). Returns None for any other step (a chunk
    after cached context): the general path takes it. The same attention as the general path,
    but not always the same bits: SDPA's kernel splits a shorter key run differently (the bench
    model's greedy tokens part at token 74 of 128). fp32 keeps the general path, the one the
    token-identity tests hold; the CPU half-precision path is not token-identical to
    ``transformers`` either way."""
    q_len, seq_len = meta.query_lens_cpu[0], meta.seq_lens_cpu[0]
    _, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if not (q_len == 1 and num_kv_heads < EAGER_BF16_MIN_ROWS) and q_len != seq_len:
        return None
    key, value, _ = _gather_context(kv_cache, meta)  # [1, Hkv, S >= seq_len, D]
    key, value = key[:, :, :seq_len], value[:, :, :seq_len]
    if q_len == 1:
        q_grouped = q.reshape(1, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [1, Hkv, G, D]
        out = F.scaled_dot_product_attention(q_grouped, key, value, scale=scale)
        return out.reshape(1, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, H, L, D]
        key,
        value,
        is_causal=True,  # L queries over L keys: query i sees keys 0..i
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out[0].transpose(0, 1)  # [L, H, D]


def _decode_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_valid: torch.Tensor,
    num_kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """One query per request: the ``group`` query heads that share a KV head stand in as SDPA's
    query axis; no padding and no causal mask beyond key validity.

    q: [B, H, D]; key, value: [B, Hkv, max_seq, D]; key_valid: [B, max_seq] -> [B, H, D].
    """
    batch, num_heads, head_dim = q.shape
    q_grouped = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and batch * num_kv_heads >= EAGER_BF16_MIN_ROWS:
        # transformers' eager attention (bf16 matmuls, fp32 softmax): on the CPU, SDPA's bf16 kernels
        # cost 2.7x this at 16 single-query rows and 5x at 64 (docs/benchmarks.md, "The CPU decode step")
        scores = torch.matmul(q_grouped, key.transpose(-1, -2)).float()  # [B, Hkv, G, S]
        scores.masked_fill_(~key_valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores.mul_(scale), dim=-1).to(q.dtype)
        return torch.matmul(probs, value).reshape(batch, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q_grouped, key, value, attn_mask=key_valid[:, None, None, :], scale=scale
    )
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)  # [B, H, D]


def attend_cached_window(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int
) -> torch.Tensor:
    """``attend_cached`` of a sliding-window layer: a query at position p sees keys at positions
    (p - window, p] (transformers' ``sliding_window_overlay``). Torch path only."""
    if meta.backend != "torch":
        raise UnsupportedError(
            f"sliding-window attention has no {meta.backend} kernel; use the torch backend "
            "(pdserve.kernels.set_backend('torch'))"
        )
    key, value, _ = _gather_context(kv_cache, meta)
    return _padded_attention(q, key, value, meta.query_lens_cpu, meta.seq_lens_cpu, scale, window)


def _padded_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of several requests' query runs, padded to the longest.

    q: [sum(query_lens), H, D] request after request; key, value: [B, Hkv, max_seq, D].
    Query i of request r sits at absolute position seq_len_r - q_len_r + i; with ``window`` it
    sees only the keys of the last ``window`` positions up to its own.
    """
    num_tokens, num_heads, head_dim = q.shape
    batch, num_kv_heads, max_seq, _ = key.shape
    device = q.device
    max_q = max(query_lens)
    qlens_t = torch.tensor(query_lens, device=device)
    starts = torch.cumsum(qlens_t, 0) - qlens_t  # [B]
    #   token t  ->  (batch_idx[t], pos_idx[t]) in the padded [B, max_q] grid
    batch_idx = torch.repeat_interleave(torch.arange(batch, device=device), qlens_t, output_size=num_tokens)
    pos_idx = torch.arange(num_tokens, device=device) - starts[batch_idx]  # [num_tokens]
    q_padded = q.new_zeros(batch, max_q, num_heads, head_dim)
    q_padded[batch_idx, pos_idx] = q
    # Padded query rows continue past seq_len_r; they see >= 1 key, so never give NaN, and are dropped.
    q_abs = (torch.tensor(seq_lens, device=device) - qlens_t)[:, None] + torch.arange(max_q, device=device)
    mask = torch.arange(max_seq, device=device)[None, None, :] <= q_abs[:, :, None]  # [B, max_q, max_seq]
    if window is not None:
        mask &= torch.arange(max_seq, device=device)[None, None, :] > q_abs[:, :, None] - window
    out = F.scaled_dot_product_attention(
        q_padded.transpose(1, 2),  # [B, H, max_q, D]
        key,
        value,
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [B, H, max_q, D]
    return out.transpose(1, 2)[batch_idx, pos_idx].to(q.dtype)  # [num_tokens, H, D]
