"""Triton RMSNorm kernels vs their torch twins, and the dispatch predicate.

Without a GPU the kernels run under TRITON_INTERPRET=1 (~200x slower than torch), so shapes
stay tiny; the CUDA-only sweep at the bottom covers realistic sizes.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdserve import kernels
from pdserve.errors import ConfigError, UnsupportedError
from pdserve.kernels import (
    fused_add_rms_norm,
    fused_add_rms_norm_torch,
    gated_rms_norm,
    gated_rms_norm_torch,
    rms_norm,
    rms_norm_torch,
)

EPS = 1e-6
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _weight(hidden: int, device: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn(hidden, device=device)).to(dtype)


def _strided_rows(rows: int, hidden: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """[rows, hidden] view into a wider buffer: row stride 2*hidden+3, offset 1."""
    big = torch.randn(rows, 2 * hidden + 3, device=device, dtype=dtype)
    x = big[:, 1 : hidden + 1]
    assert rows == 1 or not x.is_contiguous()
    return x


# ----------------------------------------------------------------------------- Triton vs twin

SHAPES = [(1, 33), (5, 100), (2, 3, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_matches_twin(force_triton, device, shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, device=device, dtype=dtype)
    w = _weight(shape[-1], device, dtype)
    _close(rms_norm(x, w, EPS), rms_norm_torch(x, w, EPS))


def test_rms_norm_strided_and_transposed_rows(force_triton, device):
    torch.manual_seed(0)
    w = _weight(33, device)
    x = _strided_rows(4, 33, device, torch.float32)
    _close(rms_norm(x, w, EPS), rms_norm_torch(x, w, EPS))
    xt = torch.randn(33, 3, device=device).t()  # column stride != 1: wrapper gets a copy
    _close(rms_norm(xt, w, EPS), rms_norm_torch(xt, w, EPS))


def test_rms_norm_fp32_weight_with_bf16_input(force_triton, device):
    x = torch.randn(3, 100, device=device, dtype=torch.bfloat16)
    w = _weight(100, device, torch.float32)
    _close(rms_norm(x, w, EPS), rms_norm_torch(x, w, EPS))


def test_zero_rows(force_triton, device):
    x = torch.empty(0, 64, device=device)
    w = _weight(64, device)
    assert rms_norm(x, w, EPS).shape == (0, 64)
    normed, res = fused_add_rms_norm(x, x, w, EPS)
    assert normed.shape == res.shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 33), (6, 100)])
def test_fused_add_rms_norm(force_triton, device, rows, hidden, dtype):
    torch.manual_seed(0)
    x = _strided_rows(rows, hidden, device, dtype)
    residual = torch.randn(rows, hidden, device=device, dtype=dtype)
    w = _weight(hidden, device, dtype)
    x_before, res_before = x.clone(), residual.clone()

    normed, new_residual = fused_add_rms_norm(x, residual, w, EPS)

    assert torch.equal(x, x_before) and torch.equal(residual, res_before), "inputs were mutated"
    expected_res = (x.float() + residual.float()).to(dtype)
    ref_normed, ref_res = fused_add_rms_norm_torch(x, residual, w, EPS)
    assert torch.equal(ref_res, expected_res)
    if dtype == torch.float32 or device == "cuda":
        assert torch.equal(new_residual, expected_res)
    else:  # the interpreter truncates fp32 -> bf16 instead of rounding to nearest: 1 ulp off
        _close(new_residual, expected_res)
    _close(normed, ref_normed)
    _close(normed, rms_norm_torch(new_residual, w, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_gated_rms_norm(force_triton, device, activation, norm_before_gate, dtype):
    torch.manual_seed(0)
    rows, hidden = 3, 100
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    z = _strided_rows(rows, hidden, device, dtype)
    w = _weight(hidden, device, dtype)
    out = gated_rms_norm(x, z, w, EPS, activation=activation, norm_before_gate=norm_before_gate)
    ref = gated_rms_norm_torch(x, z, w, EPS, activation=activation, norm_before_gate=norm_before_gate)
    _close(out, ref)


def test_gated_twin_formulas():
    """The twin's two gate orders are what the docstring says (hand-written fp32 reference)."""
    torch.manual_seed(0)
    x, z, w = torch.randn(2, 33), torch.randn(2, 33), _weight(33, "cpu")

    def norm(t):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + EPS)

    silu = z * torch.sigmoid(z)
    _close(gated_rms_norm_torch(x, z, w, EPS, "silu", True), norm(x) * w * silu)
    _close(gated_rms_norm_torch(x, z, w, EPS, "silu", False), norm(x * silu) * w)
    _close(gated_rms_norm_torch(x, z, w, EPS, "sigmoid", True), norm(x) * w * torch.sigmoid(z))


# ----------------------------------------------------------------------------- dispatch


