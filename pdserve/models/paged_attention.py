"""A layer's attention over the paged KV cache: ``attend_cached`` (this step's K/V already stored
by ``kv_store.rotary_and_store_kv``) and ``paged_attention`` (store, then attend), each taking
the path ``AttentionMetadata.backend`` names (attention_backend.py):

    triton: cuDNN for fresh prompts (cudnn_prefill.py), else FA2 varlen for small prefill steps
            (flash_prefill.py), else the Triton kernel (pdserve.kernels.triton_attention)
    torch:  attention_torch.py

Called by every attention layer (llama.py, lfm2.py, gemma3.py) and the tests of the paths.
"""

from __future__ import annotations

import torch

from pdserve.models import cudnn_prefill, flash_prefill
from pdserve.models.attention import AttentionMetadata
from pdserve.models.attention_backend import triton_impl, triton_kv_splits_impl
from pdserve.models.attention_torch import attend_cached_torch
from pdserve.models.kv_store import store_kv

_sm_counts: dict[torch.device, int] = {}


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
    num_tokens, _, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), f"k {tuple(k.shape)}"
    assert kv_cache.dtype == k.dtype, f"kv_cache {kv_cache.dtype} vs k {k.dtype}"
    store_kv(k, v, kv_cache, meta)
    return attend_cached(q, kv_cache, meta, scale)


def attend_cached(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's query tokens over its paged context, this step's K/V
    already stored (``paged_attention`` without the write). Same shapes as ``paged_attention``.
    ``k``, ``v``: optionally this step's rotated keys and values in token order ([n, Hkv, D]),
    which the cuDNN prefill path reads instead of gathering them from the cache."""
    if meta.backend == "triton":
        # prefill steps: cuDNN for fresh prompts, else flash for small steps (None: not for it)
        out = cudnn_prefill.attend(q, kv_cache, meta, scale, k, v)
        if out is None:
            out = flash_prefill.attend(q, kv_cache, meta, scale)
        return out if out is not None else _attend_triton(q, kv_cache, meta, scale)
    assert meta.backend == "torch", f"attention backend {meta.backend!r}"
    return attend_cached_torch(q, kv_cache, meta, scale)


def _attend_triton(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The Triton path: one attention launch (plus a merge when split).

    Reads only device tensors and launch-shape values (num_tokens, batch size, max_query_len as
    decode-or-not), so it is safe inside a CUDA graph whose metadata holds static bounds.
    """
    num_tokens = q.shape[0]
    num_kv_heads = kv_cache.shape[3]
    assert meta.num_tokens == num_tokens and meta.slot_mapping.shape == (num_tokens,)
    impl = triton_impl()
    batch = meta.batch_size
    splits = 1
    if meta.max_query_len == 1:  # tile shape only; the kernel is the same for every query length
        splits = triton_kv_splits_impl().num_kv_splits(batch, num_kv_heads, _sm_count(q.device))
    return impl.paged_attention(
        q,
        kv_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        scale,
        splits,
    )


def _sm_count(device: torch.device) -> int:
    if device not in _sm_counts:
        _sm_counts[device] = triton_kv_splits_impl().device_sm_count(device)
    return _sm_counts[device]
