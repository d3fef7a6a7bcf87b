"""The scheduler's side of speculative decoding (ints and ids only, no torch).

A decode row (gap 1: only its last token lacks KV) that holds drafts is scheduled as one chunk of
1 + m tokens, m <= k:

    positions   p          p+1   ...   p+m          p = num_tokens - 1 (the last known token)
    input       t_last     d_1   ...   d_m          KV slots allocated for all 1 + m
    logits      -> x_1     -> x_2 ...  -> x_{m+1}   verified: d_1..d_a accepted, then one more

After the step (``apply``) the request holds a + 1 new tokens (d_1..d_a and the correction or
bonus token), ``num_computed_tokens`` is rolled back to p + a + 1 (the KV of rejected drafts is
garbage, overwritten later), the blocks past ``num_tokens`` are returned to the pool, and only
blocks whose every position holds verified KV enter the prefix cache. Tokens are appended one
at a time through the stop checks, so eos, stop token ids and ``max_tokens`` end the request at
the exact token (drafts are also capped so a step never passes ``max_tokens`` or
``max_model_len``).

Rows with a structured-output grammar are never drafted (speculation is refused per request:
they decode one token per step as without speculation).

Who drafts: the n-gram proposer here, in ``propose`` (before the scheduler); a drafter with
weights (draft model, MTP: spec_decode/drafter.py) gets m placeholders in ``propose`` and writes
its drafts into the scheduled chunks in ``fill_drafts`` (after the scheduler allocated the
slots its own KV writes need).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from pdserve.config.speculative import SpeculativeConfig
from pdserve.engine.request import Request
from pdserve.engine.schedule_ahead import check_stop
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pdserve.spec_decode.ngram import NgramProposer
from pdserve.spec_decode.stats import SpecDecodeStats

if TYPE_CHECKING:
    from pdserve.engine.scheduler import Scheduler

# The token a drafted row holds between the scheduler and the drafter (``fill_drafts``): a
# drafter with weights drafts after the scheduler allocated the row's slots.
DRAFT_PLACEHOLDER = 0


class ModelDrafter(Protocol):
    """A drafter with weights (spec_decode/drafter.py), as the scheduling side calls it."""

    def can_draft(self, req: Request) -> bool: ...

    def draft(self, chunks: list[ScheduledChunk]) -> None: ...

    def after_step(
        self,
        sched: SchedulerOutput,
        sampled: dict[str, int],
        spec_sampled: dict[str, list[int]],
        drafting_off: bool,
    ) -> None: ...

    def drop(self, request_ids: Iterable[str]) -> None: ...


class SpecScheduling:
    """Drafts for the running rows, and the bookkeeping of a verified step. Mutates requests'
    ``spec_token_ids``, counters and token lists, and (through the scheduler) their blocks."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, drafter: ModelDrafter | None = None
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config)
        self.drafter = drafter  # None: n-gram drafts, proposed here
        self.stats = SpecDecodeStats()
        self.num_steps_off = 0  # steps without drafts because of disable_by_batch_size
        self.drafting_off = False  # this step has none for that reason

    def max_drafts(self, req: Request) -> int:
        """Drafts the request may take this step: k, less what would pass max_tokens or
        max_model_len (a step emits up to drafts + 1 tokens)."""
        sp = req.sampling_params
        m = self.config.num_speculative_tokens
        if sp.max_tokens is not None:
            m = min(m, sp.max_tokens - len(req.output_token_ids) - 1)
        return min(m, self.max_model_len - req.num_tokens - 1)

    def propose(self, running: list[Request]) -> None:
        """Draft for every running decode row (called before ``Scheduler.schedule``); none from
        ``disable_by_batch_size`` running requests on."""
        off = self.config.disable_by_batch_size
        self.drafting_off = off is not None and len(running) >= off
        if self.drafting_off:
            for req in running:
                req.spec_token_ids = []
            self.num_steps_off += 1
            return
        for req in running:
            req.spec_token_ids = []
            if (
                req.num_output_placeholders
                or req.num_computed_tokens != req.num_tokens - 1
                or req.num_computed_tokens < req.num_prompt_tokens
            ):
                continue  # still prefilling (the last prompt token too), or a token in flight
            if req.sampling_params.structured is not None:
                continue  # grammar rows decode without drafts
            m = self.max_drafts(req)
            if m <= 0:
                continue
            if self.drafter is None:
                req.spec_token_ids = self.proposer.propose(req.prompt_token_ids + req.output_token_ids, m)
            elif self.drafter.can_draft(req):
                req.spec_token_ids = [DRAFT_PLACEHOLDER] * m  # drafted by fill_drafts

    def fill_drafts(self, sched: SchedulerOutput) -> None:
        """After the scheduler, before the target's forward: a drafter with weights replaces the
        scheduled rows' placeholders with its drafts (their slots are allocated now)."""
        if self.drafter is None:
            return
        self.drafter.drop(sched.preempted_req_ids)  # their blocks are gone: state from 0 again
        chunks = [c for c in sched.chunks if c.spec_token_ids]
        if chunks:
            self.drafter.draft(chunks)

    def after_step(
        self, sched: SchedulerOutput, sampled: dict[str, int], spec_sampled: dict[str, list[int]]
    ) -> None:
        """A step's tokens are on the host (before ``update_from_output``): MTP computes its KV
        from the target's hidden states here (for prompts always; for decode rows only while
        drafting is on, so a loaded node switched off by ``disable_by_batch_size`` does not pay
        for it)."""
        if self.drafter is not None:
            self.drafter.after_step(sched, sampled, spec_sampled, self.drafting_off)

    @staticmethod
    def num_drafts(req: Request, gap: int, budget: int) -> int:
        """How many of the request's drafts the scheduler takes this step (within ``budget``)."""
        if gap != 1 or not req.spec_token_ids:
            return 0
        return max(0, min(len(req.spec_token_ids), budget - 1))

    def apply(self, sched: Scheduler, req: Request, chunk: ScheduledChunk, tokens: list[int]) -> None:
        """A verified chunk's emitted ``tokens`` (accepted drafts + one): see the module docstring."""
        drafts = chunk.spec_token_ids
        num_accepted = len(tokens) - 1
        assert 0 <= num_accepted <= len(drafts) and list(drafts[:num_accepted]) == tokens[:-1], (
            req.request_id,
            drafts,
            tokens,
        )
        self.stats.observe(len(drafts), num_accepted)
        status = None
        for token in tokens:
            req.output_token_ids.append(token)
            status = check_stop(req, token, sched.max_model_len)
            if status is not None:
                break
        # Positions p .. p + a hold verified KV; a stop may have cut the tokens before that.
        req.num_computed_tokens = min(chunk.start_pos + 1 + num_accepted, req.num_tokens - 1)
        kv = sched.kv
        if kv.enable_prefix_caching:
            kv.cache_computed_blocks(req, req.num_computed_tokens)
        kv.trim(req.request_id, req.num_tokens)
        req.spec_token_ids = []
        if status is not None:
            sched.finish_request(req.request_id, status)
