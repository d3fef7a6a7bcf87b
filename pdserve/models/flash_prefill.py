"""Prefill attention through torch's varlen FlashAttention-2 kernel (CUDA, fp16 / bf16).

Measured on the H200 (docs/benchmarks.md, "Prefill on the H200"), Llama-1B shape, 32
prompts of 2,000 tokens: at the default token budget of 2,048 (every step one chunk of a long
prompt, few query tiles of very unequal work) the whole prefill ran at 0.46 of the bf16 peak
with this path against 0.32 with the paged Triton kernel; at 16,384 tokens per step the Triton
kernel wins (0.555 against 0.529: FA2's Ampere-style kernel reaches ~180 TFLOP/s at head_dim 64
here, and the key gather costs ~7 ms of 260). So flash takes steps of at most
``MAX_FLASH_TOKENS`` query tokens. For such a step whose context is mostly its own tokens
(fresh prompts, long chunks) the keys and values are gathered from the paged cache into contiguous
[total_keys, Hkv, D] tensors once per layer (their bytes are small next to the attention's
arithmetic) and handed to ``aten._flash_attention_forward`` with cumulative lengths; causal
masking is bottom-right aligned, so chunks with earlier context and single-token rows in the
same step are right too. Everything else (decode steps, CUDA-graph replays, steps whose context
is mostly old tokens, fp32) stays on the Triton kernel.

If the flash op is missing or refuses the inputs once, the process stays on the Triton path (a
warning says why); ``ENABLED = False`` does the same on purpose (benchmarks compare both).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.models.attention import AttentionMetadata

logger = logging.getLogger(__name__)

ENABLED = True
_broken: str | None = None  # why the flash op failed in this process, if it did
FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
# Gathering costs bytes per context key; flash pays off when the keys are mostly this step's.
MAX_CONTEXT_PER_QUERY = 2
MAX_FLASH_TOKENS = 4096  # above it the Triton kernel's many tiles win (module docstring)


def applicable(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    return (
        ENABLED
        and _broken is None
        and meta.backend == "triton"
        and not meta.static_bounds
        and meta.max_query_len > 1
        and q.is_cuda
        and q.dtype in FLASH_DTYPES
        and q.shape[-1] <= MAX_HEAD_DIM
        and q.shape[0] <= MAX_FLASH_TOKENS
        and sum(meta.query_lens_cpu) == q.shape[0]
        and sum(meta.seq_lens_cpu) <= MAX_CONTEXT_PER_QUERY * q.shape[0]
    )


def _key_slots(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block id, offset) of every context key in request order, and cumulative key counts;
    computed by the first layer of a step, reused by the rest (the metadata caches it)."""
    cached = meta._flash_index
    if cached is not None:
        return cached
    dev = meta.seq_lens.device
    total = sum(meta.seq_lens_cpu)
    lens = meta.seq_lens.long()
    cu_k = torch.zeros(meta.batch_size + 1, dtype=torch.int32, device=dev)
    torch.cumsum(meta.seq_lens, 0, out=cu_k[1:])
    seq_ids = torch.repeat_interleave(torch.arange(meta.batch_size, device=dev), lens, output_size=total)
    pos = torch.arange(total, device=dev) - cu_k[seq_ids].long()
    blk = meta.block_tables[seq_ids, pos // meta.block_size].long()
    meta._flash_index = (blk, pos % meta.block_size, cu_k)
    return meta._flash_index


def attend(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor | None:
    """Causal attention like ``paged_attention.attend_cached``; None when this step is not for flash."""
    global _broken
    if not applicable(q, meta):
        return None
    blk, off, cu_k = _key_slots(meta)
    k = kv_cache[blk, 0, off]  # [total_keys, Hkv, D], contiguous
    v = kv_cache[blk, 1, off]
    try:
        out = torch.ops.aten._flash_attention_forward(
            q if q.stride(-1) == 1 else q.contiguous(),
            k,
            v,
            meta.query_start_loc,
            cu_k,
            meta.max_query_len,
            meta.max_seq_len,
            0.0,
            True,
            False,
            scale=scale,
        )[0]
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        _broken = f"{type(e).__name__}: {e}"
        logger.warning("flash prefill attention unavailable, using the Triton kernel: %s", _broken)
        return None
    return out
