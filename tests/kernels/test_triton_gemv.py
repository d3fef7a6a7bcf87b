"""kernels/triton_gemv.py: the few-row GEMV with its fused prologues (add + RMSNorm, SiLU * up)
against the separate kernels and ``F.linear`` they replace. CPU runs use TRITON_INTERPRET=1
(tests/kernels/conftest.py), whose bf16 casts truncate: exactness is checked in float32, bf16
within a rounding step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import fused_add_rms_norm, silu_and_mul

triton_gemv = pytest.importorskip("pdserve.kernels.triton_gemv", reason="triton is not installed")
gemv, MAX_ROWS = triton_gemv.gemv, triton_gemv.MAX_ROWS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_prologues_match_the_kernels_they_replace(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    k, n = 96, 40  # K not a multiple of BLOCK_K, N not of BLOCK_N: the masks
    x = torch.randn(rows, k, generator=g).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * 0.1).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE)
    res = torch.randn(rows, k, generator=g).to(DEVICE)
    nw = torch.randn(k, generator=g).to(DEVICE)
    gu = torch.randn(rows, 2 * k, generator=g).to(DEVICE)
    tiles = {"block_n": 8, "block_k": 32}

    y, r_out = gemv(x, w, b, **tiles)
    assert r_out is None
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)

    y, r_out = gemv(x, w, residual=res, norm_weight=nw, eps=1e-5, **tiles)
    h, r_ref = fused_add_rms_norm(x, res, nw, 1e-5)
    assert r_out is not None
    torch.testing.assert_close(r_out, r_ref, rtol=0, atol=0)  # every column tile, written once
    torch.testing.assert_close(y, F.linear(h, w), rtol=1e-5, atol=1e-5)

    y, _ = gemv(gu, w, silu_mul=True, **tiles)
    torch.testing.assert_close(y, F.linear(silu_and_mul(gu), w), rtol=1e-5, atol=1e-5)


def test_bf16_within_a_rounding_step_and_strided_rows() -> None:
    g = torch.Generator().manual_seed(7)
    k, n = 128, 24
    x = torch.randn(4, 2 * k, generator=g).to(DEVICE, torch.bfloat16)[:, :k]  # row stride 2K
    w = (torch.randn(n, k, generator=g) * 0.1).to(DEVICE, torch.bfloat16)
    y, _ = gemv(x, w, block_n=4, block_k=64)
    assert y.dtype == torch.bfloat16 and y.shape == (4, n)
    ref = F.linear(x.float(), w.float())
    assert (y.float() - ref).abs().max().item() <= 2**-7 * ref.abs().max().item() + 1e-3
