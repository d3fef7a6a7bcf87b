"""Prefill attention of fresh prompts through cuDNN's fused attention (CUDA, fp16 / bf16).

Measured on the H200 (docs/benchmarks.md, "Prefill attention on the H200", 8 causal prompts of 2,000
tokens, Llama-1B shape, one layer): torch SDPA with the cuDNN backend on dense [B, H, S, D]
views 0.386 ms (340 TFLOP/s) against the paged Triton kernel's 0.614 ms (214) and FA2 varlen's
0.671 ms (196). cuDNN's *varlen* entry (``aten._cudnn_attention_forward`` with cumulative
lengths, also what nested tensors use) took 42-68 ms per call in torch 2.11: its execution plan
is rebuilt on every call, so it is not used. Dense calls are cached per shape, so each prompt is
one call on a [1, H, S, D] view, S padded up to a multiple of ``BUCKET`` (zero rows appended:
with the causal mask a real query never sees a key past itself, padded queries are dropped),
which bounds the plans to max_model_len / BUCKET.

A step's requests split in two:

    fresh rows   seq_len == query_len >= MIN_ROW_TOKENS: the whole context is this step's tokens
                 (a new prompt, or the first chunk of one). Their keys are their own tokens: the
                 rotary kernel writes the rotated keys to ``key_buffer``'s tensor besides the
                 cache (without it they are gathered back from the cache), values are this
                 step's v. Queries and keys have equal lengths: the causal mask needs no
                 alignment choice (cuDNN's is top-left, the engine's chunks need bottom-right).
    other rows   chunks after cached context, short prompts, decodes: the paged Triton kernel,
                 launched on just those rows (their block tables and lengths).

Steps with fewer than ``MIN_FRESH_TOKENS`` fresh tokens, CUDA-graph replays (static metadata),
fp32 and head dims cuDNN does not take stay wholly on the older paths (flash_prefill, Triton).
If cuDNN refuses the inputs once, the process stays off this path (a warning says why);
``ENABLED = False`` does the same on purpose (benchmarks compare paths).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pdserve.kernels.backend import small_to_device

if TYPE_CHECKING:
    from pdserve.models.attention import AttentionMetadata

logger = logging.getLogger(__name__)

# Off by default: this dense per-prompt form has not run on the GPU yet (the varlen form it
# replaces measured 0.037 of peak in the engine, docs/benchmarks.md); turn on after measuring.
ENABLED = False
_broken: str | None = None  # why the cuDNN op failed in this process, if it did
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128)  # what cuDNN's fused attention kernels take on Hopper, checked on the H200
MIN_FRESH_TOKENS = 1024  # fewer fresh tokens in a step: not worth the launches
MIN_ROW_TOKENS = 256  # a shorter fresh prompt goes with the other rows to the Triton kernel
BUCKET = 256  # each prompt is padded to a multiple of this: one cuDNN plan per bucket


def applicable(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    return (
        ENABLED
        and _broken is None
        and meta.backend == "triton"
        and not meta.static_bounds
        and meta.max_query_len >= MIN_ROW_TOKENS
        and q.is_cuda
        and q.dtype in DTYPES
        and q.shape[-1] in HEAD_DIMS
        and q.shape[0] >= MIN_FRESH_TOKENS
        and sum(meta.query_lens_cpu) == q.shape[0]
        and _plan(meta).num_fresh >= MIN_FRESH_TOKENS
    )


def key_buffer(q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
    """Where the rotary kernel should also write the rotated keys when this step goes to cuDNN
    (``kv_store.rotary_and_store_kv(k_out=...)``); None otherwise."""
    if not applicable(q, meta):
        return None
    return torch.empty(k.shape, dtype=k.dtype, device=k.device)


class _Plan:
    """What every layer of one step reuses (built by the first layer, kept on the metadata)."""

    def __init__(self, meta: AttentionMetadata) -> None:
        qlens, seqlens = meta.query_lens_cpu, meta.seq_lens_cpu
        start, self.fresh, other = 0, [], []  # fresh: (first token, tokens) per prompt
        for i, (q, s) in enumerate(zip(qlens, seqlens, strict=True)):
            if q == s and q >= MIN_ROW_TOKENS:
                self.fresh.append((start, q))
            elif q > 0:
                other.append(i)
            start += q
        self.num_fresh = sum(n for _, n in self.fresh)
        self.other = other
        if not other or self.num_fresh < MIN_FRESH_TOKENS:
            return
        dev = meta.slot_mapping.device
        o_rows = small_to_device(other, torch.long, dev)
        lens = [qlens[i] for i in other]
        self.other_tok = _tokens_of(meta, o_rows, lens)
        self.other_cu = _cumulative(lens, dev)
        self.other_max_q = max(lens)
        self.other_tables = meta.block_tables[o_rows]
        self.other_seq_lens = meta.seq_lens[o_rows]


def _cumulative(lens: list[int], dev: torch.device) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return small_to_device(out, torch.int32, dev)


def _tokens_of(meta: AttentionMetadata, rows: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """The step's token indices of ``rows``' queries, row after row."""
    total = sum(lens)
    dev = rows.device
    lens_t = small_to_device(lens, torch.long, dev)
    starts = meta.query_start_loc[rows].long()
    first = torch.cumsum(lens_t, 0) - lens_t  # where each row begins in the output
    shift = torch.repeat_interleave(starts - first, lens_t, output_size=total)
    return torch.arange(total, device=dev) + shift


def _plan(meta: AttentionMetadata) -> _Plan:
    plan = meta._dense_plan
    if plan is None:
        plan = meta._dense_plan = _Plan(meta)
    assert isinstance(plan, _Plan)
    return plan


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    """[s, heads, D] -> [1, heads, n, D] (zero rows appended; a view when nothing is added)."""
    if x.shape[0] != n:
        x = F.pad(x, (0, 0, 0, 0, 0, n - x.shape[0]))
    return x.unsqueeze(0).transpose(1, 2)


def _gathered_keys(kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's own K and V in token order, read back from the cache (callers that did not
    pass the rotated keys)."""
    blk, off = meta.slot_mapping // meta.block_size, meta.slot_mapping % meta.block_size
    return kv_cache[blk, 0, off], kv_cache[blk, 1, off]


def attend(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Causal attention like ``paged_attention.attend_cached``; None when this step is not for cuDNN.

    ``k``, ``v``: this step's rotated keys and its values, [n, Hkv, D] in token order (from
    ``key_buffer``); without them they are gathered from the cache."""
    global _broken
    if not applicable(q, meta):
        return None
    plan = _plan(meta)
    if k is None or v is None:
        k, v = _gathered_keys(kv_cache, meta)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for a, n in plan.fresh:
                padded = -(-n // BUCKET) * BUCKET  # queries past n and keys past n: never seen
                o = F.scaled_dot_product_attention(
                    _pad(q[a : a + n], padded),
                    _pad(k[a : a + n], padded),
                    _pad(v[a : a + n], padded),
                    is_causal=True,
                    scale=scale,
                    enable_gqa=q.shape[1] != k.shape[1],
                )  # [1, H, padded, D]
                out[a : a + n] = o[0, :, :n].transpose(0, 1)
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        _broken = f"{type(e).__name__}: {e}"
        logger.warning("cuDNN prefill attention unavailable, using the older paths: %s", _broken)
        return None
    if plan.other:
        from pdserve.kernels import triton_attention

        out[plan.other_tok] = triton_attention.paged_attention(
            q[plan.other_tok],
            kv_cache,
            plan.other_tables,
            plan.other_seq_lens,
            plan.other_cu,
            plan.other_max_q,
            scale,
            1,
        )
    return out
