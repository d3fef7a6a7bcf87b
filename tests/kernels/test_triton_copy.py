"""pdserve.kernels.triton_copy: the kernel table (numpy) and the kernels byte for byte.

Without a GPU the kernels run under TRITON_INTERPRET=1 (tests/kernels/conftest.py) on host
tensors: the interpreter reads and writes the raw addresses the rows point at, so the copies are
the real kernel code on host memory. tests/gpu/test_batched_copy.py runs them on CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton_copy = pytest.importorskip("pdserve.kernels.triton_copy", exc_type=ImportError)
KiB = 1 << 10


def _launch(copies: list[tuple[int, int, int]], variant: str, device: str) -> None:
    """What ``batched_copy`` enqueues, with the anchor and the rows in tensors of ``device``."""
    v = triton_copy.VARIANTS[variant]
    anchor = torch.empty(16, dtype=torch.uint8, device=device)
    rows, grid = triton_copy.kernel_rows(triton_copy.as_table(copies), anchor.data_ptr(), v)
    flat = torch.from_numpy(rows.reshape(-1).copy()).to(device)
    triton_copy.launch(triton_copy.Launch(v, flat, anchor.view(torch.int32), grid))
    if device == "cuda":
        torch.cuda.synchronize()


def _case(sizes: list[int], seed: int, device: str):
    """Source and destination pools, copies of ``sizes`` bytes to disjoint shuffled places, and
    what the destination must hold afterwards (each copy done by torch)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(sizes) + 64 * len(sizes)
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=g).to(device)
    dst = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=g).to(device)
    expect = dst.clone()
    copies, s_off, d_off = [], 0, total
    order = torch.randperm(len(sizes), generator=g).tolist()
    for i in order:  # sources in order, destinations from the top down: every copy lands elsewhere
        n = sizes[i]
        d_off -= n + 16 * int(torch.randint(0, 4, (1,), generator=g))
        copies.append((src.data_ptr() + s_off, dst.data_ptr() + d_off, n))
        expect[d_off : d_off + n] = src[s_off : s_off + n]
        s_off += n + 16
    return src, dst, expect, copies  # src too: the copies point into it


# --------------------------------------------------------------------------- the table (numpy)


def test_chunk_rows_split_each_descriptor_by_a_prefix_sum():
    table = np.array([[1000, 9000, 48], [2000, 7000, 160], [0, 0, 0], [5000, 3000, 64]], dtype=np.int64)
    rows = triton_copy.chunk_rows(table, 64)
    assert rows.tolist() == [
        [1000, 9000, 48],
        [2000, 7000, 64],
        [2064, 7064, 64],
        [2128, 7128, 32],
        # the empty row gives no piece
        [5000, 3000, 64],
    ]
    assert triton_copy.chunk_rows(table[2:3], 64).shape == (0, 3)


@pytest.mark.parametrize("lengths", ["random", "equal", "equal, whole pieces"])
def test_chunk_rows_cover_every_byte_once(lengths):
    rng = np.random.default_rng(0)
    n = {
        "random": rng.integers(1, 5000, 300) * 16,
        "equal": np.full(300, 1040 * 16),  # the equal-pieces path, a short last piece
        "equal, whole pieces": np.full(300, 4096),
    }[lengths]
    table = np.stack([rng.integers(0, 1 << 40, 300) * 16, rng.integers(0, 1 << 40, 300) * 16, n], 1)
    rows = triton_copy.chunk_rows(table, 1024)
    expect = [(s + o, d + o, min(1024, n - o)) for s, d, n in table.tolist() for o in range(0, n, 1024)]
    assert [tuple(r) for r in rows.tolist()] == expect


