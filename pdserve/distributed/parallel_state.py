"""The tensor-parallel group of this process: one ``torch.distributed`` group, world = TP ranks.

Process-wide state, as in vLLM: model code asks ``tp_size()`` / ``tp_rank()`` at construction
and calls ``all_reduce`` in row-parallel layers. Without ``init_tp`` (the TP 1 default) every
call is a no-op, so single-process code never touches ``torch.distributed``.

Backend: ``nccl`` on CUDA, ``gloo`` on CPU (``workers.dist_backend``); the same code runs on both.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

_TP_SIZE = 1
_TP_RANK = 0


def init_tp(world_size: int, rank: int, init_method: str, backend: str, timeout_s: float = 300.0) -> None:
    """Join the TP group (blocks until all ``world_size`` ranks have joined)."""
    global _TP_SIZE, _TP_RANK
    assert world_size >= 1 and 0 <= rank < world_size, (world_size, rank)
    assert _TP_SIZE == 1, "the TP group is already initialised in this process"
    if world_size > 1:
        join_group(world_size, rank, init_method, backend, timeout_s)
    _TP_SIZE, _TP_RANK = world_size, rank


def join_group(world_size: int, rank: int, init_method: str, backend: str, timeout_s: float) -> None:
    """Join this process's ``torch.distributed`` group (blocks until all ``world_size`` ranks
    joined; ``timeout_s`` also bounds each collective). TP ranks and prefill context parallel
    ranks (``pdserve.pcp``, which leave the TP size at 1) both join through here."""
    dist.init_process_group(
        backend,
        init_method=init_method,
        world_size=world_size,
        rank=rank,
        timeout=timedelta(seconds=timeout_s),
    )


def destroy_tp() -> None:
    """Leave the TP group; ``tp_size()`` is 1 again afterwards."""
    global _TP_SIZE, _TP_RANK
    if _TP_SIZE > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _TP_SIZE, _TP_RANK = 1, 0


def tp_size() -> int:
    return _TP_SIZE


def tp_rank() -> int:
    return _TP_RANK


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over the TP ranks, in place (every rank gets the same bits); no-op at TP 1."""
    if _TP_SIZE > 1:
        dist.all_reduce(t)
    return t


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest ``value`` over the TP ranks (e.g. KV blocks that fit on every GPU)."""
    if _TP_SIZE == 1:
        return value
    # NCCL reduces device tensors only; gloo host tensors.
    t = torch.tensor([value], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
