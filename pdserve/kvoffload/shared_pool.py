"""The host pool of a pipeline-parallel engine's offload tier, shared by its stage processes.

One pool row per host slot holds one block of every stage's layers, stage by stage::

    row (slot s):  | stage 0's layers' K/V | stage 1's | ... |     row_bytes = sum(widths)

Each stage's copier copies between its own KV cache and its own column range of the rows; the
scheduler side (stage 0's process) indexes the rows, reads and writes whole rows for the disk
tier. A block is therefore held by every stage or by none (one index, one slot per block).

The pool is a file in ``/dev/shm`` (the temporary folder if there is none) mapped by every
stage; the engine removes its name once every stage mapped it, so nothing outlives the
processes. On CUDA each process page-locks the mapping (``cudaHostRegister``) so copies are DMA.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from pdserve.errors import ConfigError


def _folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def create_pool_file(num_slots: int, row_bytes: int) -> str:
    """A new sparse file of ``num_slots * row_bytes`` bytes (pages are taken on first touch)."""
    assert num_slots > 0 and row_bytes > 0
    fd, path = tempfile.mkstemp(prefix="pdserve-kvpool-", dir=_folder())
    try:
        os.ftruncate(fd, num_slots * row_bytes)
    finally:
        os.close(fd)
    return path


def map_pool(path: str, num_slots: int, row_bytes: int, device: torch.device) -> torch.Tensor:
    """``[num_slots, row_bytes]`` uint8 over the file at ``path`` (page-locked on CUDA)."""
    size = num_slots * row_bytes
    if os.path.getsize(path) != size:
        raise ConfigError(
            f"kv_offload: the shared host pool {path} has {os.path.getsize(path)} bytes, expected {size}"
        )
    pool = torch.from_file(path, shared=True, size=size, dtype=torch.uint8).view(num_slots, row_bytes)
    if device.type == "cuda":
        err = torch.cuda.cudart().cudaHostRegister(pool.data_ptr(), size, 0)
        if int(err) != 0:
            raise ConfigError(
                f"kv_offload: page-locking the {size}-byte shared host pool failed (cudaError {int(err)}); "
                "lower kv_offload.cpu_bytes or raise the locked-memory limit (ulimit -l)"
            )
    return pool


def pool_buffer(pool: torch.Tensor) -> memoryview:
    """The whole pool's bytes for the scheduler side (``HostTier``)."""
    assert pool.is_contiguous()
    array: Any = pool.numpy()  # shares the mapping
    return memoryview(array).cast("B")


def stage_columns(widths: list[int]) -> list[tuple[int, int]]:
    """Each stage's [start, end) bytes of a row; they tile the row in stage order."""
    out, start = [], 0
    for w in widths:
        assert w > 0, widths
        out.append((start, start + w))
        start += w
    return out