def test_kernel_rows_are_anchor_relative_16_byte_units_and_the_grid_fits():
    anchor = 1 << 30
    table = np.array(
        [[anchor - 4096, anchor + 160, 300 * KiB], [anchor + 32, anchor - 64, 16]], dtype=np.int64
    )
    rows, grid = triton_copy.kernel_rows(table, anchor, triton_copy.VARIANTS["chunks-64k"])
    assert grid == (6, 1) and rows[0].tolist() == [-256, 10, 4096] and rows[-1].tolist() == [2, -4, 1]
    assert rows[4].tolist() == [-256 + 4 * 4096, 10 + 4 * 4096, 44 * KiB // 16]
    # as many pieces in every row: the rows stay whole, grid axis 1 walks the pieces
    equal = table.copy()
    equal[1, 2] = 260 * KiB
    rows, grid = triton_copy.kernel_rows(equal, anchor, triton_copy.VARIANTS["chunks-64k"])
    assert grid == (2, 5) and rows.tolist() == [[-256, 10, 300 * KiB // 16], [2, -4, 260 * KiB // 16]]
    rows, grid = triton_copy.kernel_rows(table, anchor, triton_copy.VARIANTS["grid2d-128k"])
    assert grid == (2, 3) and rows.tolist() == [[-256, 10, 300 * KiB // 16], [2, -4, 1]]
    assert table[0, 0] == anchor - 4096  # the caller's table is left alone


@pytest.mark.parametrize("variant", ["chunks-64k", "grid2d-128k"])
def test_rows_past_the_grid_axis_1_limit_are_split_on_axis_0(variant):
    """Four equal 5 GiB rows: 81,920 pieces of 64 KiB each (40,960 of 128 KiB in grid2d, which
    fits), more than grid axis 1 takes (65,535): they are split on axis 0."""
    anchor, n = 1 << 40, 5 << 30
    table = np.array([[anchor + i * n, anchor + (4 + i) * n, n] for i in range(4)], dtype=np.int64)
    v = triton_copy.VARIANTS[variant]
    rows, grid = triton_copy.kernel_rows(table, anchor, v)
    assert grid[1] <= triton_copy.MAX_GRID_Y and grid[0] == len(rows)
    assert int(rows[:, 2].sum()) * 16 == 4 * n  # every byte once
    if variant == "chunks-64k":
        assert grid == (4 * n // (64 * KiB), 1)


@pytest.mark.parametrize("bad", [(8, 0, 64), (0, 4, 64), (0, 0, 24)])
def test_unaligned_rows_are_refused(bad):
    table = np.array([[1 << 20, 2 << 20, 64], [(1 << 20) + bad[0], (2 << 20) + bad[1], bad[2]]])
    assert not triton_copy.aligned(table)
    with pytest.raises(ValueError, match="16-byte"):
        triton_copy.kernel_rows(table, 1 << 12, triton_copy.VARIANTS["chunks-64k"])


def test_as_table_takes_tuples_and_arrays():
    t = triton_copy.as_table([(16, 32, 48), (64, 80, 96)])
    assert t.dtype == np.int64 and t.tolist() == [[16, 32, 48], [64, 80, 96]]
    assert np.shares_memory(triton_copy.as_table(t), t)  # no copy of an int64 table


def test_copy_methods_name_the_variants():
    from pdserve.errors import ConfigError
    from pdserve.kvtransfer.cuda_runtime import check_copy_method

    assert check_copy_method("triton:grid2d-128k") == "triton:grid2d-128k"
    with pytest.raises(ConfigError, match="Triton variants are"):
        check_copy_method("triton:nope")


def test_variants_are_consistent():
    assert triton_copy.DEFAULT_VARIANT in triton_copy.VARIANTS
    for v in triton_copy.VARIANTS.values():
        assert v.chunk_bytes % v.block_bytes == 0 and v.block_bytes // 4 >= 32 * v.num_warps * 4


# --------------------------------------------------------------------------- the kernels


@pytest.mark.parametrize("variant", ["chunks-64k", "grid2d-128k"])
def test_copies_of_odd_lengths_land_byte_exact(variant, device):
    # 16-byte multiples that are not multiples of a warp's access, a block step or a piece
    sizes = [16, 48, 4096 + 16, 64 * KiB - 16, 64 * KiB + 16, 131072 + 48, 32]
    _src, dst, expect, copies = _case(sizes, 0, device)
    _launch(copies, variant, device)
    assert torch.equal(dst, expect)


def test_many_descriptors_land_byte_exact(device):
    g = torch.Generator().manual_seed(1)
    sizes = [16 * int(x) for x in torch.randint(1, 65, (120,), generator=g)]
    _src, dst, expect, copies = _case(sizes, 1, device)
    _launch(copies, "chunks-64k", device)
    assert torch.equal(dst, expect)


@pytest.mark.parametrize("size", [2 * 64 * KiB + 48, 2 * 64 * KiB])
def test_equal_lengths_land_byte_exact(size, device):
    # whole rows on a 2-D grid (row, piece): a short last piece, or only full ones
    _src, dst, expect, copies = _case([size] * 5, 3, device)
    _launch(copies, "chunks-64k", device)
    assert torch.equal(dst, expect)


def test_a_large_descriptor_lands_byte_exact(device):
    _src, dst, expect, copies = _case([(1 << 20) + 4096 + 16, 4096], 2, device)
    _launch(copies, "chunks-64k", device)
    assert torch.equal(dst, expect)
