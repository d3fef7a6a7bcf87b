"""Triton silu_and_mul vs its torch twin (the former llama.py expression), and dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve import kernels
from pdserve.errors import UnsupportedError
from pdserve.kernels import silu_and_mul, silu_and_mul_torch

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2), (5, 200), (3, 2, 66), (2, 2100)], ids=str)
def test_silu_and_mul_matches_twin(force_triton, device, shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, device=device, dtype=dtype)
    before = x.clone()
    out = silu_and_mul(x)
    assert torch.equal(x, before), "input was written"
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.is_contiguous()
    _close(out, silu_and_mul_torch(x))


def test_silu_and_mul_strided_rows(force_triton, device):
    """Rows of a wider buffer (row stride != 2*I), and a column-strided input (copied)."""
    torch.manual_seed(0)
    big = torch.randn(4, 2 * 50 + 7, device=device)
    x = big[:, 3 : 3 + 100]
    assert not x.is_contiguous()
    _close(silu_and_mul(x), silu_and_mul_torch(x))
    xt = torch.randn(100, 3, device=device).t()
    _close(silu_and_mul(xt), silu_and_mul_torch(xt))


def test_zero_rows(force_triton, device):
    assert silu_and_mul(torch.empty(0, 64, device=device)).shape == (0, 32)


def test_twin_is_the_former_expression():
    torch.manual_seed(0)
    x = torch.randn(3, 40)
    gate, up = x.split(20, dim=-1)
    assert torch.equal(silu_and_mul_torch(x), F.silu(gate) * up)


def test_predicate_and_forced_raise(force_triton, device, monkeypatch):
    with pytest.raises(UnsupportedError, match="float64"):
        silu_and_mul(torch.randn(2, 8, device=device, dtype=torch.float64))
    with pytest.raises(UnsupportedError, match="2\\*I"):
        silu_and_mul(torch.randn(2, 7, device=device))
    assert kernels.silu_and_mul_can_run(torch.randn(2, 8, device=device))
    if device == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        assert "TRITON_INTERPRET" in kernels.silu_and_mul_unsupported_reason(torch.randn(2, 8))
        with pytest.raises(UnsupportedError, match="TRITON_INTERPRET"):
            silu_and_mul(torch.randn(2, 8))


def test_auto_on_cpu_runs_twin(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(2, 8, dtype=torch.float64)  # unsupported by Triton, fine for the twin
    assert kernels.get_backend() == "auto"
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_torch(x))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_size_sweep(dtype):
    torch.manual_seed(0)
    for inter in (1000, 2816, 8192, 14336):
        for rows in (1, 7, 256, 4096):
            x = torch.randn(rows, 2 * inter, device="cuda", dtype=dtype)
            out = silu_and_mul(x)
            ref = silu_and_mul_torch(x.float()).to(dtype)  # one rounding, as the kernel
            _close(out, ref)
            _close(out, silu_and_mul_torch(x))


@pytest.mark.gpu
@gpu
def test_cuda_graph_replay():
    x = torch.randn(64, 2 * 8192, device="cuda", dtype=torch.bfloat16)
    silu_and_mul(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_and_mul(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    _close(out, silu_and_mul_torch(x.float()).bfloat16())
