"""The KV cache's size in blocks and its zeroed tensors.

    kv_cache_sizes             the budget (engine/kv_sizing.py) over one block's bytes, the
                               same on every TP rank (the smallest)
    zeroed_kv_tensor           torch.zeros on a GPU, lazily zeroed pages on the CPU
    lazily_zeroed_cpu_tensor   a CPU tensor on an anonymous mapping (RAM only for pages touched)

ModelRunner sizes and allocates its cache here; a drafter's KV (spec_decode/drafter.py) and the
CPU offload pool (kvoffload/copier.py) allocate through the same functions.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable

import torch

from pdserve.config.engine import CacheConfig, CacheSizes
from pdserve.distributed.parallel_state import min_over_ranks
from pdserve.engine.kv_sizing import (
    GpuMemory,
    cpu_kv_budget_bytes,
    gpu_kv_budget_bytes,
    mem_available_bytes,
)
from pdserve.errors import ConfigError


def kv_cache_sizes(
    cc: CacheConfig, per_block: int, device: torch.device, gpu_memory: Callable[[], GpuMemory]
) -> CacheSizes:
    """The KV budget (engine/kv_sizing.py) in blocks of ``per_block`` bytes; ``gpu_memory``
    (profile_memory.gpu_memory) is asked only on CUDA without a budget set."""
    if cc.num_blocks_override is not None:
        budget = cc.num_blocks_override * per_block
    elif cc.kv_cache_memory_bytes is not None:
        budget = cc.kv_cache_memory_bytes
    elif device.type == "cuda":
        budget = gpu_kv_budget_bytes(gpu_memory(), cc.gpu_memory_utilization)
    else:
        budget = cpu_kv_budget_bytes(mem_available_bytes())
    num_blocks = budget // per_block
    # Every TP rank must schedule the same blocks: free memory may differ between GPUs.
    num_blocks = min_over_ranks(num_blocks, device)
    if num_blocks < 1:
        raise ConfigError(
            f"the KV cache budget ({budget} bytes) holds no block ({per_block} bytes each); "
            "raise kv_cache_memory_bytes"
        )
    return CacheSizes(num_blocks, cc.block_size, per_block, budget_bytes=budget)


def lazily_zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor on an anonymous memory mapping: the kernel hands out zero pages
    on first touch, so a 4 GiB KV cache costs RAM only for the blocks requests use (torch.zeros
    writes every page up front: ~4 GiB resident and seconds of start-up)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor keeps ``buf`` alive (frombuffer holds a reference to the buffer's owner)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def zeroed_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV cache tensor: lazily zeroed pages on the CPU, ``torch.zeros`` elsewhere."""
    if device.type == "cpu":
        return lazily_zeroed_cpu_tensor(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)
