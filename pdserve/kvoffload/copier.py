"""The offload tier's worker side: copies between device KV blocks and the host pool.

The host pool is ``[num_slots, bytes_per_block]`` uint8 (pinned on CUDA; on a CPU an anonymous
mapping touched on first use). A block of the runner's cache ``kv_cache[block_id]`` is one
contiguous run of bytes (every local layer's K and V), so each copy is one block-sized memcpy.

On CUDA, stores (device -> host) run on a side stream after the work queued so far, and the
step's stream waits for them before its forward overwrites the evicted blocks; the host never
blocks for them (``wait_stores`` does, when the scheduler side reads a slot to write it to disk).
Loads (host -> device) are queued on the step's stream ahead of its forward; the host slots they
read stay pinned until that step completed (``KVOffloadManager``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pdserve.engine.host_batch import wait_event
from pdserve.engine.kv_tensors import lazily_zeroed_cpu_tensor
from pdserve.kvoffload.spec import KVOffloadSpec


class KVOffloadCopier:
    def __init__(
        self, kv_cache: torch.Tensor, num_slots: int, timeout_s: float, pool: torch.Tensor | None = None
    ) -> None:
        """``pool``: this stage's columns of a shared pool (``shared_pool``), else one of its own."""
        assert kv_cache.is_contiguous()
        num_blocks = kv_cache.shape[0]
        self.kv_bytes = kv_cache.view(torch.uint8).view(num_blocks, -1)  # [num_blocks, bytes_per_block]
        self.block_bytes = self.kv_bytes.shape[1]
        self.device = kv_cache.device
        self.timeout_s = timeout_s
        shape = (num_slots, self.block_bytes)
        self.stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
        if pool is not None:
            assert tuple(pool.shape) == shape and pool.stride(1) == 1, (tuple(pool.shape), shape)
            self.pool = pool
        elif self.device.type == "cuda":
            self.pool = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        else:
            self.pool = lazily_zeroed_cpu_tensor(shape, torch.uint8)
        self._store_event: torch.cuda.Event | None = None

    def buffer(self) -> memoryview:
        """The pool's bytes for the scheduler side (``HostTier``); a pool of its own only."""
        assert self.pool.is_contiguous()
        array: Any = self.pool.numpy()  # shares the pool's memory
        return memoryview(array).cast("B")

    @torch.inference_mode()
    def execute(self, spec: KVOffloadSpec) -> float:
        """Queue the step's copies (stores first); returns the loads' seconds on the host."""
        pool, kv = self.pool, self.kv_bytes
        if spec.stores:
            if self.stream is not None:
                main = torch.cuda.current_stream(self.device)
                self.stream.wait_stream(main)
                with torch.cuda.stream(self.stream):
                    for block_id, slot in spec.stores:
                        pool[slot].copy_(kv[block_id], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
                main.wait_event(ev)  # the forward overwrites these blocks
                self._store_event = ev
            else:
                for block_id, slot in spec.stores:
                    pool[slot].copy_(kv[block_id])
        if not spec.loads:
            return 0.0
        t0 = time.perf_counter()
        for block_id, slot in spec.loads:
            kv[block_id].copy_(pool[slot], non_blocking=self.stream is not None)
        return time.perf_counter() - t0

    def wait_stores(self) -> None:
        """Block until every queued store is in the host pool (on CUDA; a no-op on a CPU)."""
        ev, self._store_event = self._store_event, None
        if ev is not None:
            wait_event(ev, self.timeout_s, "a KV offload store")
