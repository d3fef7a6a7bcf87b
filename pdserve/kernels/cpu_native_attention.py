"""The native CPU kernels' attention-side wrappers: rotary + KV store of one fused qkv row
(``rotary_store_kv``), the once-a-step index checks the C side trusts (``positions_ok``,
``kv_indices_ok``), and the paged causal attention with its work cap (``attention``,
``attention_scores``, ``score_cap``, ``attention_simd``). Each wrapper checks that the case is the
C side's and makes one call into the library ``cpu_native`` loads, or returns None so that the
caller takes its torch twin.

Callers: ``models.kv_store`` (rotary + KV store, the index checks) and ``models.attention_torch``
(attention).
"""

from __future__ import annotations

import torch

from pdserve.kernels import cpu_native

# Caps on one call's work: past them torch's kernels (vectorised, threaded) are as fast or faster.
MAX_HEAD_DIM = 512  # the C side's stack buffers
MAX_HEADS_PER_KV = 64  # attention: query heads sharing one KV head (likewise)
MAX_ATTENTION_SCORES = 1 << 15  # attention: (query, key) pairs x heads of one call
# ... of a pure decode call on a CPU without bf16 GEMM hardware, where the torch twin's bf16 bmm is
# a generic loop: at 64 requests x 9 heads x ~150 keys its bmm took ~11 ms a call (SmolLM2-135M,
# docs/benchmarks.md, "CPU engine on SmolLM2-135M"). Prefill chunks keep the cap above (the
# twin's flash attention beats this kernel there).
MAX_DECODE_SCORES_NO_BF16_HW = 1 << 22

_BF16 = torch.bfloat16


def score_cap(decode: bool) -> int:
    """The most (query, key) pairs x heads one ``attention`` call takes."""
    return (
        MAX_DECODE_SCORES_NO_BF16_HW
        if decode and not cpu_native.bf16_gemm_hardware()
        else MAX_ATTENTION_SCORES
    )


