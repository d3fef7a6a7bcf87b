"""The only contract from the scheduler to the model runner (one per step). No torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.request import Request
from pdserve.kvoffload.spec import KVOffloadSpec
from pdserve.kvtransfer.params import KVLoadSpec


@dataclass(slots=True)
class ScheduledChunk:
    request: Request  # read-only for the runner: token ids, sampling params, seed
    start_pos: int  # first position computed this step (= num_computed_tokens when scheduled)
    num_tokens: int  # tokens computed this step: positions [start_pos, start_pos + num_tokens)
    # The request's whole block table after this step's allocation ('i' array or list; read-only:
    # it is the KV cache manager's own, valid while the step is built)
    block_ids: Sequence[int]
    sample: bool  # the chunk reaches the last known token: sample the next one
    # Draft tokens computed after the last known token (speculative decoding): the chunk's last
    # len(spec_token_ids) positions; each of its 1 + len rows is verified (pdserve.spec_decode)
    spec_token_ids: tuple[int, ...] = ()
    # The block tables of the KV cache groups after the first, when each group has its own
    # (engine/kv_group_tables.py; read-only like block_ids); () when every group reads block_ids
    group_block_ids: tuple[Sequence[int], ...] = ()


@dataclass
class SchedulerOutput:
    step_seq: int  # monotonic; the fence compares against it
    chunks: list[ScheduledChunk] = field(default_factory=list)  # requests computed this step, in batch order
    total_num_scheduled_tokens: int = 0  # sum of chunks' num_tokens (<= the token budget)
    preempted_req_ids: list[str] = field(default_factory=list)  # preempted this step (recompute later)
    finished_req_ids: list[str] = field(
        default_factory=list
    )  # finished since the last step: drop runner state
    kv_loads: list[KVLoadSpec] = field(default_factory=list)  # remote KV pulls to start (decode side)
    # KV offload tier: evicted blocks to copy out and offloaded blocks to load, before the forward
    kv_offload: KVOffloadSpec | None = None

    @property
    def is_empty(self) -> bool:
        return not self.chunks
