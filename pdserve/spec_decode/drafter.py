"""Drafters with weights (``draft_model``, ``mtp``): their KV, their batches, the step hooks.

A drafter runs in the model runner's process and device. Its KV is one tensor of its own,

    kv_cache: [num_blocks, num_draft_layers, 2, block_size, num_kv_heads_d, head_dim_d]

indexed by the target's block ids: a request's block table serves both, so a block holds the
target's and the drafter's KV of the same positions, the scheduler and the block pool see one
KV cache group, and the KV budget counts both (``ModelRunner.determine_cache_sizes``).

Drafting runs after the scheduler and before the target's forward (``LLMEngine.step`` ->
``SpecScheduling.fill_drafts`` -> ``draft``): the scheduler has allocated the 1 + m slots of
every drafted row (positions p .. p + m, p = num_tokens - 1), so the drafter's KV writes at draft
positions land in the request's own blocks:

    positions          ... p-1 | p      | p+1 | ... | p+m-1 | p+m
    target this step           | t_last | d_1 | ... | d_m-1 | d_m    (verified)
    draft model writes  catch-up ..p    | d_1 | ... | d_m-1 |        (d_m is never fed)
    MTP writes          (after the step) .. p-1 | d_1 ... d_m-2       (see mtp_drafter.py)

KV a drafter wrote for drafts that were rejected is garbage past the verified length, as the
target's is; the next catch-up overwrites it. Drafts are greedy (argmax) from a deterministic
drafter, which is what verification assumes (``verify.py``: a point-mass draft).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve import kernels
from pdserve.config.engine import EngineConfig
from pdserve.engine.host_batch import HostBatch, PinnedStaging, batch_to_device, extend_slots
from pdserve.engine.kv_tensors import zeroed_kv_tensor
from pdserve.engine.request import Request
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pdserve.models.attention import AttentionMetadata
from pdserve.models.attention_backend import select_attention_backend

if TYPE_CHECKING:
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.kvtransfer.regions import Region


# ``Drafter.after_step_peers(sampled, spec_sampled, drafting_off)``: after_step's arguments
# besides the step, which the peers already ran.
AfterStepPeers = Callable[[dict[str, int], dict[str, list[int]], bool], None]
# ``Drafter.split_peers(rows)``: the worker ranks start the same split forward over ``rows``
# (``Drafter.peer_forward``); the context holds rank 0's own part of it.
SplitPeers = Callable[[list["DraftRow"]], AbstractContextManager[None]]


@dataclass
class DraftRow:
    """One request's tokens fed to a drafter forward: positions [start, start + len(token_ids))."""

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]


def draft_host_batch(rows: Sequence[DraftRow], block_size: int) -> HostBatch:
    """The host inputs of a drafter forward; the last row of every request samples."""
    token_ids, positions, slots = array("q"), array("q"), array("q")
    query_lens: list[int] = []
    seq_lens: list[int] = []
    sample_idx: list[int] = []
    width = max(len(r.block_ids) for r in rows)
    table = array("i")
    for r in rows:
        n = len(r.token_ids)
        assert n > 0 and r.start + n <= len(r.block_ids) * block_size, (r.start, n, len(r.block_ids))
        token_ids.extend(r.token_ids)
        positions.extend(range(r.start, r.start + n))
        extend_slots(slots, r.block_ids, r.start, r.start + n, block_size)
        query_lens.append(n)
        seq_lens.append(r.start + n)
        sample_idx.append(len(token_ids) - 1)
        table.extend(r.block_ids)
        table.extend([0] * (width - len(r.block_ids)))
    return HostBatch(token_ids, positions, slots, query_lens, seq_lens, table, width, sample_idx)


