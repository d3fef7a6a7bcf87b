"""services/memwatch.py: the KV cache's resident bytes (mincore) and the malloc arena cap."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_tensors import lazily_zeroed_cpu_tensor
from pdserve.errors import ConfigError
from services.memwatch import ARENA_MAX_DEFAULT, configure_malloc, resident_bytes, tracemalloc_every_s


def test_resident_bytes_counts_the_pages_touched() -> None:
    kv = lazily_zeroed_cpu_tensor((256, 4096), torch.float32)  # 4 MiB, no page touched yet
    nbytes = kv.numel() * kv.element_size()
    assert resident_bytes(kv.data_ptr(), nbytes) == 0
    kv[:16] = 1.0  # 16 rows of 16 KiB: 64 pages
    assert resident_bytes(kv.data_ptr(), nbytes) == 16 * 4096 * 4
    assert resident_bytes(kv[8:].data_ptr(), 4096 * 4) == 4096 * 4  # a sub-range


def test_malloc_arena_cap_from_the_environment_or_the_default() -> None:
    assert configure_malloc({"MALLOC_ARENA_MAX": "4"}) == 4  # glibc applied it: left as is
    assert configure_malloc({}) == ARENA_MAX_DEFAULT
    with pytest.raises(ConfigError, match="MALLOC_ARENA_MAX='two'"):
        configure_malloc({"MALLOC_ARENA_MAX": "two"})


def test_tracemalloc_period_is_refused_unless_positive(monkeypatch) -> None:
    monkeypatch.delenv("PDSERVE_TRACEMALLOC_EVERY_S", raising=False)
    assert tracemalloc_every_s() is None
    monkeypatch.setenv("PDSERVE_TRACEMALLOC_EVERY_S", "30")
    assert tracemalloc_every_s() == 30.0
    for bad in ("0", "soon"):
        monkeypatch.setenv("PDSERVE_TRACEMALLOC_EVERY_S", bad)
        with pytest.raises(ConfigError, match="PDSERVE_TRACEMALLOC_EVERY_S"):
            tracemalloc_every_s()
