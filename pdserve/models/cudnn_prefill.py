"""Prefill attention of fresh prompts through cuDNN's fused attention (CUDA, fp16 / bf16).

Measured on the H200 (docs/benchmarks.md, "Issue 17, third session"): for 2k-token causal
prompts of the Llama-1B shape the paged Triton kernel reaches ~200-250 TFLOP/s, torch's FA2
~180-370, cuDNN's varlen kernel more (the table there). Attention was 0.17 of a prefill step's
GPU time at 16k tokens per step.

A step's requests split in two:

    fresh rows   seq_len == query_len: the whole context is this step's tokens (a new prompt, or
                 the first chunk of one). Their keys are exactly their query tokens, so K and V
                 are gathered from the cache at the step's own slots (``slot_mapping``, one
                 gather per layer, small next to the attention) and go with the queries to
                 ``aten._cudnn_attention_forward`` with cumulative lengths. Queries and keys have
                 equal lengths, so the causal mask needs no alignment choice.
    other rows   chunks after cached context, decodes: the paged Triton kernel, launched on
                 just those rows (their block tables and lengths).

Steps with fewer than ``MIN_FRESH_TOKENS`` fresh tokens, CUDA-graph replays (static metadata),
fp32 and head dims cuDNN does not take stay wholly on the older paths (flash_prefill, Triton).
If the cuDNN op is missing or refuses the inputs once, the process stays off this path (a
warning says why); ``ENABLED = False`` does the same on purpose (benchmarks compare paths).
``GQA``: pass the KV heads as they are (cuDNN supports grouped queries) or expanded to every
query head first.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.models.attention import AttentionMetadata

logger = logging.getLogger(__name__)

ENABLED = True
GQA = True  # hand cuDNN the KV heads as they are (False: repeat them to every query head)
_broken: str | None = None  # why the cuDNN op failed in this process, if it did
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128)  # what cuDNN's fused attention kernels take on Hopper, checked on the H200
MIN_FRESH_TOKENS = 1024  # below it a step is too small for the kernel's fixed cost to pay


def applicable(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    return (
        ENABLED
        and _broken is None
        and meta.backend == "triton"
        and not meta.static_bounds
        and meta.max_query_len > 1
        and q.is_cuda
        and q.dtype in DTYPES
        and q.shape[-1] in HEAD_DIMS
        and q.shape[0] >= MIN_FRESH_TOKENS
        and sum(meta.query_lens_cpu) == q.shape[0]
    )


class _Plan:
    """What every layer of one step reuses (built by the first layer, kept on the metadata)."""

    def __init__(self, meta: AttentionMetadata) -> None:
        qlens, seqlens = meta.query_lens_cpu, meta.seq_lens_cpu
        fresh = [i for i, (q, s) in enumerate(zip(qlens, seqlens, strict=True)) if q == s and q > 0]
        other = [i for i, (q, s) in enumerate(zip(qlens, seqlens, strict=True)) if q != s and q > 0]
        self.num_fresh = sum(qlens[i] for i in fresh)
        self.all_fresh = not other
        dev = meta.slot_mapping.device
        if self.num_fresh == 0:
            return
        self.max_fresh = max(qlens[i] for i in fresh)
        if self.all_fresh:
            self.fresh_tok: torch.Tensor | None = None
            self.cu = meta.query_start_loc
            slots = meta.slot_mapping
        else:
            rows = torch.tensor(fresh + other, dtype=torch.long, device=dev)
            f_rows, o_rows = rows[: len(fresh)], rows[len(fresh) :]
            self.fresh_tok = _tokens_of(meta, f_rows, [qlens[i] for i in fresh])
            self.other_tok = _tokens_of(meta, o_rows, [qlens[i] for i in other])
            self.cu = _cumulative([qlens[i] for i in fresh], dev)
            self.other_cu = _cumulative([qlens[i] for i in other], dev)
            self.other_max_q = max(qlens[i] for i in other)
            self.other_tables = meta.block_tables[o_rows]
            self.other_seq_lens = meta.seq_lens[o_rows]
            slots = meta.slot_mapping[self.fresh_tok]
        self.blk = slots // meta.block_size
        self.off = slots % meta.block_size


def _cumulative(lens: list[int], dev: torch.device) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=dev)


def _tokens_of(meta: AttentionMetadata, rows: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """The step's token indices of ``rows``' queries, row after row."""
    total = sum(lens)
    dev = rows.device
    lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
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


def _cudnn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_q: int, scale: float
) -> torch.Tensor:
    if not GQA and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu, cu, max_q, max_q, False, 0.0, True, False, scale=scale
    )[0]
    return out.view(q.shape)


def attend(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor | None:
    """Causal attention like ``attention.attend_cached``; None when this step is not for cuDNN."""
    global _broken
    if not applicable(q, meta):
        return None
    plan = _plan(meta)
    if plan.num_fresh < MIN_FRESH_TOKENS:
        return None
    q = q if q.is_contiguous() else q.contiguous()
    k = kv_cache[plan.blk, 0, plan.off]  # [fresh tokens, Hkv, D], contiguous
    v = kv_cache[plan.blk, 1, plan.off]
    try:
        if plan.all_fresh:
            return _cudnn(q, k, v, plan.cu, plan.max_fresh, scale)
        assert plan.fresh_tok is not None
        out = torch.empty_like(q)
        out[plan.fresh_tok] = _cudnn(q[plan.fresh_tok], k, v, plan.cu, plan.max_fresh, scale)
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        _broken = f"{type(e).__name__}: {e}"
        logger.warning("cuDNN prefill attention unavailable, using the older paths: %s", _broken)
        return None
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
