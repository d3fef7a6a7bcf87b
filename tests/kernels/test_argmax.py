"""Triton row argmax vs torch.argmax: ties to the lowest index (also across chunks), padding
lanes, -inf rows, dispatch. On CPU under TRITON_INTERPRET=1 (tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.errors import UnsupportedError
from pdserve.kernels import argmax_rows, argmax_unsupported_reason

try:
    from pdserve.kernels.triton_argmax import BLOCK
except ImportError:  # no triton: every test that runs the kernel skips (conftest.force_triton)
    BLOCK = 4096

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


def _random_bitmask(k: int, cols: int, words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bm = torch.randint(-(2**31), 2**31 - 1, (k, words), generator=g, dtype=torch.int64).to(torch.int32)
    bm[:, 0] |= 1  # every row allows token 0 (a row of only banned tokens has no right answer)
    return bm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(3, BLOCK), (5, 2 * BLOCK + 40), (2, 1000)])
@pytest.mark.parametrize("mapped", [False, True])
def test_masked_argmax_is_the_argmax_of_the_masked_logits(
    force_triton, device, dtype, rows, cols, mapped
) -> None:
    """The fused mask + argmax gives the index of the best allowed token of each constrained
    row (the argmax of the logits after apply_token_bitmask_) and the plain argmax of the rows
    the map leaves out; the logits are not written. Bitmasks narrower than the vocabulary ban
    the rest (a tokenizer smaller than the LM head)."""
    torch.manual_seed(rows + cols)
    x = torch.randn(rows, cols, device=device).to(dtype)
    before = x.clone()
    words = (cols + 31) // 32 - (1 if cols > 64 else 0)  # narrower than the vocabulary
    if mapped:
        row_map = torch.tensor([1, -1, 0, -1, 2][:rows], dtype=torch.int32, device=device)
        k = int(row_map.max()) + 1
    else:
        row_map, k = None, rows
    bitmask = _random_bitmask(k, cols, words, rows * cols).to(device)
    got = kernels.masked_argmax_rows(x, bitmask, row_map)
    assert torch.equal(x, before)
    want = x.clone()
    if row_map is None:
        kernels.apply_token_bitmask_(want, bitmask)
    else:
        m = row_map.long()
        sel = (m >= 0).nonzero().squeeze(1)
        kernels.apply_token_bitmask_(want, bitmask[m[sel]], sel)
    assert torch.equal(got, want.argmax(dim=-1))
    with kernels.use_backend("torch"):
        assert torch.equal(kernels.masked_argmax_rows(x, bitmask, row_map), got)
    if mapped:  # an unconstrained row keeps its plain argmax, even a banned-for-others token
        assert got[1].item() == x[1].argmax().item()


@pytest.mark.skipif(not CUDA, reason="pinned host memory read by a CUDA kernel")
def test_masked_argmax_reads_a_pinned_host_bitmask_in_place() -> None:
    assert kernels.host_operands_readable(torch.device("cuda"))
    x = torch.randn(4, 3 * BLOCK + 5, device="cuda")
    bitmask = _random_bitmask(2, x.shape[1], (x.shape[1] + 31) // 32, 7).pin_memory()
    row_map = torch.tensor([-1, 0, -1, 1], dtype=torch.int32).pin_memory()
    got = kernels.masked_argmax_rows(x, bitmask, row_map)
    assert torch.equal(got, kernels.masked_argmax_rows(x, bitmask.cuda(), row_map.cuda()))
