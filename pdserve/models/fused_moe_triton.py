"""Triton grouped GEMM of the fused MoE (``fused_moe.moe_gemm``'s kernel; vLLM's layout).

Assignments are sorted by id and each id's run padded to a multiple of BLOCK_M, so a program's
BLOCK_M rows share one weight matrix:

    sorted_rows  [num_blocks * BLOCK_M]  assignment index per padded position, -1 = padding
    block_ids    [num_blocks]            the id (expert, or slot * E + expert) of each block, -1 = none

One program per (block of rows, block of N): acc = x[src[rows]] @ w[id].T over K in BLOCK_K
steps, fp32 accumulation (IEEE products for fp32 inputs), stored at the assignments' rows.
The number of blocks is bounded from the sizes (no device-to-host sync): T / BLOCK_M + E.
Imported only when the Triton path is taken.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _moe_gemm_kernel(
    x_ptr, w_ptr, out_ptr, rows_ptr, block_ids_ptr, src_ptr, N, K,
    stride_xm, stride_we, stride_wn, stride_om,
    HAS_SRC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_ids_ptr + pid_m)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + offs_m)  # assignment index, -1 = padding
    mask_m = rows >= 0
    if HAS_SRC:
        xrow = tl.load(src_ptr + rows, mask=mask_m, other=0)
    else:
        xrow = tl.where(mask_m, rows, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            x_ptr + xrow[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & (offs_k[None, :] < K),
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        b = tl.load(
            w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, b, input_precision=PRECISION)
    out = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_n[None, :] < N))


def align_block_size(ids: torch.Tensor, num_ids: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_rows, block_ids) for ``ids`` [T] in [-1, num_ids): each id's assignments in
    order, padded to ``block_m``; unused positions and blocks are -1. Only device ops of
    fixed-size results (no bincount, no boolean indexing): no sync, CUDA-graph safe."""
    t = ids.shape[0]
    dev = ids.device
    key = torch.where(ids >= 0, ids, num_ids)  # -1 sorts last, as id num_ids
    counts = torch.zeros(num_ids + 1, dtype=torch.int64, device=dev)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_ids]  # [num_ids]
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)  # [num_ids]
    padded_start = (block_end - blocks) * block_m
    group_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)  # [T]
    sorted_key = key[order]
    safe = sorted_key.clamp(max=num_ids - 1)
    max_blocks = (t + block_m - 1) // block_m + num_ids
    trash = max_blocks * block_m  # where the -1 assignments are written (cut off below)
    dest = torch.where(
        sorted_key < num_ids, padded_start[safe] + torch.arange(t, device=dev) - group_start[safe], trash
    )
    sorted_rows = torch.full((trash + 1,), -1, dtype=torch.int64, device=dev)
    sorted_rows = sorted_rows.scatter_(0, dest, order)[:trash]
    block_ids = torch.searchsorted(block_end, torch.arange(max_blocks, device=dev), right=True)
    block_ids = torch.where(block_ids < num_ids, block_ids, -1)
    return sorted_rows, block_ids


def moe_gemm(
    x: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # [E, N, K]
    ids: torch.Tensor,  # [T]
    src: torch.Tensor | None = None,  # [T]
) -> torch.Tensor:
    """[T, N]: row i = x[src[i]] @ w[ids[i]].T (0 where ids[i] < 0); see fused_moe.moe_gemm."""
    assert x.dim() == 2 and w.dim() == 3 and x.shape[1] == w.shape[2], (tuple(x.shape), tuple(w.shape))
    assert x.stride(1) == 1 and w.stride(2) == 1 and x.dtype == w.dtype, (x.stride(), w.stride(), x.dtype)
    assert src is None or src.shape == ids.shape, (
        tuple(ids.shape),
        None if src is None else tuple(src.shape),
    )
    num_ids, n, k = w.shape
    t = ids.shape[0]
    out = torch.zeros(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    sorted_rows, block_ids = align_block_size(ids.to(torch.int64), num_ids, BLOCK_M)
    grid = (block_ids.shape[0], triton.cdiv(n, BLOCK_N))
    _moe_gemm_kernel[grid](
        x, w, out, sorted_rows, block_ids, src if src is not None else sorted_rows, n, k,
        x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        HAS_SRC=src is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out