class Drafter:
    """A drafter's KV tensor and inputs; subclasses draft. Per-request state is dropped by
    ``drop`` (finished, aborted, preempted requests): the runner calls it with the ids it forgets."""

    # Layer names of the drafter's KV that a P/D transfer moves (MTP); () when the decode node
    # rebuilds the drafter's state itself (draft model).
    transfer_layer_names: tuple[str, ...] = ()

    def __init__(
        self,
        runner: ModelRunner,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        self.runner = runner
        self.device, self.dtype, self.block_size = runner.device, runner.dtype, runner.block_size
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.attn_backend = select_attention_backend(
            self.device, self.dtype, num_heads, num_kv_heads, head_dim
        )
        self.staging = PinnedStaging(self.device, timeout_s=runner.config.step_timeout_s)
        self.kv_cache: torch.Tensor | None = None
        self.layer_caches: list[torch.Tensor] = []
        self.num_forwards = 0  # drafter forwards run (a bench / test counter)
        # Told first by ``after_step`` where other processes run it too (PCP rank 0 tells its
        # worker ranks the step's tokens: pdserve/pcp/runner.py); None on a single runner.
        self.after_step_peers: AfterStepPeers | None = None
        # Entered around a forward split over the PCP ranks on rank 0 (the workers run
        # ``peer_forward`` on the same rows: pdserve/pcp/runner.py); None elsewhere.
        self.split_peers: SplitPeers | None = None

    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def init_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = zeroed_kv_tensor(shape, self.dtype, self.device)
        self.layer_caches = [self.kv_cache[:, i] for i in range(self.num_layers)]

    def kv_regions(self) -> list[Region]:
        """The regions a P/D transfer moves (``transfer_layer_names``; none for a draft model)."""
        if not self.transfer_layer_names:
            return []
        from pdserve.kvtransfer.regions import regions_for_kv_cache

        assert self.kv_cache is not None
        return regions_for_kv_cache(
            self.kv_cache.data_ptr(),
            self.kv_cache.shape[0],
            list(self.transfer_layer_names),
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.kv_cache.element_size(),
        )

    def inputs(
        self, rows: Sequence[DraftRow]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, HostBatch]:
        """(input ids, positions, metadata, index of each request's last row) on the device, and
        the host batch they came from."""
        self.staging.begin_step()
        batch = draft_host_batch(rows, self.block_size)
        input_ids, positions, meta = batch_to_device(batch, self.staging, self.block_size, self.attn_backend)
        last = self.staging.to_device(array("q", batch.sample_idx), torch.int64)
        self.staging.end_step()
        self.num_forwards += 1
        return input_ids, positions, meta, last, batch

    @staticmethod
    def argmax(logits: torch.Tensor) -> list[int]:
        return [int(t) for t in kernels.argmax_rows(logits).tolist()]

    # -- hooks (SpecScheduling) -------------------------------------------------------------
    def can_draft(self, req: Request) -> bool:
        """Whether the request's drafter state lets it draft this step."""
        raise NotImplementedError

    def draft(self, chunks: list[ScheduledChunk]) -> None:
        """Replace each chunk's placeholder drafts (its ``spec_token_ids``, m of them) with the
        drafter's m greedy tokens, in the chunk and in its request."""
        raise NotImplementedError

    def keep_hidden(self, hidden: torch.Tensor) -> None:
        """The target's hidden states of the step just launched ([num_tokens, hidden])."""

    def after_step(
        self,
        sched: SchedulerOutput,
        sampled: dict[str, int],
        spec_sampled: dict[str, list[int]],
        drafting_off: bool,
    ) -> None:
        """A target step completed (its tokens on the host, not yet in the requests);
        ``drafting_off``: the step ran without drafts because of ``disable_by_batch_size``."""

    def drop(self, request_ids: Iterable[str]) -> None:
        raise NotImplementedError

    def peer_forward(self, rows: list[DraftRow]) -> None:
        """A PCP worker rank's part of a forward that rank 0 split over the ranks (``split_peers``)."""
        raise NotImplementedError(f"{type(self).__name__} runs no forward split by rank 0")


def set_drafts(chunk: ScheduledChunk, drafts: list[int]) -> None:
    assert len(drafts) == len(chunk.spec_token_ids), (chunk.request.request_id, drafts)
    chunk.spec_token_ids = tuple(drafts)
    chunk.request.spec_token_ids = list(drafts)


def make_drafter(config: EngineConfig, runner: ModelRunner) -> Drafter | None:
    """The drafter ``config.speculative`` names (None for n-gram or no speculation, and on a TP
    rank or pipeline stage, where ``spec_decode.engine`` refuses speculation at start). Under
    prefill context parallelism every rank makes it: an MTP module's KV is written from the
    target's hidden states, which a split prefill leaves spread over the ranks, and a draft
    model's first catch-up over a long prompt is split over the ranks as the target's prefill
    was (pdserve/pcp/runner.py); drafts are made on rank 0 and reach the other ranks inside the
    step that verifies them."""
    spec = config.speculative
    if spec is None or spec.method == "ngram":
        return None
    from pdserve.distributed.parallel_state import tp_size

    if tp_size() > 1 or not (runner.model.is_first_stage and runner.model.is_last_stage):
        return None
    if spec.method == "draft_model":
        from pdserve.spec_decode.draft_model import DraftModelDrafter

        return DraftModelDrafter(runner, spec)
    from pdserve.spec_decode.mtp_drafter import MTPDrafter

    return MTPDrafter(runner)
