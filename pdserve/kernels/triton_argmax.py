"""Triton row argmax over a wide last dim (the vocabulary), in two launches. Imported only by
``pdserve.kernels.argmax`` when the Triton path is taken (it imports triton).

torch's argmax gives a whole row to one block, so a step's [rows, 128k] logits (one row at
batch 1) use a handful of SMs. Here the row is cut into chunks of BLOCK values:

    _chunk_argmax_kernel   grid (rows, chunks): max and first index of its chunk -> partials
    _merge_argmax_kernel   grid (rows,):        the first chunk holding the row's max -> index

``masked_argmax_rows_fwd`` is the same with a grammar bitmask applied in the first launch (a
banned token counts as -inf; the logits are not written): a constrained greedy step's mask and
argmax in two launches, not three. Its bitmask and row map may be pinned host memory, read by
the kernel over the bus (no copy to queue; ``pdserve.kernels.argmax.host_operands_readable``).

Ties go to the lowest index, as in torch.argmax: within a chunk ``tl.argmax`` breaks ties to
the left, and across chunks the merge does too (chunks are in index order). Values compare in
fp32 (exact for bf16 / fp16). Padding lanes are -inf and sit after every real index, so they
never win a tie. No host reads: graph-safe.
"""

from __future__ import annotations

from collections.abc import Callable

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


@triton.jit
def _chunk_masked_argmax_kernel(
    x_ptr,
    val_ptr,
    idx_ptr,
    bitmask_ptr,
    map_ptr,
    n_cols,
    stride_row,
    num_chunks,
    words_per_row,
    HAS_MAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    if HAS_MAP:
        r = tl.load(map_ptr + row).to(tl.int64)  # this row's bitmask row; -1: not constrained
    else:
        r = row
    if r >= 0:
        words = chunk * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
        packed = tl.load(
            bitmask_ptr + r * words_per_row + words, mask=words < words_per_row, other=0
        )  # words past the bitmask's width: every token banned
        bits = (packed[:, None] >> tl.arange(0, 32)[None, :]) & 1  # [BLOCK / 32, 32]
        x = tl.where(tl.reshape(bits != 0, (BLOCK,)), x, float("-inf"))
    best = tl.max(x, 0)
    at = tl.argmax(x, 0, tie_break_left=True)
    tl.store(val_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, chunk * BLOCK + at)


def _two_pass(x: torch.Tensor, chunk_pass: Callable[[torch.Tensor, torch.Tensor, int], None]) -> torch.Tensor:
    """The partials' buffers, ``chunk_pass(vals, idxs, num_chunks)`` (the first launch), the merge."""
    rows, n = x.shape
    assert x.stride(1) == 1 and n > 0, f"x {tuple(x.shape)} strides {x.stride()}"
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(n, BLOCK)
    vals = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    idxs = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    chunk_pass(vals, idxs, chunks)
    _merge_argmax_kernel[(rows,)](
        vals, idxs, out, chunks, CHUNKS_PAD=triton.next_power_of_2(chunks), num_warps=1
    )
    return out


def masked_argmax_rows_fwd(
    x: torch.Tensor, bitmask: torch.Tensor, row_map: torch.Tensor | None
) -> torch.Tensor:
    """``argmax_rows_fwd`` of ``x`` with row i masked by bitmask row ``row_map[i]`` (-1: none;
    ``row_map`` None: row i by bitmask row i). ``x`` is not written."""
    assert bitmask.is_contiguous()

    def chunk_pass(vals: torch.Tensor, idxs: torch.Tensor, chunks: int) -> None:
        _chunk_masked_argmax_kernel[(x.shape[0], chunks)](
            x,
            vals,
            idxs,
            bitmask,
            row_map if row_map is not None else bitmask,  # unused without HAS_MAP
            x.shape[1],
            x.stride(0),
            chunks,
            bitmask.shape[1],
            HAS_MAP=row_map is not None,
            BLOCK=BLOCK,
            num_warps=8,
        )

    return _two_pass(x, chunk_pass)


def argmax_rows_fwd(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] (unit last stride) -> int64 [rows]: index of each row's first maximum."""

    def chunk_pass(vals: torch.Tensor, idxs: torch.Tensor, chunks: int) -> None:
        _chunk_argmax_kernel[(x.shape[0], chunks)](
            x, vals, idxs, x.shape[1], x.stride(0), chunks, BLOCK=BLOCK, num_warps=8
        )

    return _two_pass(x, chunk_pass)
