"""The exponential race of sampled rows in one pass over the vocabulary (two launches in all).

Row r of ``x`` [R, V] comes with a row of an int64 table [R, 3] (``race_table_row``):

    (seed, k, temperature)   temperature > 0: token = argmax_v  x[r, v] / T - log q_v,
                                              q_v = Exp(1) draw v of (seed, k)
                             temperature 0:   token = argmax_v  x[r, v]   (no draws)

The temperature travels as its float32 bit pattern. ``q_v`` is ``triton_seeded_draw``'s
counter-based stream, the same ``@triton.jit`` helper (Philox-4x32-10 keyed by ``seed`` at
counter ``k * V + v``, ``-log(1 - u)``), clamped to the smallest normal float32 so that log q
stays finite and a -inf logit is never drawn. The division is IEEE round-to-nearest
(``div_rn``), as torch's: ``x / T`` here equals a row that torch divided before, so a row
raced here with its temperature and a row torch divided and that is raced here with T = 1
(after top-k / top-p, say) compute the same values. Softmax is never formed: argmax(x / T -
log q) is a sample of softmax(x / T) (the race in ``pdserve.engine.sampler``).

    _race_chunk_kernel   grid (rows, chunks): each program reads BLOCK logits of one row once,
                         divides, draws, and writes its chunk's (max, first index)
    merge                ``triton_argmax``'s merge: per row, the first chunk holding the max

BLOCK is ``triton_argmax``'s (4,096), or the vocabulary rounded up to a power of two when smaller.

Ties go to the lowest index (within a chunk ``tl.argmax`` breaks them to the left, the merge
picks the first chunk). No host reads: safe in a CUDA graph and under asynchronous scheduling.
"""

from __future__ import annotations

import functools
import struct

import torch
import triton
import triton.language as tl

from pdserve.kernels.backend import TRITON_DTYPES
from pdserve.kernels.triton_argmax import BLOCK, _merge_argmax_kernel
from pdserve.kernels.triton_seeded_draw import exponential_draw

TABLE_COLS = 3  # seed, k, temperature's float32 bits


@triton.jit
def _race_chunk_kernel(
    x_ptr, table_ptr, val_ptr, idx_ptr, n_cols, stride_row, num_chunks, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = cols < n_cols
    x = tl.load(x_ptr + row * stride_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
    temperature = tl.load(table_ptr + row * 3 + 2).to(tl.int32).to(tl.float32, bitcast=True)
    if temperature > 0.0:
        seed = tl.load(table_ptr + row * 3)
        k = tl.load(table_ptr + row * 3 + 1)
        q = tl.maximum(exponential_draw(seed, k * n_cols + cols), 1.1754943508222875e-38)
        x = tl.where(valid, tl.math.div_rn(x, temperature) - tl.log(q), float("-inf"))
    best = tl.max(x, 0)
    at = tl.argmax(x, 0, tie_break_left=True)
    tl.store(val_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, chunk * BLOCK + at)


@functools.lru_cache(maxsize=256)
def _f32_bits(value: float) -> int:
    return int(struct.unpack("<i", struct.pack("<f", value))[0])


def race_table_row(seed: int, k: int, temperature: float) -> list[int]:
    """A row's table entry: draws (seed, k) at ``temperature`` (0: the plain argmax)."""
    assert 0.0 <= temperature, temperature
    return [seed, k, _f32_bits(temperature)]


def race_rows(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """int64 [R]: row r's token per ``table`` row r (module docstring). ``x`` [R, V] float32,
    bf16 or fp16 (widened to fp32 on load: exact), unit stride along V; ``table`` int64 [R, 3],
    contiguous, on ``x``'s device."""
    assert x.dim() == 2 and x.dtype in TRITON_DTYPES and x.stride(1) == 1, (x.shape, x.dtype, x.stride())
    assert table.shape == (x.shape[0], TABLE_COLS) and table.dtype == torch.int64, (table.shape, table.dtype)
    assert table.is_contiguous() and table.device == x.device, (table.stride(), table.device, x.device)

    rows, n_cols = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(n_cols))  # small vocabularies: one narrow chunk
    chunks = triton.cdiv(n_cols, block)
    vals = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    idxs = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    _race_chunk_kernel[(rows, chunks)](
        x, table, vals, idxs, n_cols, x.stride(0), chunks, BLOCK=block, num_warps=8 if block >= 1024 else 4
    )
    _merge_argmax_kernel[(rows,)](
        vals, idxs, out, chunks, CHUNKS_PAD=triton.next_power_of_2(chunks), num_warps=1
    )
    return out
