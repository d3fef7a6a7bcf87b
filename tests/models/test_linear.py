"""models/linear.py: the CPU small-GEMM route of half-precision layers."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

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
    assert L.prepare_small_gemms(m) == int(eligible)
    assert (m.weight_fp32 is not None) is eligible and m.bias_fp32 is None


def test_a_loaded_bf16_model_routes_its_small_layers_and_keeps_its_parameters(
    tiny_models: Mapping[str, Path],
) -> None:
    model, _ = load_model(tiny_models["llama"], torch.bfloat16, "cpu")
    layers = [m for m in model.modules() if isinstance(m, L.Linear)]
    assert layers and all(m.weight_fp32 is not None for m in layers)
    assert all(torch.equal(m.weight_fp32, m.weight.float()) for m in layers)
    assert not any("fp32" in name for name, _ in model.named_parameters())
    assert not any("fp32" in name for name in model.state_dict())
    model32, _ = load_model(tiny_models["llama"], torch.float32, "cpu")
    assert all(m.weight_fp32 is None for m in model32.modules() if isinstance(m, L.Linear))
