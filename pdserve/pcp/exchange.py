"""The PCP ranks' collectives: the process group, the per-layer K/V exchange, the output gather.

The ranks form the default ``torch.distributed`` group (gloo on CPU, NCCL on CUDA; the TP group
of ``pdserve.distributed.parallel_state`` stays unset: PCP runs with tp 1). Both collectives are
all-gathers of row blocks padded to the longest rank's (NCCL gathers equal sizes only).

K/V: all-gather, not a ring. Every rank keeps the whole prompt's K/V in its own cache (decode then
runs on any rank without gathering, and the P/D transfer pushes rank 0's cache as at pcp 1), so
each rank needs every other rank's split tokens anyway; a ring's gain, overlapping each hop with
attention over the block that arrived, needs attention split per KV block with an online-softmax
merge, which the paged attention paths here do not do. One all-gather per layer of
[tokens, 2, kv_heads, head_dim] is the whole exchange.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pdserve.distributed.parallel_state import join_group
from pdserve.pcp.index_map import StepPlan


def init_pcp_group(world_size: int, rank: int, init_method: str, backend: str, timeout_s: float) -> None:
    """Join the PCP ranks' group (blocks until all ``world_size`` ranks joined); the TP size
    stays 1, so the model is not sharded."""
    assert not dist.is_initialized(), "a torch.distributed group is already initialised in this process"
    join_group(world_size, rank, init_method, backend, timeout_s)


def destroy_pcp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_gather_rows(rows: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """Every rank's ``rows`` ([counts[rank], ...]), in rank order, on every rank."""
    longest = max(counts)
    buf = rows.new_zeros((longest, *rows.shape[1:]))
    buf[: rows.shape[0]] = rows
    parts = [torch.empty_like(buf) for _ in counts]
    dist.all_gather(parts, buf)
    return [p[:n] for p, n in zip(parts, counts, strict=True)]


class KVExchange:
    """``AttentionMetadata.kv_exchange`` of a split step: called by every attention layer once
    its local tokens' K/V are stored, it sends this rank's split tokens' K/V (read back from the
    cache) and writes the other ranks' into their slots, so attention then reads the whole
    chunk. ``calls`` counts the layers that exchanged (the runner checks it against its layers:
    a model family that stores K/V without ``rotary_and_store_kv`` would otherwise attend to
    missing keys)."""

    def __init__(self, plan: StepPlan, rank: int, slot_mapping: torch.Tensor, block_size: int) -> None:
        device = slot_mapping.device
        self.rank = rank
        self.counts = [len(rows) for rows in plan.split_rows]

        def blocks_and_offsets(rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            slots = slot_mapping[torch.tensor(rows, dtype=torch.int64, device=device)]
            return slots // block_size, slots % block_size

        self.send = blocks_and_offsets(list(plan.split_rows[rank]))
        foreign = [row for r, rows in enumerate(plan.split_rows) if r != rank for row in rows]
        self.recv = blocks_and_offsets(foreign)
        self.calls = 0

    def __call__(self, kv_cache: torch.Tensor) -> None:
        """kv_cache: one layer's view [num_blocks, 2, block_size, num_kv_heads, head_dim]."""
        self.calls += 1
        blocks, offsets = self.send
        mine = kv_cache[blocks, :, offsets]  # [m, 2, Hkv, D]
        parts = all_gather_rows(mine, self.counts)
        others = torch.cat([p for r, p in enumerate(parts) if r != self.rank])  # [sum of others, 2, Hkv, D]
        blocks, offsets = self.recv
        kv_cache[blocks, :, offsets] = others


def gather_output(
    plan: StepPlan, rank: int, local: torch.Tensor, rows: list[int], needed: list[int]
) -> torch.Tensor:
    """The step's hidden states in global row order ([plan.num_tokens, hidden]) holding this
    rank's rows and the ``needed`` global rows (sampled, prompt logprobs) wherever computed,
    identical on every rank; other rows are zero and never read.

    ``local``: this rank's hidden states, [len(rows), hidden], ``rows`` their global rows."""
    out = local.new_zeros((plan.num_tokens, local.shape[1]))
    device = local.device
    out[torch.tensor(rows, dtype=torch.int64, device=device)] = local
    sent = plan.gathered_rows(needed)
    counts = [len(r) for r in sent]
    if max(counts) == 0:  # every needed row is replicated: local everywhere
        return out
    view = plan.views[rank]
    mine = local[torch.tensor([view.local_row(r) for r in sent[rank]], dtype=torch.int64, device=device)]
    for r, part in enumerate(all_gather_rows(mine, counts)):
        if r != rank and counts[r]:
            out[torch.tensor(sent[r], dtype=torch.int64, device=device)] = part
    return out
