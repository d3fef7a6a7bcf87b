"""Triton row argmax vs torch.argmax: ties to the lowest index (also across chunks), padding
lanes, -inf rows, dispatch. On CPU under TRITON_INTERPRET=1 (tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.errors import UnsupportedError
from pdserve.kernels import argmax_rows, argmax_unsupported_reason
from pdserve.kernels.triton_argmax import BLOCK

CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(1, 7), (3, BLOCK), (5, 3 * BLOCK + 17), (2, 128256)])
def test_argmax_matches_torch(force_triton, device, dtype, rows, cols) -> None:
    torch.manual_seed(rows * cols)
    x = torch.randn(rows, cols, device=device).to(dtype)
    assert argmax_unsupported_reason(x) is None
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, x.argmax(dim=-1))


def test_ties_go_to_the_lowest_index_within_and_across_chunks(force_triton, device) -> None:
    cols = 3 * BLOCK + 5
    x = torch.zeros(4, cols, device=device)
    x[0, [9, 3, 2 * BLOCK + 1]] = 5.0  # same chunk and a later chunk
    x[1, [BLOCK + 7, 2 * BLOCK]] = 5.0  # ties only in later chunks
    x[2, [cols - 1, cols - 2]] = 5.0  # at the ragged end, next to the padding lanes
    x[3] = float("-inf")  # every value -inf: index 0, as torch gives
    assert argmax_rows(x).tolist() == [3, BLOCK + 7, cols - 2, 0]
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()


def test_strided_rows_and_no_rows(force_triton, device) -> None:
    x = torch.randn(6, 300, device=device)[::2]  # row stride 600
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    cols_strided = torch.randn(50, 4, device=device).t()  # last-dim stride 4: copied
    assert torch.equal(argmax_rows(cols_strided), cols_strided.argmax(dim=-1))
    assert argmax_rows(torch.empty(0, 10, device=device)).shape == (0,)


def test_dispatch(device) -> None:
    x = torch.randn(2, 9, device=device)
    with kernels.use_backend("torch"):
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    with kernels.use_backend("triton"), pytest.raises(UnsupportedError, match="must be"):
        argmax_rows(torch.randn(2, 3, 4, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_cpu_argmax_gives_torchs_index_with_ties_nan_inf_and_strides(dtype) -> None:
    """The CPU path (numpy, bf16 / fp16 cast to fp32 first) returns torch.argmax's index: the
    first maximum, the first NaN, 0 for a row of -inf; strided and empty inputs too."""
    from pdserve.kernels.argmax import argmax_cpu

    torch.manual_seed(1)
    x = torch.randn(7, 4096).to(dtype)
    x[1, [10, 3000]] = 100.0  # a tie: the lower index
    x[2, [50, 9]] = float("nan")  # the first NaN wins over everything
    x[3] = float("-inf")
    x[4, 4095] = float("inf")
    x[5] = x[5].round()  # many ties after rounding (bf16 / fp16 have few values near 0)
    want = x.argmax(dim=-1)
    got = argmax_cpu(x)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert got[1] == 10 and got[2] == 9 and got[3] == 0 and got[4] == 4095
    assert torch.equal(argmax_rows(x), want)  # what the engine calls on CPU
    assert torch.equal(argmax_cpu(x[::2, 1:]), x[::2, 1:].argmax(dim=-1))
    assert argmax_cpu(torch.empty(0, 5, dtype=dtype)).shape == (0,)
