"""Continuous batching with chunked prefill, prefix hits, preemption by recompute. No torch.

One step:  schedule() -> SchedulerOutput -> (model runner) -> update_from_output().

Running requests are served first (each gets up to its gap ``num_tokens - num_computed``
within the token budget), then waiting ones are admitted in policy order (``waiting_queue``).
When a running request cannot get a block, the lowest-ranked running request is preempted
(``preemption``: its blocks freed, its counter reset to 0) — unless its blocks cannot be
freed *now* (an in-flight step or transfer may still write them): then scheduling stops for
this step before touching any state (docs/design.md §4: zero progress, zero side effects).

``schedule()`` advances each scheduled request's ``num_computed_tokens`` at once, and counts
a token it will sample as a placeholder, so the next step can be scheduled while this one
still runs on the GPU (asynchronous scheduling, ``LLMEngine``; ``schedule_ahead``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from pdserve.config.engine import SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.preemption import pick_victim, preempt
from pdserve.engine.remote_kv import hold_for_transfer
from pdserve.engine.request import Request, RequestStatus, next_arrival_seq
from pdserve.engine.schedule_ahead import can_schedule_ahead, check_stop, finishes_by_length
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pdserve.engine.scheduler_stats import SchedulerStats
from pdserve.engine.waiting_queue import admit_waiting, insert_waiting
from pdserve.spec_decode.scheduling import SpecScheduling


class Scheduler:
    """Owns the queues. Mutates requests' status and counters, and the KV cache manager."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        on_hold_for_transfer: Callable[[Request, list[int]], bool] | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.policy = config.policy
        self.waiting: list[Request] = []  # sorted by request.sort_key(policy)
        self.running: list[Request] = []  # admission order
        self.waiting_for_kv: dict[str, Request] = {}
        # Requests whose grammar is compiling (GrammarCompileService): never scheduled, nothing
        # allocated; grammar_ready() moves them to the waiting queue.
        self.waiting_for_grammar: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        # Prefill side: finished requests whose blocks stay held for a decode node to pull.
        self.held_for_transfer: dict[str, Request] = {}
        self._on_hold = on_hold_for_transfer
        self._finished_since_last_step: list[str] = []
        self._step_seq = 0
        self.num_preemptions_total = 0
        # LoRA: at most this many distinct adapters among running requests (the resident slots)
        self.max_loras: int | None = None
        self.spec: SpecScheduling | None = None  # speculative decoding (set by LLMEngine)

    # -- queue management ------------------------------------------------------------------
    def add_request(self, req: Request, *, wait_for_grammar: bool = False) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        self.requests[req.request_id] = req
        if wait_for_grammar:
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar[req.request_id] = req
        else:
            insert_waiting(self.waiting, req, self.policy)

    def grammar_ready(self, request_id: str) -> Request | None:
        """The request's grammar compiled: it joins the waiting queue (None: it is gone), as if it
        arrived now: TP workers are handed the request at this point (LLMEngine) and queue it
        behind everything waiting, so rank 0 must too, or their schedules part."""
        req = self.waiting_for_grammar.pop(request_id, None)
        if req is not None:
            req.arrival_time, req.arrival_seq = time.monotonic(), next_arrival_seq()
            req.status = RequestStatus.WAITING
            insert_waiting(self.waiting, req, self.policy)
        return req

    def finished_pending(self) -> list[str]:
        """Requests finished since the last schedule (the next SchedulerOutput's finished ids)."""
        return list(self._finished_since_last_step)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_kv or self.waiting_for_grammar)

    def has_runnable(self) -> bool:
        """Work a step could do now (requests waiting only for remote KV or a grammar are not)."""
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return (
            len(self.waiting) + len(self.running) + len(self.waiting_for_kv) + len(self.waiting_for_grammar)
        )

    # -- scheduling ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._step_seq += 1
        out = SchedulerOutput(step_seq=self._step_seq)
        out.finished_req_ids, self._finished_since_last_step = self._finished_since_last_step, []
        self.kv.process_deferred_frees()
        if self.kv.offload is not None:
            self.kv.offload.begin_step(self.kv.fence.completed_seq)
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledChunk] = {}
        stop_trying = False

        # 1. Running requests.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            ph = req.num_output_placeholders
            if ph and finishes_by_length(req, self.max_model_len):
                i += 1  # its token in flight is its last: nothing to compute ahead
                continue
            gap = len(req.prompt_token_ids) + len(req.output_token_ids) + ph - req.num_computed_tokens
            num_drafts = self.spec.num_drafts(req, gap, budget) if self.spec is not None else 0
            gap += num_drafts
            num_new = gap if gap < budget else budget
            if num_new <= 0:
                i += 1
                continue
            while True:
                if self.kv.allocate_slots(req, num_new) is not None:
                    break
                victim = pick_victim(self.running, self.policy)
                if not self.kv.can_free_now(victim.request_id):
                    # Zero progress must have zero side effects: nothing has been changed for
                    # this attempt; stop scheduling for this step.
                    stop_trying = True
                    break
                victim_index = self.running.index(victim)
                preempt(victim, self.running, self.waiting, self.policy, self.kv, scheduled, out)
                self.num_preemptions_total += 1
                if victim_index < i:  # an already-scheduled request left the list before us
                    i -= 1
                budget = self.config.max_num_batched_tokens - sum(c.num_tokens for c in scheduled.values())
                if victim is req:
                    break
            if stop_trying:
                break
            if req.status != RequestStatus.RUNNING:  # preempted itself
                continue
            scheduled[req.request_id] = self._chunk(req, num_new, num_drafts)
            budget -= num_new
            i += 1

        # 2. Waiting requests (not after a preemption or a stop: memory is short).
        if not stop_trying and not out.preempted_req_ids:
            for req, num_new in admit_waiting(self, budget, out):
                scheduled[req.request_id] = self._chunk(req, num_new)

        out.chunks = list(scheduled.values())
        out.total_num_scheduled_tokens = sum(c.num_tokens for c in out.chunks)
        # Only now, for the chunks that stay scheduled (a victim preempted above changed nothing
        # here): the counters run ahead of the GPU, and the fence learns who writes which blocks.
        mark_written, seq = self.kv.mark_written, out.step_seq
        for c in out.chunks:
            req = c.request
            req.num_computed_tokens = c.start_pos + c.num_tokens
            if c.sample:
                req.num_output_placeholders += 1
            mark_written(req.request_id, seq)
        if self.kv.offload is not None:
            out.kv_offload = self.kv.offload.take_spec(seq)
        return out

    def _chunk(self, req: Request, num_new: int, num_drafts: int = 0) -> ScheduledChunk:
        start = req.num_computed_tokens
        return ScheduledChunk(
            req,
            start,
            num_new,
            self.kv.block_ids_view(req.request_id),
            start + num_new - num_drafts == req.num_tokens_with_placeholders,
            tuple(req.spec_token_ids[:num_drafts]),
            self.kv.group_block_ids_views(req.request_id),
        )

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled while the last one's tokens are still in
        flight (``schedule_ahead.can_schedule_ahead``)."""
        return can_schedule_ahead(self.running, self.kv)

    # -- after the step --------------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, int], spec_sampled: dict[str, list[int]] | None = None
    ) -> list[Request]:
        """Step ``out`` ran: append its sampled tokens, cache its full blocks, finish what is done.

        A request that finished or was aborted since ``out`` was scheduled is skipped: its token
        (a row computed ahead, asynchronous scheduling) is dropped. ``spec_sampled``: the tokens
        emitted by chunks that carried drafts (``SpecScheduling.apply``). Returns touched requests.
        """
        touched: list[Request] = []
        running = RequestStatus.RUNNING
        cache_blocks = self.kv.cache_computed_blocks if self.kv.enable_prefix_caching else None
        for chunk in out.chunks:
            req = chunk.request
            if chunk.sample:
                req.num_output_placeholders -= 1
                assert req.num_output_placeholders >= 0, req.request_id
            if req.status != running:  # finished or aborted meanwhile
                continue
            if chunk.spec_token_ids:
                assert self.spec is not None and spec_sampled is not None
                self.spec.apply(self, req, chunk, spec_sampled[req.request_id])
                touched.append(req)
                continue
            if cache_blocks is not None:
                cache_blocks(req, chunk.start_pos + chunk.num_tokens)
            if not chunk.sample:
                continue
            token = sampled[req.request_id]
            req.output_token_ids.append(token)
            touched.append(req)
            status = check_stop(req, token, self.max_model_len)
            if status is not None:
                self.finish_request(req.request_id, status)
        return touched

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request wherever it is; frees or hands over its blocks."""
        assert status.finished
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            # The pull still writes into its blocks: the connector frees them when it ends
            # (finish_kv_load); keep them until then.
            req.status = status
            return req
        elif req.status == RequestStatus.WAITING_FOR_GRAMMAR:
            del self.waiting_for_grammar[request_id]
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self._release(req)
        return req

    def _release(self, req: Request) -> None:
        self._finished_since_last_step.append(req.request_id)
        if hold_for_transfer(self.kv, req, self._on_hold):
            self.held_for_transfer[req.request_id] = req
            return
        self.kv.free(req.request_id)

    def release_held(self, request_id: str) -> bool:
        """Prefill side: free the blocks kept for a pull (all pulls done, lease expired, abort)."""
        if self.held_for_transfer.pop(request_id, None) is None:
            return False
        self.kv.free(request_id)
        return True

    # -- remote KV (decode side) ------------------------------------------------------------
    def finish_kv_load(self, request_id: str, ok: bool, recompute_on_failure: bool) -> Request | None:
        """The pull for ``request_id`` ended. On success the request joins the running batch."""
        req = self.waiting_for_kv.pop(request_id, None)
        if req is None:
            return None
        self.kv.end_inflight_write(request_id)
        if req.status.finished:  # aborted while the pull was in flight
            self._release(req)
            return req
        if ok:
            req.num_computed_tokens = req.num_prompt_tokens
            req.num_external_computed_tokens = req.num_prompt_tokens
            self.kv.mark_written(request_id, self._step_seq)
            self.kv.cache_computed_blocks(req)
            if req.num_computed_tokens >= req.num_tokens:
                # No token to feed yet (should not happen: decode gets the first token): compute the last one.
                req.num_computed_tokens = req.num_tokens - 1
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            return req
        if recompute_on_failure:
            self.kv.free(request_id)
            req.kv_transfer_params = None
            req.status = RequestStatus.WAITING
            insert_waiting(self.waiting, req, self.policy)
            return req
        self.requests.pop(request_id, None)
        req.status = RequestStatus.FINISHED_ERROR
        self._release(req)
        return req

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        out = []
        for rid in request_ids:
            r = self.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            if r is not None:
                out.append(r)
        return out

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_for_remote_kv=len(self.waiting_for_kv),
            num_held_for_transfer=len(self.held_for_transfer),
            kv_usage=self.kv.pool.usage,
            prefix_hit_rate=self.kv.pool.hit_rate,
            num_preemptions_total=self.num_preemptions_total,
        )
