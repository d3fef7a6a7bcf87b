"""kernels/triton_seeded_draw.py: the counter-based Exp(1) draws of seeded rows, against a numpy
Philox-4x32-10 written from its definition (Triton's ``tl.rand``), one launch against one row at
a time, the rows it must not touch, and the distribution. CPU runs use TRITON_INTERPRET=1
(tests/kernels/conftest.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

M32 = 0xFFFFFFFF


def _philox_uniform(seed: int, counters: np.ndarray) -> np.ndarray:
    """U[0, 1) float32 of Philox-4x32-10 keyed by ``seed`` at ``counters`` (int64): first word,
    mapped as Triton maps an int32 (negative values complemented, times 2**-31 rounded down)."""
    c = counters.astype(np.uint64)
    c0, c1 = c & M32, c >> np.uint64(32)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0, k1 = np.uint64(seed & M32), np.uint64((seed >> 32) & M32)
    a, b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        pb, pa = b * c2, a * c0  # 32 x 32 -> 64 bits: exact in uint64
        c0, c1, c2, c3 = (pb >> np.uint64(32)) ^ c1 ^ k0, pb & M32, (pa >> np.uint64(32)) ^ c3 ^ k1, pa & M32
        k0 = (k0 + np.uint64(0x9E3779B9)) & M32
        k1 = (k1 + np.uint64(0xBB67AE85)) & M32
    x = c0.astype(np.uint32).view(np.int32)
    x = np.where(x < 0, ~x, x)
    return x.astype(np.float32) * np.float32(4.6566127342e-10)


def _reference(seed: int, k: int, n_cols: int) -> np.ndarray:
    u = _philox_uniform(seed, k * n_cols + np.arange(n_cols, dtype=np.int64))
    return -np.log(np.float32(1.0) - u)


@pytest.fixture
def draw(force_triton):
    from pdserve.kernels.triton_seeded_draw import seeded_exponential_

    return seeded_exponential_


def _ids(values: list[int], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def test_rows_equal_the_philox_reference_and_other_rows_stay(draw, device) -> None:
    n_cols = 5003  # not a multiple of the block
    q = torch.full((4, n_cols), -7.0, device=device)
    seeds, ks = [1234, 2**62 + 5, 0], [0, 17, 123_456_789]  # a counter past 2**32
    draw(q, _ids([3, 0, 1], device), _ids(seeds, device), _ids(ks, device))
    for row, seed, k in zip([3, 0, 1], seeds, ks, strict=True):
        np.testing.assert_allclose(q[row].cpu().numpy(), _reference(seed, k, n_cols), rtol=2e-6, atol=1e-7)
    assert bool((q[2] == -7.0).all())  # not a seeded row: untouched


def test_one_launch_equals_one_row_at_a_time_whatever_the_row(draw, device) -> None:
    n_cols = 3000
    together = torch.zeros((3, n_cols), device=device)
    draw(together, _ids([0, 1, 2], device), _ids([9, 9, 10], device), _ids([4, 5, 4], device))
    for row, (seed, k) in enumerate([(9, 4), (9, 5), (10, 4)]):
        alone = torch.zeros((2, n_cols), device=device)
        draw(alone, _ids([1], device), _ids([seed], device), _ids([k], device))
        assert torch.equal(alone[1], together[row])
    assert not torch.equal(together[0], together[1])  # the next token's draws differ
    assert not torch.equal(together[0], together[2])  # another seed's too


def test_draws_are_exponential(draw, device) -> None:
    q = torch.empty((4, 10_000), device=device)
    draw(q, _ids([0, 1, 2, 3], device), _ids([1, 2, 3, 4], device), _ids([0, 0, 0, 0], device))
    x = q.flatten().double().cpu()
    assert bool((x >= 0).all())
    assert abs(float(x.mean()) - 1.0) < 0.03  # 40k draws: sd of the mean 0.005
    assert abs(float((x > 1.0).double().mean()) - math.exp(-1)) < 0.015
    assert abs(float((x > 3.0).double().mean()) - math.exp(-3)) < 0.006


def test_columns_of_one_table_as_the_sampler_passes_them(draw, device) -> None:
    """The sampler hands the columns of one [R, 3] (row, seed, k) table: strided views, which the
    kernel must read as its rows' values (an index past q's rows would write out of bounds)."""
    n_cols = 1000
    table = _ids([[2, 11, 3], [0, 12, 4], [1, 13, 5]], device)
    q = torch.zeros((3, n_cols), device=device)
    draw(q, table[:, 0], table[:, 1], table[:, 2])
    for row, seed, k in table.tolist():
        np.testing.assert_allclose(q[row].cpu().numpy(), _reference(seed, k, n_cols), rtol=2e-6, atol=1e-7)
