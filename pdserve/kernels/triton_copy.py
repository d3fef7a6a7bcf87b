"""One launch for many device-to-device copies (cuda_ipc scattered blocks).

``cudaMemcpyAsync`` per descriptor costs ~7-10 us of host time each (measured on the H200,
docs/benchmarks.md, "cuda_ipc KV transport"): 125 scattered blocks of a 2k-token prompt ran at
0.03 of the copy rate. This kernel takes the whole descriptor list as one int64 tensor
``[n, 3]`` = (src address, dst address, bytes) and copies every descriptor in one launch.

Grid: axis 0 = descriptors, axis 1 = chunks of ``CHUNK`` bytes of the longest one (a program
past its descriptor's end exits at once). Addresses are raw device pointers (our KV cache, or a
peer's allocation opened through CUDA IPC; a pointer of another GPU works with peer access), so
the kernel turns them into pointers with an int-to-pointer cast. Every address and length must
be a multiple of 16 bytes (``aligned``); the caller falls back to one memcpy per descriptor
otherwise. The data moves as int32 x 4 per element group; 16-byte alignment lets the compiler
use 128-bit loads and stores.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

ALIGN = 16
_WORD = 4  # bytes per int32
_BLOCK = 4096  # int32 words per inner iteration (16 KiB)
_CHUNK_ITERS = 8  # inner iterations per program: 128 KiB per program


@triton.jit
def _batched_copy_kernel(desc_ptr, base_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # desc row i: (src - base, dst - base, length) in 16-byte units; base is 16-byte aligned, so
    # every address below is a multiple of 4 int32 words (the compiler sees it: 128-bit accesses)
    i = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1).to(tl.int64) * (BLOCK * ITERS)
    words = tl.load(desc_ptr + i * 3 + 2) * 4
    if start < words:
        src = base_ptr + tl.load(desc_ptr + i * 3) * 4
        dst = base_ptr + tl.load(desc_ptr + i * 3 + 1) * 4
        for it in range(ITERS):
            offs = start + it * BLOCK + tl.arange(0, BLOCK)
            mask = offs < words
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def aligned(copies: Sequence[tuple[int, int, int]]) -> bool:
    """Every address and length a multiple of ``ALIGN`` bytes (what the kernel needs)."""
    return all(s % ALIGN == 0 and d % ALIGN == 0 and n % ALIGN == 0 for s, d, n in copies)


class _Staging:
    """A pinned host buffer per stream for the descriptor table, grown when a longer list comes.

    ``batched_copy``'s caller waits for the stream before the next call on it, so the buffer is
    free again when it is refilled; a fresh ``pin_memory()`` per call cost host time on every
    transfer."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def fill(self, stream: torch.cuda.Stream, table: np.ndarray) -> torch.Tensor:
        n = table.shape[0]
        buf = self._buffers.get(id(stream))
        if buf is None or buf.shape[0] < n:
            buf = torch.empty((max(n, 256), 3), dtype=torch.int64).pin_memory()
            self._buffers[id(stream)] = buf
        view = buf[:n]
        view.numpy()[:] = table
        return view


_staging = _Staging()


def batched_copy(
    copies: Sequence[tuple[int, int, int]], device: torch.device, stream: torch.cuda.Stream
) -> None:
    """Enqueue all ``copies`` (src, dst, bytes) as one kernel on ``stream``; the caller waits for
    ``stream`` before calling again with it (the descriptor table's pinned buffer is reused).

    The regions must not overlap (copies run in any order). Raises ValueError when a copy is not
    16-byte aligned (the caller's fallback is one memcpy each)."""
    if not copies:
        return
    # addresses are below 2**63 (user-space virtual addresses), so int64 holds them
    table = np.asarray(copies, dtype=np.int64).reshape(-1, 3)
    if (table % ALIGN).any():
        raise ValueError("batched_copy needs 16-byte aligned addresses and lengths")
    longest = int(table[:, 2].max())
    per_program = _BLOCK * _CHUNK_ITERS * _WORD
    with torch.cuda.stream(stream):
        desc = torch.empty((len(table), 3), dtype=torch.int64, device=device)
        base = desc.data_ptr()  # any 16-byte aligned device address will do as the origin
        table[:, :2] -= base
        table //= ALIGN
        desc.copy_(_staging.fill(stream, table), non_blocking=True)
        grid = (len(table), triton.cdiv(longest, per_program))
        _batched_copy_kernel[grid](
            desc, desc.view(torch.int32), BLOCK=_BLOCK, ITERS=_CHUNK_ITERS, num_warps=8
        )
