"""Continuous batching with chunked prefill, prefix hits, preemption by recompute. No torch.

One step:  schedule() -> SchedulerOutput -> (model runner) -> update_from_output().

Running requests are served first (each gets up to its gap ``num_tokens - num_computed``
within the token budget), then waiting ones are admitted in policy order. When a running
request cannot get a block, the lowest-ranked running request is preempted (its blocks freed,
its counter reset to 0) — unless its blocks cannot be freed *now* (an in-flight step or
transfer may still write them): then scheduling stops for this step before touching any
state (docs/design.md §4: zero progress, zero side effects).

``schedule()`` advances each scheduled request's ``num_computed_tokens`` at once, and counts
a token it will sample as a placeholder, so the next step can be scheduled while this one
still runs on the GPU (asynchronous scheduling, ``LLMEngine``):

    step N   scheduled, launched            request r: num_computed = p, placeholders = 1
    step N+1 scheduled before N's tokens     r's chunk: position p, input token = N's sample,
             are known on the host           fed on the device (the runner)
    N's output processed                     r: token appended, placeholders = 0; a stop found
                                             now wastes r's row in N+1 (its token is dropped)

A request whose in-flight token is its last by length (max_tokens, max_model_len) is not
scheduled ahead. ``can_schedule_ahead()`` says when looking ahead is safe: no request with a
token in flight needs its token history for sampling (penalties, min_tokens), and the free
blocks cover every running request's next chunk, so no preemption can be needed.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.config.engine import SchedulerConfig
from pdserve.engine.block_pool import KVCacheBlock
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus, next_arrival_seq
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pdserve.kvtransfer.params import KVLoadSpec, RemoteDecodeParams, RemotePrefillParams
from pdserve.spec_decode.scheduling import SpecScheduling


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_waiting_for_remote_kv: int
    num_held_for_transfer: int
    kv_usage: float
    prefix_hit_rate: float
    num_preemptions_total: int


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
            self._insert_waiting(req)

    def grammar_ready(self, request_id: str) -> Request | None:
        """The request's grammar compiled: it joins the waiting queue (None: it is gone), as if it
        arrived now: TP workers are handed the request at this point (LLMEngine) and queue it
        behind everything waiting, so rank 0 must too, or their schedules part."""
        req = self.waiting_for_grammar.pop(request_id, None)
        if req is not None:
            req.arrival_time, req.arrival_seq = time.monotonic(), next_arrival_seq()
            req.status = RequestStatus.WAITING
            self._insert_waiting(req)
        return req

    def _insert_waiting(self, req: Request) -> None:
        key = req.sort_key(self.policy)
        keys = [r.sort_key(self.policy) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, key), req)

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

    def _pick_victim(self) -> Request:
        # The lowest-ranked running request: the last by policy order.
        return max(self.running, key=lambda r: r.sort_key(self.policy))

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
            if ph and self._finishes_by_length(req):
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
                victim = self._pick_victim()
                if not self.kv.can_free_now(victim.request_id):
                    # Zero progress must have zero side effects: nothing has been changed for
                    # this attempt; stop scheduling for this step.
                    stop_trying = True
                    break
                victim_index = self.running.index(victim)
                self._preempt(victim, scheduled, out)
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
            self._admit_waiting(budget, scheduled, out)

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

    def _finishes_by_length(self, req: Request) -> bool:
        """Whether the tokens sampled so far (in flight included) already end the request."""
        max_tokens = req.sampling_params.max_tokens
        num_out = len(req.output_token_ids) + req.num_output_placeholders
        return (max_tokens is not None and num_out >= max_tokens) or (
            len(req.prompt_token_ids) + num_out >= self.max_model_len
        )

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled while the last one's tokens are still in flight.

        No: a request with a token in flight samples from its token history (penalties, or
        min_tokens not yet reached: the host's history lacks the in-flight token), or the free
        blocks might not cover every running request's next chunk (a preemption would have to
        wait for the in-flight step). The engine then completes the in-flight step first.
        A grammar does not need this: its mask is filled after the in-flight step's tokens
        reached the host, while the next step's forward already runs (``LLMEngine``).
        """
        bound = 0  # an upper bound of the blocks needed: 1 per decode, ceil(gap / bs) + 1 else
        bs = self.kv.block_size
        gaps: list[tuple[Request, int]] = []
        for req in self.running:
            ph = req.num_output_placeholders
            if ph:
                sp = req.sampling_params
                if sp.has_penalties or len(req.output_token_ids) < sp.min_tokens:
                    return False
            gap = len(req.prompt_token_ids) + len(req.output_token_ids) + ph - req.num_computed_tokens
            if gap > 0:
                bound += 1 if gap == 1 else 1 + -(-gap // bs)
                gaps.append((req, gap))
        free = self.kv.pool.num_free_blocks
        if bound <= free:
            return True
        return sum(self.kv.num_new_blocks(req, gap) for req, gap in gaps) <= free

    def _preempt(self, victim: Request, scheduled: dict[str, ScheduledChunk], out: SchedulerOutput) -> None:
        scheduled.pop(victim.request_id, None)
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        # can_free_now() passed, so no step in flight computes for the victim.
        assert victim.num_output_placeholders == 0, victim.request_id
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        self._insert_waiting(victim)
        out.preempted_req_ids.append(victim.request_id)

    def _admit_waiting(self, budget: int, scheduled: dict[str, ScheduledChunk], out: SchedulerOutput) -> None:
        cfg = self.config
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            if req.lora_name and self.max_loras is not None and self._lora_slots_full(req.lora_name):
                break  # its adapter needs a slot no running request's adapter gives up yet
            params = req.kv_transfer_params
            if (
                isinstance(params, RemotePrefillParams)
                and req.num_computed_tokens == 0
                and req.num_preemptions == 0
            ):
                # Decode side: all prompt KV comes from the prefill node. Blocks for the whole
                # prompt are allocated now; the pull writes into them.
                num_remote = req.num_prompt_tokens
                if self.kv.allocate_slots(req, num_remote, group_start=num_remote) is None:
                    break
                self.waiting.pop(0)
                req.status = RequestStatus.WAITING_FOR_REMOTE_KV
                self.waiting_for_kv[req.request_id] = req
                self.kv.begin_inflight_write(req.request_id)
                groups = tuple(tuple(t) for t in self.kv.group_block_ids_views(req.request_id))
                out.kv_loads.append(
                    KVLoadSpec(req.request_id, self.kv.block_ids(req.request_id), num_remote, params, groups)
                )
                continue
            hit_blocks: list[KVCacheBlock] = []
            num_hit = 0
            off = None
            # A prefix hit has no logits: prompt logprobs need every prompt position computed.
            if req.num_computed_tokens == 0 and req.sampling_params.prompt_logprobs is None:
                hit_blocks, num_hit = self.kv.get_computed_blocks(req)
                # Blocks past the device hit that the offload tier holds: loaded into new blocks
                # (looked up only when the rest of the prompt fits: a request that waits for
                # memory would read and pin them again every step).
                if self.kv.pool.num_free_blocks >= self.kv.num_blocks_needed(req.num_tokens) - len(
                    hit_blocks
                ):
                    off = self.kv.get_offloaded_blocks(req, len(hit_blocks))
            num_off = off.num_tokens if off is not None else 0
            num_new = req.num_tokens - req.num_computed_tokens - num_hit - num_off
            if num_new > budget:
                if not cfg.enable_chunked_prefill:
                    if off is not None:
                        self.kv.offload.cancel(off)  # type: ignore[union-attr]
                    break
                num_new = budget
            if self.kv.allocate_slots(req, num_off + num_new, hit_blocks, num_hit) is None:
                if off is not None:
                    self.kv.offload.cancel(off)  # type: ignore[union-attr]
                break
            if off is not None:
                first = len(hit_blocks)
                ids = self.kv.block_ids_view(req.request_id)[first : first + len(off.slots)]
                self.kv.offload.commit(off, ids, out.step_seq)  # type: ignore[union-attr]
                num_hit += num_off
            self.waiting.pop(0)
            if req.num_preemptions == 0 or req.num_cached_tokens == 0:
                req.num_cached_tokens = max(req.num_cached_tokens, num_hit)
            req.num_computed_tokens += num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = self._chunk(req, num_new)
            budget -= num_new

    def _lora_slots_full(self, lora_name: str) -> bool:
        """Whether admitting a request of ``lora_name`` would make the running adapters exceed max_loras."""
        active = {r.lora_name for r in self.running if r.lora_name}
        active.update(r.lora_name for r in self.waiting_for_kv.values() if r.lora_name)
        assert self.max_loras is not None
        return lora_name not in active and len(active) >= self.max_loras

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
            status = self._check_stop(req, token)
            if status is not None:
                self.finish_request(req.request_id, status)
        return touched

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        num_out = len(req.output_token_ids)
        if num_out >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and num_out >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(req.prompt_token_ids) + num_out >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

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
        if (
            isinstance(req.kv_transfer_params, RemoteDecodeParams)
            and req.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
            and self._on_hold is not None
            and self.kv.holds(req.request_id)
            and self._on_hold(req, self.kv.block_ids(req.request_id))
        ):
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
            self._insert_waiting(req)
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
