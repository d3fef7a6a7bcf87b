"""models/linear.py: the CPU routes of half-precision layers (the small-GEMM fp32 copy, the
packed bf16 weights of kernels.cpu_gemm)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_gemm, cpu_native
from pdserve.models import linear as L
from pdserve.models.loader import load_model


def _layer(in_f: int, out_f: int, dtype: torch.dtype, bias: bool = True) -> L.Linear:
    gen = torch.Generator().manual_seed(in_f * 1000 + out_f)
    m = L.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        m.weight.copy_(torch.randn(out_f, in_f, generator=gen) * 0.1)
        if bias:
            m.bias.copy_(torch.randn(out_f, generator=gen))
    return m.to(dtype).requires_grad_(False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_calls_compute_in_fp32_and_round_once(dtype: torch.dtype) -> None:
    m = _layer(128, 384, dtype)
    assert L.prepare_small_gemms(m) == 1
    m.weight_packed = None  # the fp32 route on its own (the packed one: the tests below)
    assert m.weight_fp32 is not None and m.weight_fp32.dtype == torch.float32
    assert m.bias_fp32 is not None and torch.equal(m.bias_fp32, m.bias.float())
    x = torch.randn(L.SMALL_GEMM_MAX_ROWS, 128).to(dtype)
    want = F.linear(x.double(), m.weight.double(), m.bias.double())  # exact products and sums
    got = m(x)
    assert got.dtype == dtype
    assert torch.equal(got, F.linear(x.float(), m.weight.float(), m.bias.float()).to(dtype))
    # one rounding of an fp32 sum: within half a step of the exact result (plus the fp32 sum's own
    # error, relative to the magnitude of the terms)
    terms = F.linear(x.double().abs(), m.weight.double().abs(), m.bias.double().abs())
    bound = 0.5 * torch.finfo(dtype).eps * want.abs() + 1e-6 * terms
    assert ((got.double() - want).abs() <= bound).all()


def test_calls_past_the_row_limit_and_unprepared_layers_take_the_plain_route() -> None:
    m = _layer(128, 384, torch.bfloat16)
    x = torch.randn(L.SMALL_GEMM_MAX_ROWS + 1, 128).to(torch.bfloat16)
    assert m.weight_fp32 is None and torch.equal(m(x[:1]), F.linear(x[:1], m.weight, m.bias))
    L.prepare_small_gemms(m)
    m.weight_packed = None
    assert torch.equal(m(x), F.linear(x, m.weight, m.bias))
    assert not torch.equal(m.weight_fp32, torch.zeros_like(m.weight_fp32))


@pytest.mark.parametrize(
    ("shape", "dtype", "eligible"),
    [
        ((128, 512), torch.bfloat16, True),  # 65,536 elements: the limit
        ((129, 512), torch.bfloat16, False),
        ((128, 128), torch.float32, False),  # fp32 models keep their one copy
    ],
)
def test_only_small_half_precision_cpu_weights_get_a_copy(
    shape: tuple[int, int], dtype: torch.dtype, eligible: bool
) -> None:
    m = _layer(shape[1], shape[0], dtype, bias=False)
    assert L.small_gemm_eligible(m.weight) is eligible
    packed = L.packed_gemm_eligible(m.weight) and cpu_gemm.pack(m.weight) is not None
    assert L.prepare_small_gemms(m) == int(eligible or packed)  # layers that got either copy
    assert (m.weight_fp32 is not None) is eligible and m.bias_fp32 is None


def test_a_loaded_bf16_model_routes_its_small_layers_and_keeps_its_parameters(
    tiny_models: Mapping[str, Path],
) -> None:
    model, _ = load_model(tiny_models["llama"], torch.bfloat16, "cpu")
    layers = [m for m in model.modules() if isinstance(m, L.Linear)]
    assert layers and all(m.weight_fp32 is not None for m in layers)
    assert all(torch.equal(m.weight_fp32, m.weight.float()) for m in layers)
    if L.packed_gemm_eligible(layers[0].weight) and cpu_native.available():
        assert all(m.weight_packed is not None for m in layers)
    assert not any("fp32" in name for name, _ in model.named_parameters())
    assert not any("fp32" in name for name in model.state_dict())
    model32, _ = load_model(tiny_models["llama"], torch.float32, "cpu")
    assert all(m.weight_fp32 is None for m in model32.modules() if isinstance(m, L.Linear))


# -- the packed bf16 route (kernels.cpu_gemm) ---------------------------------------------------
needs_packed = pytest.mark.skipif(
    not L.packed_gemm_eligible(torch.empty(1, 1, dtype=torch.bfloat16))
    or cpu_gemm.pack(torch.ones(1, 1, dtype=torch.bfloat16)) is None,
    reason="this CPU has bf16 GEMM hardware, or the native kernels are unavailable",
)


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _assert_one_rounding(got: torch.Tensor, x: torch.Tensor, m: L.Linear) -> None:
    """got is an fp32 sum of exact products rounded once to bf16 (the sum in any order)."""
    bias = None if m.bias is None else m.bias.double()
    want = F.linear(x.double(), m.weight.double(), bias)
    terms = F.linear(x.double().abs(), m.weight.double().abs(), None if bias is None else bias.abs())
    bound = 0.5 * torch.finfo(torch.bfloat16).eps * want.abs() + 1e-6 * terms
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.double() - want).abs() <= bound).all()


@needs_packed
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("rows", "in_f", "out_f"), [(1, 64, 48), (5, 37, 21), (16, 128, 384), (67, 96, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_calls_round_an_fp32_sum_once(rows: int, in_f: int, out_f: int, bias: bool) -> None:
    """Row counts off the kernel's 4-row blocks, widths off its 16-column panels, strided rows."""
    m = _layer(in_f, out_f, torch.bfloat16, bias=bias)
    L.prepare_small_gemms(m)
    assert m.weight_packed is not None and m.weight_packed.data.numel() == -(-out_f // 16) * 16 * in_f
    wide = torch.randn(rows, in_f + 3).to(torch.bfloat16)
    for x in (wide[:, :in_f].contiguous(), wide[:, 3:]):
        got = m(x)
        _assert_one_rounding(got, x, m)
        assert torch.equal(got, cpu_gemm.linear(x, m.weight_packed, m.bias_fp32))


@needs_packed
def test_the_packed_route_is_taken_only_with_one_thread_and_backend_auto() -> None:
    from pdserve import kernels

    m = _layer(128, 384, torch.bfloat16, bias=False)
    L.prepare_small_gemms(m)
    assert m.weight_packed is not None
    x = torch.randn(32, 128).to(torch.bfloat16)  # past SMALL_GEMM_MAX_ROWS: else F.linear
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cpu_gemm.linear(x, m.weight_packed, None) is None
        assert torch.equal(m(x), F.linear(x, m.weight))
        torch.set_num_threads(1)
        assert torch.equal(m(x), cpu_gemm.linear(x, m.weight_packed, None))
        with kernels.use_backend("torch"):
            assert torch.equal(m(x), F.linear(x, m.weight))
    finally:
        torch.set_num_threads(before)
    assert cpu_gemm.linear(x.float(), m.weight_packed, None) is None  # fp32 rows: not for it
    assert cpu_gemm.linear(x[:, :64], m.weight_packed, None) is None  # wrong width


def test_fp16_fp32_and_bf16_hardware_get_no_packed_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    for dtype in (torch.float16, torch.float32):
        m = _layer(128, 384, dtype)
        L.prepare_small_gemms(m)
        assert m.weight_packed is None
    monkeypatch.setattr(cpu_gemm, "bf16_gemm_native", lambda: True)
    m = _layer(128, 384, torch.bfloat16)
    L.prepare_small_gemms(m)
    assert m.weight_packed is None and m.weight_fp32 is not None