def _cache_ok(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> bool:
    """A layer's view [blocks, 2, block_size, Hkv, D] whose inner four dims are contiguous."""
    if kv_cache.dim() != 5 or kv_cache.dtype is not torch.bfloat16 or kv_cache.device.type != "cpu":
        return False
    _, two, bs, hkv, d = kv_cache.shape
    if two != 2 or hkv != num_kv_heads or d != head_dim:
        return False
    return kv_cache.stride()[1:] == (bs * hkv * d, hkv * d, d, 1)


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor | None:
    """Rotate q and k (NeoX halves), store the rotated k and v at ``slot_mapping`` (< 0: skipped)
    and return the rotated q ([n, H, D], new, contiguous), in one call; None when q, k, v are not
    three adjacent views of one fused projection row, or anything else is not for this kernel.
    The caller has checked the indices (``positions_ok``, ``kv_indices_ok``): the C side trusts
    them."""
    lib = cpu_native._lib if cpu_native._loaded else cpu_native.library()
    if lib is None or q.dtype is not _BF16 or q.requires_grad or not q.is_cpu or q.dim() != 3:
        return None
    n, nh, d = q.shape
    nkv = k.shape[1]
    width = (nh + 2 * nkv) * d
    row = q.stride(0) if n > 1 else width
    # q, k, v: consecutive head runs of one row (the fused qkv output's split views)
    if (
        n == 0
        or d % 2
        or d > MAX_HEAD_DIM
        or k.shape != (n, nkv, d)
        or v.shape != (n, nkv, d)
        or q.stride()[1:] != (d, 1)
        or k.stride()[1:] != (d, 1)
        or v.stride()[1:] != (d, 1)
        or row < width
        or (n > 1 and (k.stride(0) != row or v.stride(0) != row))
        or k.data_ptr() != q.data_ptr() + nh * d * 2
        or v.data_ptr() != k.data_ptr() + nkv * d * 2
        or k.dtype is not _BF16
        or v.dtype is not _BF16
        or q.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
    ):
        return None
    if (
        positions.dtype is not torch.int64
        or slot_mapping.dtype is not torch.int64
        or positions.shape != (n,)
        or slot_mapping.shape != (n,)
        or (n > 1 and (positions.stride(0) != 1 or slot_mapping.stride(0) != 1))
        or cos_sin_cache.dtype is not torch.float32
        or cos_sin_cache.dim() != 2
        or cos_sin_cache.shape[1] != d
        or not cos_sin_cache.is_contiguous()
        or not _cache_ok(kv_cache, nkv, d)
    ):
        return None
    q_out = torch.empty((n, nh, d), dtype=_BF16)
    lib.rotary_store(
        q.data_ptr(), row, nh, nkv, d, positions.data_ptr(), cos_sin_cache.data_ptr(),
        kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.shape[2], slot_mapping.data_ptr(), n,
        q_out.data_ptr(),
    )  # fmt: skip
    return q_out


def positions_ok(positions: torch.Tensor, num_positions: int) -> bool:
    """Whether every position indexes a row of the cos/sin cache (``rotary_store_kv`` trusts it)."""
    return not positions.numel() or (0 <= int(positions.min()) and int(positions.max()) < num_positions)


def kv_indices_ok(
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    num_blocks: int,
    block_size: int,
    query_start_loc: torch.Tensor | None = None,
) -> bool:
    """Whether a step's slots, lengths, block ids and (given) query starts stay inside the KV
    cache, the block table and the step's tokens (``rotary_store_kv`` and ``attention`` trust
    them). Once per step, ~10 us: a step that fails it takes the torch twins, which raise on a
    bad index."""
    if slot_mapping.numel() and int(slot_mapping.max()) >= num_blocks * block_size:
        return False
    if seq_lens.numel():
        if int(seq_lens.min()) < 0 or int(seq_lens.max()) > max_seq_len:
            return False
        if max_seq_len > block_tables.shape[1] * block_size:
            return False
        used = block_tables[:, : -(-max_seq_len // block_size)]
        if used.numel() and not (0 <= int(used.min()) and int(used.max()) < num_blocks):
            return False
    if query_start_loc is not None:
        if query_start_loc.dtype is not torch.int32 or query_start_loc.shape != (seq_lens.shape[0] + 1,):
            return False
        if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != slot_mapping.shape[0]:
            return False
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        if q_lens.numel() and not (bool((q_lens >= 0).all()) and bool((q_lens <= seq_lens).all())):
            return False
    return True


def attention_scores(query_lens: list[int], seq_lens: list[int], num_heads: int) -> int:
    """(query, key) pairs x heads of a causal step: the work ``attention`` is capped by."""
    return num_heads * sum(n * (s - n) + n * (n + 1) // 2 for n, s in zip(query_lens, seq_lens, strict=True))


def attention_simd(enable: bool | None = None) -> bool:
    """Whether ``attention`` takes the AVX2 + FMA kernel (``cpu_attention.c``) where it applies
    (head_dim a multiple of 16); on from the load where the CPU has AVX2 and FMA (a cpuid check,
    so the portable build has it too). ``enable`` False turns it off (the scalar loop), True back
    on where the CPU has it: tests and paired benchmarks compare the two in one process. False
    without the library."""
    lib = cpu_native.library()
    if lib is None:
        return False
    return bool(lib.attention_simd(-1 if enable is None else int(enable)))


def attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    scores: int,
) -> torch.Tensor | None:
    """Causal attention of each request's query tokens over its paged context (this step's K/V
    already stored): q [T, H, D] -> [T, H, D], request b's tokens at rows query_start_loc[b] ..
    query_start_loc[b + 1] - 1, the last of its seq_lens[b] positions (prefill chunks, decode
    rows, mixed). None when not for the native kernel: ``scores`` (``attention_scores``) over
    ``score_cap`` (decode: one query per request), a layout it does not read, ... The caller
    has checked the lengths, starts and block ids (``kv_indices_ok``): the C side trusts them."""
    lib = cpu_native._lib if cpu_native._loaded else cpu_native.library()
    if lib is None or q.dtype is not _BF16 or q.requires_grad or not q.is_cpu:
        return None
    if q.dim() != 3 or kv_cache.dim() != 5:
        return None
    tokens, nh, d = q.shape
    batch = seq_lens.shape[0]
    nkv = kv_cache.shape[3]
    if (
        tokens == 0
        or d > MAX_HEAD_DIM
        or scores > score_cap(tokens == batch)
        or nh % nkv
        or nh // nkv > MAX_HEADS_PER_KV
        or not q.is_contiguous()
        or not _cache_ok(kv_cache, nkv, d)
        or block_tables.dtype is not torch.int32
        or seq_lens.dtype is not torch.int32
        or query_start_loc.dtype is not torch.int32
        or block_tables.dim() != 2
        or block_tables.shape[0] != batch
        or block_tables.stride(1) != 1
        or query_start_loc.shape != (batch + 1,)
        or not query_start_loc.is_contiguous()
        or (batch > 1 and seq_lens.stride(0) != 1)
        or block_tables.shape[1] * kv_cache.shape[2] < max_seq_len
    ):
        return None
    out = torch.empty((tokens, nh, d), dtype=_BF16)
    lib.attention(
        q.data_ptr(), kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.shape[2], nkv, d,
        block_tables.data_ptr(), block_tables.stride(0), query_start_loc.data_ptr(), seq_lens.data_ptr(),
        batch, nh, scale, out.data_ptr(),
    )  # fmt: skip
    return out
