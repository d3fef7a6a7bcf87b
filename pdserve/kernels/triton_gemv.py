"""Triton GEMV for decode steps of a few rows, with the layer's elementwise prologue fused in.

At batch 1 a decode step on an H100 / H200 is a chain of ~10 kernels a layer, and the four GEMMs
each pay a fixed cost (~4.9 us on the H200 even with the weight in L2, ``bench/gpu_gemv_l2.py``)
on top of their bytes; the norms and the SiLU * up between them are ~2 us launches that move a
few KiB. This kernel computes ``y = prologue(x) @ W^T`` for ``M <= MAX_ROWS`` rows in one launch:

    PROLOGUE 0  x as given
    PROLOGUE 1  x = rmsnorm(a + r) * g           the deferred residual add + RMSNorm; the program
                                                 of column tile 0 also writes a + r (the new
                                                 residual stream) to ``r_out``
    PROLOGUE 2  x = silu(gu[:, :K]) * gu[:, K:]  the MLP's activation, from the gate_up output

Grid: one program per ``BLOCK_N`` output columns; each walks K in ``BLOCK_K`` chunks, loading a
[BLOCK_N, BLOCK_K] weight tile (rows contiguous along K: ``nn.Linear``'s [out, in] layout) and the
rows' [M, BLOCK_K] inputs (a few KiB, from L2), and accumulates in fp32. For PROLOGUE 1 each
program first reads its rows once to get the inverse RMS (``M x K`` values, from L2).

Numerics: products and sums in fp32, rounded once to the output dtype, like cuBLAS' bf16 GEMMs;
the order of the additions differs, so a result can differ from ``F.linear`` by one rounding step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 8  # past it cuBLAS' tensor-core GEMMs win (and the register tile grows)

_NONE, _ADD_NORM, _SILU_MUL = 0, 1, 2


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] (PROLOGUE 0), a [M, K] (1), gu [M, 2K] (2)
    r_ptr,  # residual [M, K] (1)
    g_ptr,  # norm weight [K] (1)
    r_out_ptr,  # a + r [M, K] (1)
    w_ptr,  # [N, K]
    bias_ptr,
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_rm,
    stride_wn,
    stride_ym,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    n_ok = n < N
    m_ok = m < M
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]

    rstd = tl.zeros([BLOCK_M], tl.float32)
    if PROLOGUE == 1:
        r_rows = r_ptr + m.to(tl.int64)[:, None] * stride_rm
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            mk = m_ok[:, None] & (k < K)[None, :]
            a = tl.load(x_rows + k[None, :], mask=mk, other=0.0)
            h = a.to(tl.float32) + tl.load(r_rows + k[None, :], mask=mk, other=0.0).to(tl.float32)
            h = h.to(a.dtype).to(tl.float32)  # the norm reads the residual as stored
            ss += tl.sum(h * h, axis=1)
        rstd = tl.rsqrt(ss / K + eps)

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        mk = m_ok[:, None] & k_ok[None, :]
        if PROLOGUE == 0:
            x = tl.load(x_rows + k[None, :], mask=mk, other=0.0).to(tl.float32)
        elif PROLOGUE == 1:
            a = tl.load(x_rows + k[None, :], mask=mk, other=0.0)
            h = a.to(tl.float32) + tl.load(r_rows + k[None, :], mask=mk, other=0.0).to(tl.float32)
            hq = h.to(a.dtype)  # the residual stream is kept in the model's dtype
            if pid == 0:
                tl.store(r_out_ptr + m.to(tl.int64)[:, None] * stride_rm + k[None, :], hq, mask=mk)
            g = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            # rmsnorm rounds its output to the model's dtype before the GEMM reads it
            x = (hq.to(tl.float32) * rstd[:, None] * g[None, :]).to(a.dtype).to(tl.float32)
        else:
            gate = tl.load(x_rows + k[None, :], mask=mk, other=0.0)
            up = tl.load(x_rows + K + k[None, :], mask=mk, other=0.0).to(tl.float32)
            gf = gate.to(tl.float32)
            x = (gf * tl.sigmoid(gf) * up).to(gate.dtype).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def default_tiles(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [m, k] x [n, k]^T product (bench/gpu_gemv.py sweep)."""
    block_n = 4 if n * 4 <= 4096 * 4 and n <= 4096 else 8
    block_k = 512 if m <= 2 else 256
    return block_n, block_k, 4


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``prologue(x) @ weight^T (+ bias)`` for ``x`` of at most ``MAX_ROWS`` rows -> (y, r_out).

    With ``residual`` and ``norm_weight``: the prologue is rmsnorm(x + residual) * norm_weight and
    ``r_out`` = x + residual (a new tensor); with ``silu_mul``: x is [M, 2K] (gate | up) and the
    prologue silu(gate) * up. Otherwise the plain product and ``r_out`` None.
    """
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.stride(-1) == 1, (x.stride(), weight.stride())
    m = x.shape[0]
    n, k = weight.shape
    assert 1 <= m <= MAX_ROWS, m
    prologue = _NONE
    r_out = None
    r_arg, g_arg, r_out_arg = x, x, x  # unused pointers of the other prologues
    stride_rm = 0
    if residual is not None:
        assert norm_weight is not None and residual.shape == x.shape and residual.stride(-1) == 1
        assert x.shape[1] == k, (x.shape, weight.shape)
        prologue = _ADD_NORM
        r_out = torch.empty_like(residual)
        assert r_out.stride(0) == residual.stride(0) or m == 1
        r_arg, g_arg, r_out_arg, stride_rm = residual, norm_weight, r_out, residual.stride(0)
    elif silu_mul:
        assert x.shape[1] == 2 * k, (x.shape, weight.shape)
        prologue = _SILU_MUL
    else:
        assert x.shape[1] == k, (x.shape, weight.shape)
    # Under the CPU interpreter (tests) every program is a Python loop: few, wide ones.
    bn, bk, nw = default_tiles(m, n, k) if x.is_cuda else (64, 64, 4)
    block_n, block_k, num_warps = block_n or bn, block_k or bk, num_warps or nw
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n),)
    _gemv_kernel[grid](
        x,
        r_arg,
        g_arg,
        r_out_arg,
        weight,
        bias if bias is not None else weight,
        y,
        m,
        n,
        k,
        x.stride(0),
        stride_rm,
        weight.stride(0),
        y.stride(0),
        eps,
        PROLOGUE=prologue,
        HAS_BIAS=bias is not None,
        BLOCK_M=max(1, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages or 3,
    )
    return y, r_out
