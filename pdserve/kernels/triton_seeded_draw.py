"""Exp(1) race draws for many seeded rows in one launch: a counter-based Philox stream per row.

A seeded request's draws for one sampled token are ``V`` values (one per vocabulary entry).
Here value ``v`` of the request's ``k``-th sampled token is Philox-4x32-10 (Triton's ``tl.rand``)
keyed by the request's seed at counter ``k * V + v``, turned into Exp(1) as ``-log(1 - u)``.
Nothing is carried from step to step: a node that continues another node's request (P/D, a
recompute) draws the same values by computing ``k`` from the request's length, without skipping
earlier draws, and every seeded row of a step goes in one launch instead of one generator call
each.

Grid: axis 0 = the seeded rows, axis 1 = blocks of ``BLOCK`` vocabulary entries.

``exponential_draw`` is the stream itself, one ``@triton.jit`` helper: the fused sampling kernel
(``kernels/triton_sample.py``) calls it too, so a seeded row draws the same values there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def exponential_draw(seed, counters):
    """Exp(1) draws of Philox-4x32-10 keyed by ``seed`` (int64) at ``counters`` (int64):
    ``-log(1 - u)``, u the first word in [0, 1); 1 - u is in (0, 1], so a draw can be 0."""
    u = tl.rand(seed, counters)
    return -tl.log(1.0 - u)


@triton.jit
def _seeded_exponential_kernel(
    q_ptr, q_row_stride, rows_ptr, seeds_ptr, counters_ptr, n_cols, BLOCK: tl.constexpr
):
    j = tl.program_id(0)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    row = tl.load(rows_ptr + j)
    seed = tl.load(seeds_ptr + j)
    counter = tl.load(counters_ptr + j)  # k * V: the first counter of this row's draws
    e = exponential_draw(seed, counter + offs)
    tl.store(q_ptr + row * q_row_stride + offs, e, mask=mask)


def seeded_exponential_(
    q: torch.Tensor, rows: torch.Tensor, seeds: torch.Tensor, draw_indices: torch.Tensor
) -> None:
    """Overwrite rows ``rows`` of ``q`` [S, V] (float32, unit stride along V) with Exp(1) draws:
    row ``rows[j]`` gets the ``draw_indices[j]``-th block of V draws of seed ``seeds[j]``.
    ``rows``, ``seeds`` and ``draw_indices`` are int64 tensors on ``q``'s device, one entry per
    seeded row (any strides)."""
    assert q.dim() == 2 and q.dtype == torch.float32 and q.stride(1) == 1, (q.shape, q.dtype, q.stride())
    num = rows.numel()
    if num == 0:
        return
    n_cols = q.shape[1]
    # The kernel indexes each vector as a contiguous int64 array: the sampler passes the columns
    # of one [R, 3] table (strided views), so make them contiguous (a few bytes each).
    rows, seeds = rows.contiguous(), seeds.contiguous()
    counters = (draw_indices * n_cols).contiguous()
    grid = (num, triton.cdiv(n_cols, BLOCK))
    _seeded_exponential_kernel[grid](q, q.stride(0), rows, seeds, counters, n_cols, BLOCK=BLOCK)
