"""pdserve.kernels.triton_copy (one launch for many device copies) against its torch twin."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (raw device pointers)"),
]


def _twin(dst: torch.Tensor, src: torch.Tensor, copies: list[tuple[int, int, int]]) -> torch.Tensor:
    """What the kernel must produce: each (src byte offset, dst byte offset, bytes) copied by torch."""
    out = dst.clone()
    for s, d, n in copies:
        out[d : d + n] = src[s : s + n]
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_copy_matches_torch_copies(seed):
    from pdserve.kernels import triton_copy

    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, device="cuda")
    # disjoint destination slots of mixed sizes (16 B .. 1.5 MiB, past one program's 128 KiB)
    sizes = [16, 48, 4096, 131072, 131088, 1 << 20, (3 << 19) + 16, 524288, 32]
    order = torch.randperm(len(sizes), generator=g).tolist()
    copies, d = [], 0
    for i in order:
        n = sizes[i]
        s = int(torch.randint(0, (src.numel() - n) // 16, (1,), generator=g)) * 16
        copies.append((s, d, n))
        d += n + 16 * int(torch.randint(0, 8, (1,), generator=g))
    expect = _twin(dst, src, copies)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    triton_copy.batched_copy(
        [(src.data_ptr() + s, dst.data_ptr() + d, n) for s, d, n in copies], dst.device, stream
    )
    stream.synchronize()
    assert torch.equal(dst, expect)


def test_unaligned_copies_are_refused_untouched():
    from pdserve.kernels import triton_copy

    src = torch.ones(1024, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(1024, dtype=torch.uint8, device="cuda")
    bad = [(src.data_ptr() + 8, dst.data_ptr(), 64)]
    assert not triton_copy.aligned(bad)
    with pytest.raises(ValueError, match="16-byte"):
        triton_copy.batched_copy(bad, dst.device, torch.cuda.Stream())
    assert int(dst.sum()) == 0
