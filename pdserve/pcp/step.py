"""One PCP rank's forward of a global step: ``ModelRunner.launch`` hands it the global inputs.

    global step (every rank builds it: token ids, positions, slots, AttentionMetadata)
        | plan_step: this rank's rows and attention segments (index_map.py)
    local forward: input_ids[rows], positions[rows], a local AttentionMetadata of segments,
        each layer: store own K/V -> KVExchange (all-gather the split tokens' K/V) -> attend
        | gather_output: the sampled / scored rows from the ranks that computed them
    global hidden states [num_tokens, hidden]: sampling and prompt logprobs run on them as at pcp 1

A step with nothing split (decode, short prompts) runs the model on the global inputs unchanged.
``run_split`` is the split itself, for any forward whose attention stores K/V through
``rotary_and_store_kv``: the target's step here, an MTP module's rows after it
(spec_decode/mtp_drafter.py), a draft model's first catch-up (spec_decode/draft_model.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.engine.prompt_logprobs import prompt_logprob_spans
from pdserve.models.attention import AttentionMetadata
from pdserve.pcp.exchange import KVExchange, gather_output
from pdserve.pcp.index_map import StepPlan, plan_step

if TYPE_CHECKING:
    from pdserve.engine.host_batch import HostBatch
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.scheduler_output import SchedulerOutput


class ContextParallel:
    """A runner's PCP rank (``ModelRunner.pcp``): rank ``rank`` of ``size``. Counts the steps
    it split and the prompt tokens it computed itself (a rank's share, for tests and benches)."""

    def __init__(self, rank: int, size: int) -> None:
        assert 0 <= rank < size, (rank, size)
        self.rank, self.size = rank, size
        self.num_split_steps = 0
        self.num_split_tokens = 0  # split-chunk tokens this rank computed
        # Global rows of the last target step whose hidden states this rank holds (its own and
        # the gathered ones); None: every row (nothing was split). An MTP module reads them.
        self.hidden_rows: frozenset[int] | None = None

    def forward(
        self,
        runner: ModelRunner,
        sched: SchedulerOutput,
        batch: HostBatch,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        embeds: torch.Tensor | None,
    ) -> torch.Tensor:
        """The step's last hidden states, [batch.num_tokens, hidden] in global row order (rows
        that are neither this rank's, sampled nor scored are zero)."""

        def run(rows: torch.Tensor | None, m: AttentionMetadata) -> torch.Tensor:
            if rows is None:
                out = runner.model(input_ids, positions, runner.layer_caches, m, inputs_embeds=embeds)
            else:
                local_embeds = embeds[rows] if embeds is not None else None
                out = runner.model(
                    input_ids[rows], positions[rows], runner.layer_caches, m, inputs_embeds=local_embeds
                )
            assert isinstance(out, torch.Tensor)
            return out

        needed = list(batch.sample_idx)
        for span in prompt_logprob_spans(sched):
            needed.extend(range(span.row, span.row + len(span.target_ids)))
        out, plan = self.run_split(batch, meta, runner.block_size, run, needed, runner.num_local_layers)
        self.hidden_rows = None
        if plan.is_split:
            view = plan.views[self.rank]
            self.num_split_steps += 1
            self.num_split_tokens += len(view.send_rows)
            self.hidden_rows = frozenset(view.token_rows).union(needed)
        return out

    def run_split(
        self,
        batch: HostBatch,
        meta: AttentionMetadata,
        block_size: int,
        forward: Callable[[torch.Tensor | None, AttentionMetadata], torch.Tensor],
        needed: list[int],
        num_layers: int,
    ) -> tuple[torch.Tensor, StepPlan]:
        """One forward of a global batch (the target's step, a drafter's rows) split as
        ``plan_step`` splits it, and its plan. ``forward(rows, meta)`` runs the model on the
        global token rows ``rows`` (None: all of them) with ``meta``; its ``num_layers``
        attention layers store K/V through ``rotary_and_store_kv``, which exchanges the split
        tokens' K/V. Returns the hidden states in global row order: this rank's rows and the
        ``needed`` rows (gathered from their owners; identical on every rank), zero elsewhere."""
        plan = plan_step(batch.query_lens, batch.seq_lens, self.size, block_size)
        if not plan.is_split:
            return forward(None, meta), plan
        view = plan.views[self.rank]
        rows = torch.tensor(view.token_rows, dtype=torch.int64, device=meta.slot_mapping.device)
        exchange = KVExchange(plan, self.rank, meta.slot_mapping, block_size)
        local_meta = local_metadata(plan, self.rank, meta, rows)
        local_meta.kv_exchange = exchange
        out = forward(rows, local_meta)
        assert exchange.calls == num_layers, (
            f"{exchange.calls} of {num_layers} layers exchanged their K/V: the model's "
            "attention must store K/V through kv_store.rotary_and_store_kv"
        )
        return gather_output(plan, self.rank, out, list(view.token_rows), needed), plan


def local_metadata(
    plan: StepPlan, rank: int, meta: AttentionMetadata, rows: torch.Tensor
) -> AttentionMetadata:
    """``meta`` (the global step's) cut to rank ``rank``'s tokens: one attention row per segment
    (query positions [start, end), sequence length end, its request's block table)."""
    segments = plan.views[rank].segments
    query_lens = [s.num_tokens for s in segments]
    seq_lens = [s.end for s in segments]
    device = meta.slot_mapping.device
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    lens = torch.tensor(seq_lens + starts, dtype=torch.int32, device=device)
    seqs = torch.tensor([s.seq for s in segments], dtype=torch.int64, device=device)
    return AttentionMetadata(
        num_tokens=len(rows),
        slot_mapping=meta.slot_mapping[rows],
        query_start_loc=lens[len(seq_lens) :],
        seq_lens=lens[: len(seq_lens)],
        block_tables=meta.block_tables.index_select(0, seqs),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=meta.block_size,
        backend=meta.backend,
    )