def test_cpu_defaults_to_torch_without_importing_triton():
    code = (
        "import sys, torch; from pdserve import kernels as k\n"
        "x = torch.randn(2, 8); w = torch.ones(8)\n"
        "k.rms_norm(x, w, 1e-6); k.fused_add_rms_norm(x, x, w, 1e-6); k.gated_rms_norm(x, x, w, 1e-6)\n"
        "assert k.get_backend() == 'auto'\n"
        "assert 'triton' not in sys.modules, 'CPU path imported triton'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_predicate(monkeypatch):
    x = torch.randn(2, 64)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kernels.triton_can_run(x, 64)
    assert "TRITON_INTERPRET" in kernels.triton_unsupported_reason(x, 64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.triton_can_run(x, 64, torch.ones(64))
    assert not kernels.triton_can_run(x.double(), 64)
    assert not kernels.triton_can_run(x, 64, torch.ones(64, dtype=torch.float64))
    assert not kernels.triton_can_run(x, kernels.MAX_HIDDEN + 1)


def test_auto_on_cpu_runs_twin_even_with_interpreter(monkeypatch):
    """TRITON_INTERPRET alone does not switch the CPU path; only an explicit force does."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(2, 8, dtype=torch.float64)  # unsupported by Triton, fine for the twin
    assert kernels.get_backend() == "auto"
    w = torch.ones(8, dtype=torch.float64)
    torch.testing.assert_close(rms_norm(x, w, EPS), rms_norm_torch(x, w, EPS))


def test_forced_triton_unsupported_raises(force_triton, device):
    w64 = torch.ones(8, device=device, dtype=torch.float64)
    with pytest.raises(UnsupportedError, match="float64"):
        rms_norm(torch.randn(2, 8, device=device, dtype=torch.float64), w64, EPS)
    hidden = kernels.MAX_HIDDEN + 1
    with pytest.raises(UnsupportedError, match="hidden size"):
        x = torch.randn(1, hidden, device=device)
        gated_rms_norm(x, x, torch.ones(hidden, device=device), EPS)
    with pytest.raises(UnsupportedError, match="activation"):
        x = torch.randn(1, 8, device=device)
        gated_rms_norm(x, x, torch.ones(8, device=device), EPS, activation="gelu")


def test_forced_triton_on_cpu_without_interpreter_raises(force_triton, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("only meaningful without CUDA")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UnsupportedError, match="TRITON_INTERPRET"):
        rms_norm(torch.randn(2, 8), torch.ones(8), EPS)


def test_forced_triton_calls_the_kernel_wrapper(force_triton, device, monkeypatch):
    from pdserve.kernels import triton_rmsnorm

    calls = []
    real = triton_rmsnorm.gated_rms_norm_fwd

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(triton_rmsnorm, "gated_rms_norm_fwd", spy)
    x = torch.randn(2, 3, 16, device=device)
    gated_rms_norm(x, x, torch.ones(16, device=device), EPS)
    assert calls == [(6, 16)]


def test_set_backend_validates_and_restores():
    with pytest.raises(ConfigError, match="bogus"):
        kernels.set_backend("bogus")  # type: ignore[arg-type]
    with kernels.use_backend("torch"):
        assert kernels.get_backend() == "torch"
    assert kernels.get_backend() == "auto"


# ----------------------------------------------------------------------------- CUDA only


@pytest.mark.gpu
@gpu
def test_cuda_auto_picks_triton_and_raises_on_unsupported():
    x = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
    w = _weight(128, "cuda", torch.bfloat16)
    assert kernels.triton_can_run(x, 128, w)
    _close(rms_norm(x, w, EPS), rms_norm_torch(x, w, EPS))
    with pytest.raises(UnsupportedError, match="float64"):
        rms_norm(x.double(), w.double(), EPS)
    big = kernels.MAX_HIDDEN * 2
    with pytest.raises(UnsupportedError, match="hidden size"):
        rms_norm(torch.randn(1, big, device="cuda"), torch.ones(big, device="cuda"), EPS)
    with kernels.use_backend("torch"):
        _close(rms_norm(x.double(), w.double(), EPS), rms_norm_torch(x.double(), w.double(), EPS))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", ["rms", "fused_add", "gated_before", "gated_after"])
def test_cuda_size_sweep(kernel, dtype):
    torch.manual_seed(0)
    for hidden in (128, 1000, 2048, 4096, 5120, 8192):
        for rows in (1, 7, 256, 4096):
            x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
            y = torch.randn(rows, hidden, device="cuda", dtype=dtype)
            w = _weight(hidden, "cuda", dtype)
            if kernel == "rms":
                _close(rms_norm(x, w, EPS), rms_norm_torch(x, w, EPS))
            elif kernel == "fused_add":
                normed, res = fused_add_rms_norm(x, y, w, EPS)
                ref_normed, ref_res = fused_add_rms_norm_torch(x, y, w, EPS)
                assert torch.equal(res, ref_res)
                _close(normed, ref_normed)
            else:
                before = kernel == "gated_before"
                for act in ("silu", "sigmoid"):
                    out = gated_rms_norm(x, y, w, EPS, act, before)
                    _close(out, gated_rms_norm_torch(x, y, w, EPS, act, before))


@pytest.mark.parametrize("hidden", [64, 128, 576, 2048, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cpu_fused_norm_equals_the_formula_bit_for_bit(hidden: int, dtype: torch.dtype) -> None:
    """The CPU twin takes torch's fused kernel when there is one: the same bits as the op-by-op
    formula (which the fp32 path's token identity with transformers rests on)."""
    from pdserve.kernels import rmsnorm

    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(67, hidden, generator=gen) * 3).to(dtype)
    w = torch.randn(hidden, generator=gen).to(dtype)
    if rmsnorm._FUSED_RMS_NORM is None:
        pytest.skip("this torch has no _fused_rms_norm")
    got = rmsnorm.rms_norm_torch(x, w, 1e-6)
    assert torch.equal(got, rmsnorm.rms_norm_formula(x, w, 1e-6))
    assert torch.equal(rmsnorm.rms_norm_torch(x[:1], w, 1e-5), rmsnorm.rms_norm_formula(x[:1], w, 1e-5))
