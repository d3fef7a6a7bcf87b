"""One launch for many device-to-device copies (cuda_ipc scattered blocks).

``cudaMemcpyAsync`` per descriptor costs ~7-10 us of host time each (measured on the H200,
docs/benchmarks.md, "cuda_ipc KV transport"). This kernel takes the copy list (src address,
dst address, bytes) and copies all of it in one launch.

Addresses are raw device pointers (our KV cache, or a peer's allocation opened through CUDA IPC;
a pointer of another GPU works with peer access). Triton has no int-to-pointer cast the
interpreter also runs, so a table row holds each address relative to ``anchor`` (a 16-byte
aligned device buffer), all in 16-byte units. Every address and length must be a multiple of 16
bytes (``aligned``); the caller falls back otherwise (kvtransfer/cuda_runtime.py). The data
moves as int32 words, 4 per 16 bytes: the compiler sees every offset a multiple of 4 words and
emits 128-bit loads and stores (``ld.global.v4.b32``; bench/gpu_ipc.py counts them in the PTX).
Compiled for sm_90 by Triton 3.6 every variant below is ``LDG.E.128`` / ``STG.E.128`` only, the
``grid2d`` kernel too; ``chunks-64k`` takes 64 registers a thread (4 programs of 8 warps per SM).

Two layouts (``Variant.layout``):
- ``chunks`` (default): one program per piece of at most ``chunk_bytes``. Descriptors of
  different lengths are split on the host (a prefix sum over the pieces per descriptor,
  ``chunk_rows``) into a 1-D grid: no idle programs; descriptors with as many pieces each (KV
  blocks) go as they are on a 2-D grid (row, piece), without the split's host time.
- ``grid2d``: one row per descriptor; grid axis 1 = pieces of the longest descriptor, a program
  past its descriptor's end exits at once.

The table goes through a pinned host buffer into a device buffer, both kept per (device,
stream) and grown on demand (``table: device``), or the kernel reads the rows straight from the
pinned buffer over the bus (``table: pinned``): no host-to-device copy to enqueue.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

ALIGN = 16
MAX_GRID_Y = 65_535  # CUDA's limit on grid axes 1 and 2


@dataclass(frozen=True)
class Variant:
    """A kernel configuration: ``block_bytes`` move per loop step of a program (bytes in flight
    per program), ``chunk_bytes`` per program, ``num_warps`` per program."""

    name: str
    layout: str = "chunks"  # "chunks" | "grid2d"
    chunk_bytes: int = 64 << 10
    block_bytes: int = 32 << 10
    num_warps: int = 8
    table: str = "device"  # "device" | "pinned"

    def __post_init__(self) -> None:
        assert self.layout in ("chunks", "grid2d") and self.table in ("device", "pinned"), self
        assert self.chunk_bytes % self.block_bytes == 0 and self.block_bytes % (16 * 32) == 0, self


VARIANTS = {
    v.name: v
    for v in (
        # the kernel before the chunk table: 128 KiB per program, 16 KiB per step
        Variant("grid2d-128k", layout="grid2d", chunk_bytes=128 << 10, block_bytes=16 << 10),
        Variant("chunks-64k"),
        Variant("chunks-64k-pinned", table="pinned"),
        Variant("chunks-128k", chunk_bytes=128 << 10),
        # a whole piece in registers: 16 128-bit loads per thread in flight before the stores
        Variant("chunks-64k-b64k", block_bytes=64 << 10),
        Variant("chunks-64k-w4", block_bytes=16 << 10, num_warps=4),
        Variant("chunks-256k-b64k-w16", chunk_bytes=256 << 10, block_bytes=64 << 10, num_warps=16),
    )
}
# By wall time, what a push waits for: the kernel reading its table from pinned host memory saves
# enqueueing the table's copy (H200: 125 x 512 KiB 0.111 against 0.154 ms, 1,000 x 64 KiB 0.138
# against 0.151, 16 x 4 MiB 0.113 against 0.123; kernels 0.038-0.045 ms either way).
DEFAULT_VARIANT = "chunks-64k-pinned"


@triton.jit
def _grid2d_kernel(rows_ptr, anchor_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # row i: (src - anchor, dst - anchor, length) in 16-byte units; program (i, j) copies piece j
    i = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1).to(tl.int64) * (BLOCK * ITERS)
    words = tl.load(rows_ptr + i * 3 + 2) * 4
    if start < words:
        src = anchor_ptr + tl.load(rows_ptr + i * 3) * 4
        dst = anchor_ptr + tl.load(rows_ptr + i * 3 + 1) * 4
        for it in range(ITERS):
            offs = start + it * BLOCK + tl.arange(0, BLOCK)
            mask = offs < words
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _chunks_kernel(rows_ptr, anchor_ptr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    # program (p, j): piece j (CHUNK words) of row p = (src - anchor, dst - anchor, length) in
    # 16-byte units; a full piece runs unmasked (all but a row's last)
    p = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1).to(tl.int64) * CHUNK
    src = anchor_ptr + tl.multiple_of(tl.load(rows_ptr + p * 3) * 4, 4) + start
    dst = anchor_ptr + tl.multiple_of(tl.load(rows_ptr + p * 3 + 1) * 4, 4) + start
    words = tl.multiple_of(tl.minimum(tl.load(rows_ptr + p * 3 + 2) * 4 - start, CHUNK), 4)
    if words == CHUNK:
        for off in tl.static_range(0, CHUNK, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.load(src + offs))
    else:
        for off in range(0, words, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            mask = offs < words
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


class UnalignedCopyError(ValueError):
    """An address or length is not a multiple of ``ALIGN`` bytes: nothing was enqueued."""


def as_table(copies: Sequence[tuple[int, int, int]] | np.ndarray) -> np.ndarray:
    """The copies as an int64 array [n, 3] (src, dst, bytes); an int64 array passes through.
    Addresses are below 2**63 (user-space virtual addresses), so int64 holds them."""
    if isinstance(copies, np.ndarray):
        return copies.astype(np.int64, copy=False).reshape(-1, 3)
    flat = np.fromiter(itertools.chain.from_iterable(copies), dtype=np.int64, count=3 * len(copies))
    return flat.reshape(-1, 3)


def aligned(copies: Sequence[tuple[int, int, int]] | np.ndarray) -> bool:
    """Every address and length a multiple of ``ALIGN`` bytes (what the kernel needs)."""
    return not (as_table(copies) & (ALIGN - 1)).any()


def chunk_rows(table: np.ndarray, chunk: int) -> np.ndarray:
    """Split every (src, dst, length) row into pieces of at most ``chunk``: piece k of row i
    starts ``k * chunk`` into it. Rows of length 0 give no piece. Order: row by row."""
    pieces = (table[:, 2] + (chunk - 1)) // chunk
    row = np.repeat(np.arange(len(table)), pieces)
    first = np.cumsum(pieces) - pieces  # exclusive prefix sum: the row's first piece
    offset = (np.arange(len(row), dtype=np.int64) - first[row]) * chunk
    out = table[row]
    out[:, :2] += offset[:, None]
    np.minimum(out[:, 2] - offset, chunk, out=out[:, 2])
    return out


def kernel_rows(table: np.ndarray, anchor: int, variant: Variant) -> tuple[np.ndarray, tuple[int, ...]]:
    """The rows the kernel reads (addresses relative to ``anchor``, everything in 16-byte units)
    and its grid. ``chunks``: rows with as many pieces each (equal lengths: KV blocks) stay whole
    and grid axis 1 walks the pieces; otherwise the rows are split (``chunk_rows``) and axis 1 is
    1. UnalignedCopyError when an address or length is not 16-byte aligned."""
    if not aligned(table) or anchor % ALIGN:
        raise UnalignedCopyError("batched_copy needs 16-byte aligned addresses and lengths")
    units = table >> 4  # exact: multiples of 16 (an arithmetic shift, far cheaper than // 16)
    units[:, :2] -= anchor >> 4
    chunk = variant.chunk_bytes // ALIGN
    # Grid axis 1 holds at most MAX_GRID_Y programs: rows of more pieces (4 GiB at 64 KiB pieces)
    # are split on axis 0 instead, whose limit is 2**31 - 1.
    if variant.layout == "grid2d":
        y = triton.cdiv(int(units[:, 2].max()), chunk)
        if y <= MAX_GRID_Y:
            return units, (len(units), y)
    else:
        pieces = (units[:, 2] + (chunk - 1)) // chunk
        if pieces.min() == pieces.max() and pieces[0] <= MAX_GRID_Y:
            return units, (len(units), int(pieces[0]))
    rows = chunk_rows(units, chunk)
    return rows, (len(rows), 1)


class _Buffers:
    """Per (device, stream): the pinned host table, its device copy (grown on demand) and the
    anchor. The caller waits for the stream before it refills them (``batched_copy``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.anchor = torch.empty(ALIGN, dtype=torch.uint8, device=device)
        self.anchor32 = self.anchor.view(torch.int32)  # the kernel addresses int32 words
        self.pinned = torch.empty(0, dtype=torch.int64)
        self.pinned_np = self.pinned.numpy()  # the same memory, written without a tensor view
        self.on_device = torch.empty(0, dtype=torch.int64, device=device)

    def rows(self, rows: np.ndarray, table: str) -> torch.Tensor:
        """The rows where the kernel reads them (enqueues the copy on the current stream). The
        kernel reads only the rows its grid names, so a buffer longer than them is handed over
        whole."""
        n = rows.size
        if self.pinned.numel() < n:
            self.pinned = torch.empty(max(n, 3 << 10), dtype=torch.int64).pin_memory()
            self.pinned_np = self.pinned.numpy()
            self.on_device = torch.empty(self.pinned.numel(), dtype=torch.int64, device=self.device)
        self.pinned_np[:n] = rows.reshape(-1)
        if table == "pinned":
            return self.pinned
        self.on_device[:n].copy_(self.pinned[:n], non_blocking=True)
        return self.on_device


_buffers: dict[tuple[int, int], _Buffers] = {}
_buffers_lock = threading.Lock()


def _buffers_for(device: torch.device, stream: torch.cuda.Stream) -> _Buffers:
    key = (device.index if device.index is not None else -1, id(stream))
    b = _buffers.get(key)
    if b is None:
        with _buffers_lock:
            b = _buffers.setdefault(key, _Buffers(device))
    return b


@dataclass
class Launch:
    """A staged copy: the kernel's operands and grid (``stage``), enqueued by ``launch``."""

    variant: Variant
    rows: torch.Tensor
    anchor: torch.Tensor
    grid: tuple[int, ...]


def stage(
    copies: Sequence[tuple[int, int, int]] | np.ndarray,
    device: torch.device,
    stream: torch.cuda.Stream,
    variant: Variant,
) -> Launch | None:
    """Build the rows and put them where the kernel reads them; call it with ``stream`` current
    (the table's copy is enqueued there). None: nothing to copy (only empty copies)."""
    b = _buffers_for(device, stream)
    rows, grid = kernel_rows(as_table(copies), b.anchor.data_ptr(), variant)
    if 0 in grid:
        return None
    return Launch(variant, b.rows(rows, variant.table), b.anchor32, grid)


def launch(staged: Launch) -> Any:
    """Enqueue the kernel on the current stream; returns Triton's compiled kernel (``.asm``)."""
    v = staged.variant
    block = v.block_bytes // 4
    if v.layout == "chunks":
        return _chunks_kernel[staged.grid](
            staged.rows, staged.anchor, BLOCK=block, CHUNK=v.chunk_bytes // 4, num_warps=v.num_warps
        )
    return _grid2d_kernel[staged.grid](
        staged.rows, staged.anchor, BLOCK=block, ITERS=v.chunk_bytes // v.block_bytes, num_warps=v.num_warps
    )


def batched_copy(
    copies: Sequence[tuple[int, int, int]] | np.ndarray,
    device: torch.device,
    stream: torch.cuda.Stream,
    variant: str | None = None,
) -> None:
    """Enqueue all ``copies`` (src, dst, bytes) as one kernel on ``stream``; the caller waits for
    ``stream`` before calling again with it (the table's buffers are reused). ``variant``: a
    name in ``VARIANTS`` (None: ``DEFAULT_VARIANT``).

    The regions must not overlap (copies run in any order). Raises UnalignedCopyError when a copy is not
    16-byte aligned (nothing is enqueued then; the caller's fallback is one memcpy each)."""
    if len(copies) == 0:
        return
    with torch.cuda.stream(stream):
        staged = stage(copies, device, stream, VARIANTS[variant or DEFAULT_VARIANT])
        if staged is not None:
            launch(staged)
