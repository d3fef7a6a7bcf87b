"""Triton in-place grammar mask (imported only by ``pdserve.kernels.bitmask`` on the Triton path).

Grid (k, ceil(V / BLOCK)): program (r, c) loads the BLOCK / 32 words of bitmask row r that cover
vocabulary chunk c, expands them to BLOCK bits and stores -inf into logits row ``rows[r]`` where a
bit is 0 (or lies past the bitmask's width). Allowed tokens are not touched (no read of the logits at all). No host reads: the row
indices stay on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    vocab,
    logits_stride,
    words_per_row,
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    chunk = tl.program_id(1)
    if HAS_ROWS:
        row = tl.load(rows_ptr + r).to(tl.int64)
    else:
        row = r.to(tl.int64)
    words = chunk * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    packed = tl.load(
        bitmask_ptr + r.to(tl.int64) * words_per_row + words, mask=words < words_per_row, other=0
    )  # words past the bitmask's width: every token banned
    bits = (packed[:, None] >> tl.arange(0, 32)[None, :]) & 1  # [BLOCK / 32, 32]
    banned = tl.reshape(bits == 0, (BLOCK,))
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    tl.store(logits_ptr + row * logits_stride + cols, float("-inf"), mask=banned & (cols < vocab))


def apply_token_bitmask_fwd(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    k, vocab = bitmask.shape[0], logits.shape[1]
    assert logits.stride(1) == 1 and bitmask.is_contiguous() and bitmask.dtype == torch.int32
    grid = (k, triton.cdiv(vocab, BLOCK))
    _bitmask_kernel[grid](
        logits,
        bitmask,
        rows if rows is not None else bitmask,  # unused without HAS_ROWS
        vocab,
        logits.stride(0),
        bitmask.shape[1],
        HAS_ROWS=rows is not None,
        BLOCK=BLOCK,
    )
