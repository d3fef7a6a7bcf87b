"""Triton row argmax over a wide last dim (the vocabulary), in two launches. Imported only by
``pdserve.kernels.argmax`` when the Triton path is taken (it imports triton).

torch's argmax gives a whole row to one block, so a step's [rows, 128k] logits (one row at
batch 1) use a handful of SMs. Here the row is cut into chunks of BLOCK values:

    _chunk_argmax_kernel   grid (rows, chunks): max and first index of its chunk -> partials
    _merge_argmax_kernel   grid (rows,):        the first chunk holding the row's max -> index

Ties go to the lowest index, as in torch.argmax: within a chunk ``tl.argmax`` breaks ties to
the left, and across chunks the merge does too (chunks are in index order). Values compare in
fp32 (exact for bf16 / fp16). Padding lanes are -inf and sit after every real index, so they
never win a tie. No host reads: graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _chunk_argmax_kernel(x_ptr, val_ptr, idx_ptr, n_cols, stride_row, num_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    best = tl.max(x, 0)
    at = tl.argmax(x, 0, tie_break_left=True)
    tl.store(val_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, chunk * BLOCK + at)


@triton.jit
def _merge_argmax_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    valid = c < num_chunks
    v = tl.load(val_ptr + row * num_chunks + c, mask=valid, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_chunks + c, mask=valid, other=0)
    first = tl.argmax(v, 0, tie_break_left=True)  # the lowest chunk holding the max
    tl.store(out_ptr + row, tl.sum(tl.where(c == first, i, 0), 0).to(tl.int64))


def argmax_rows_fwd(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] (unit last stride) -> int64 [rows]: index of each row's first maximum."""
    rows, n = x.shape
    assert x.stride(1) == 1 and n > 0, f"x {tuple(x.shape)} strides {x.stride()}"
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(n, BLOCK)
    vals = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    idxs = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    _chunk_argmax_kernel[(rows, chunks)](x, vals, idxs, n, x.stride(0), chunks, BLOCK=BLOCK, num_warps=8)
    _merge_argmax_kernel[(rows,)](
        vals, idxs, out, chunks, CHUNKS_PAD=triton.next_power_of_2(chunks), num_warps=1
    )
    return out
