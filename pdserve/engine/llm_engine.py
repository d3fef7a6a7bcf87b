"""The engine: admit requests, and step() = schedule -> run the model -> post-process.

Single-threaded; services drive it from one engine thread (see ``pdserve.engine.engine_loop``).

With asynchronous scheduling (``EngineConfig.async_scheduling``, on by default on one CUDA device) a step
launches its device work and then post-processes the *previous* step, whose samples are ready
by then, so the host's work hides behind the GPU's:

    host   | sched N+1 | launch N+1 | wait N, process N | sched N+2 | launch N+2 | wait N+1 ...
    GPU    |  ... step N ............|.. step N+1 ...............................| step N+2

A step with grammar-constrained rows is launched in two halves (as vLLM does): the forward
first, then, once the previous step's tokens are on the host and have advanced the matchers,
the bitmask fill and the sampler, while that forward runs on the device:

    host   | sched N+1 | fwd N+1 | wait N, update N | fill masks N+1, sample N+1 | detok N | sched N+2
    GPU    |  ... step N .........|.. fwd N+1 ......................| mask + sample N+1 |  fwd N+2

``step()`` therefore returns the deltas of the step before the one it launched. When the next
step cannot be scheduled ahead (``Scheduler.can_schedule_ahead``: penalties, min_tokens, memory
short enough that a preemption may be needed), the in-flight step is completed first, which is
the synchronous order. A request that stops (eos, stop string) is found one step late; the
row computed for it meanwhile is dropped.

The engine runs its steps on a ``ModelExecutor`` (``engine.executor``): the model here, or, with
``tensor_parallel_size`` or ``pipeline_parallel_size`` N > 1, TP rank 0 / pipeline stage 0 here
sending each step to N-1 worker processes (``pdserve.engine.workers``); ``close()`` stops them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import Any

from pdserve.config.choices import KvLoadFailurePolicy
from pdserve.config.engine import EngineConfig
from pdserve.engine.admission import AdmissionController
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.executor import ModelExecutor, make_executor
from pdserve.engine.grammar_compile import GrammarCompileService
from pdserve.engine.kv_cache_groups import DECLINE_OFFLOAD
from pdserve.engine.kv_setup import build_kv_layout
from pdserve.engine.model_runner import ModelRunner, PendingStep, set_intra_op_threads
from pdserve.engine.output_processor import OutputProcessor, TrackedRequest
from pdserve.engine.outputs import GenerationDelta, TokenLogprob
from pdserve.engine.request import MultiModalItem, Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.errors import InvalidRequestError
from pdserve.kvoffload.tier import KVOffloadTier
from pdserve.kvtransfer.params import KVLoadSpec, KVTransferParams
from pdserve.lora.serving import make_lora_serving
from pdserve.models.loader import load_tokenizer
from pdserve.spec_decode.engine import make_spec_scheduling, spec_async_scheduling

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        load_tokenizer_: bool = True,
        on_hold_for_transfer: Callable[[Request, list[int]], bool] | None = None,
        shared_kv_table_reason: str | None = None,
    ) -> None:
        """``shared_kv_table_reason``: why the node keeps every KV cache group on one block
        table (its KV transfer settings; engine/kv_group_tables.py); None: the engine decides."""
        self.config = config
        self._shared_reason = shared_kv_table_reason
        # Structured outputs: grammars compile off this thread (made by the first constrained request).
        self.grammars: GrammarCompileService | None = None
        self._grammar_pending: dict[str, Future[Any]] = {}  # request id -> its grammar's Future
        self.grammar_wake: Callable[[], None] | None = None  # EngineLoop: wake the engine thread
        self._grammar_lock = threading.Lock()
        tp = config.parallel.tensor_parallel_size
        set_intra_op_threads(config, tp * config.parallel.pipeline_parallel_size)  # workers set theirs
        try:
            self._init_engine(config, load_tokenizer_, on_hold_for_transfer)
        except BaseException:
            self.close()
            raise

    def _init_engine(
        self,
        config: EngineConfig,
        load_tokenizer_: bool,
        on_hold_for_transfer: Callable[[Request, list[int]], bool] | None,
    ) -> None:
        self.runner: ModelExecutor = make_executor(config)
        arch = self.runner.arch
        self.arch = arch
        layout = build_kv_layout(config, self.runner, self._shared_reason)
        self.cache_sizes, self.max_model_len = layout.cache_sizes, layout.max_model_len
        self.fence, self.kv = layout.fence, layout.kv
        # Evicted blocks kept in host memory / on disk; None: the prefix cache forgets them.
        self.offload: KVOffloadTier | None = None
        if config.kv_offload is not None:
            self.offload = KVOffloadTier(config, self.runner, self.kv)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, on_hold_for_transfer)
        self.lora = make_lora_serving(self.runner, config, self.scheduler)
        self.spec = make_spec_scheduling(config, self.runner, self.max_model_len)
        self.scheduler.spec = self.spec
        self.tokenizer = load_tokenizer(config.model) if load_tokenizer_ else None
        self.detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        self.eos_token_ids = frozenset(arch.eos_token_ids)
        self.output_processor = OutputProcessor(self.scheduler, self.detok)
        self.admission = AdmissionController(
            config,
            arch,
            self.max_model_len,
            self.eos_token_ids,
            self.tokenize,
            self.scheduler,
            self.output_processor.tracked,
        )
        self._kv_loads: list[KVLoadSpec] = []
        # Where a step's remote KV pulls go as soon as the scheduler allocated their blocks (the
        # node's connector, set by EngineLoop), before the step runs; None: take_kv_loads() after it.
        self.kv_load_sink: Callable[[list[KVLoadSpec]], None] | None = None
        self.async_scheduling = self._resolve_async(config)
        self._inflight: tuple[SchedulerOutput, PendingStep] | None = None  # launched, not processed
        # Deltas a step built before it failed (requests it finished are already untracked):
        # delivered by fail_all(), ahead of its error deltas.
        self._undelivered: list[GenerationDelta] = []
        self._failed_step_seq: int | None = None  # a step whose launch raised (see fail_all)
        self.num_aborted_total = 0
        # Steps launched with something scheduled, and their sums of sequences, tokens and
        # single-token chunks (decodes): ratios of their rates are the mean batch, the mean tokens
        # per step and the mean decode batch (the node's pdserve:engine_step_* counters).
        self.num_steps_total = 0
        self.num_step_seqs_total = 0
        self.num_step_tokens_total = 0
        self.num_step_decode_seqs_total = 0
        self.num_prefill_tokens_total = 0  # prompt positions computed (not hit in a cache or pulled)
        self.last_step_empty = False  # nothing could be scheduled (memory short): wait for an event
        logger.info(
            "engine ready: %s on %s/%s, KV cache %d MiB: %d blocks (%d tokens), max_model_len=%d, "
            "async scheduling %s",
            config.model,
            self.runner.device,
            self.runner.dtype,
            self.cache_sizes.budget_bytes >> 20,
            self.cache_sizes.num_blocks,
            self.cache_sizes.num_tokens,
            self.max_model_len,
            "on" if self.async_scheduling else "off",
        )

    def _resolve_async(self, config: EngineConfig) -> bool:
        """On by default on one CUDA device. With TP ranks (they launch each step as rank 0 did)
        or pipeline stages (stage 0 waits for the previous step's samples; the engine processes
        that step while the later stages compute the next) it is tested on CPU ranks (gloo) only,
        so there it runs when set explicitly (``async_scheduling: true``)."""
        if config.speculative is not None:
            return spec_async_scheduling(config)
        if config.async_scheduling is None:
            p = config.parallel
            single = (
                p.tensor_parallel_size == p.pipeline_parallel_size == p.prefill_context_parallel_size == 1
            )
            return self.runner.device.type == "cuda" and single
        return config.async_scheduling

    def close(self) -> None:
        """Stop the TP worker ranks or pipeline stages and the grammar compiler, if any (idempotent)."""
        if self.grammars is not None:
            self.grammars.close()
            self.grammars = None
        runner: ModelExecutor | None = getattr(self, "runner", None)
        if runner is not None:
            runner.close()
        offload: KVOffloadTier | None = getattr(self, "offload", None)
        if offload is not None:
            offload.close()

    # -- admission -----------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise a typed error for a request the engine must not admit (nothing is allocated)."""
        self.admission.validate_prompt(prompt_token_ids, params)

    def check_prompt_embeds(self, t: Any) -> Any:
        """A [n, hidden] finite float tensor on the host, or InvalidRequestError naming the problem."""
        return self.admission.check_prompt_embeds(t)

    def tokenize(self, prompt: str) -> list[int]:
        assert self.tokenizer is not None
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
        kv_transfer_params: KVTransferParams | None = None,
        output_token_ids: list[int] | None = None,
        prompt_embeds: Any | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        lora_name: str = "",
    ) -> Request:
        """Admit a request. ``prompt_embeds`` ([n, hidden] tensor) replaces the prompt: ``prompt``
        is then ignored and n placeholder ids stand in for it. ``lora_name``: a loaded adapter
        the request runs under ("" the base model)."""
        req = self.admission.make_request(
            prompt,
            params,
            request_id,
            priority=priority,
            kv_transfer_params=kv_transfer_params,
            output_token_ids=output_token_ids,
            prompt_embeds=prompt_embeds,
            mm_items=mm_items,
        )
        if lora_name:
            if self.lora is None:
                raise InvalidRequestError(
                    f"model {lora_name!r}: this engine serves no LoRA adapters (no lora settings)",
                    field="model",
                )
            req.cache_salt = self.lora.admit(lora_name) + req.cache_salt
            req.lora_name = lora_name
        grammar = None
        if params.structured is not None:
            grammar = self.grammar_service().submit(*params.structured)
        self.output_processor.add_request(req, output_token_ids)
        waits = grammar is not None and not grammar.done()
        self.scheduler.add_request(req, wait_for_grammar=waits)
        if waits:
            assert grammar is not None
            self._grammar_pending[req.request_id] = grammar
        elif grammar is not None:
            self._share_grammar_compiler()
        return req

    def _share_grammar_compiler(self) -> None:
        """The model runner's matchers use the compile service's compiler and its cache, so
        their first sight of a request finds its grammar compiled (never compiled on this thread)."""
        if (
            isinstance(self.runner, ModelRunner)
            and self.grammars is not None
            and self.grammars.compiler is not None
        ):
            self.runner.grammar.compiler = self.grammars.compiler

    def grammar_service(self) -> GrammarCompileService:
        """The engine's grammar compiler (made on first use; any thread: EngineLoop.admit asks
        from the event loop)."""
        with self._grammar_lock:
            return self._make_grammar_service()

    def _make_grammar_service(self) -> GrammarCompileService:
        if self.grammars is None:
            from pdserve.engine.grammar_compile import GrammarCompiler

            cfg, vocab, eos = self.config, self.arch.vocab_size, sorted(self.eos_token_ids) or None
            tok = self.tokenizer
            self.grammars = GrammarCompileService(
                lambda: GrammarCompiler(tok if tok is not None else load_tokenizer(cfg.model), vocab, eos),
                cfg.grammar_compile_timeout_s,
                cfg.grammar_worker_start_timeout_s,
                on_done=lambda: self.grammar_wake() if self.grammar_wake is not None else None,
            )
        return self.grammars

    def wait_for_grammars(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until a pending grammar is settled (offline use: nothing else
        to do meanwhile); False when none is pending. The compile thread settles each one within
        grammar_compile_timeout_s of its turn."""
        futs = list(self._grammar_pending.values())
        if futs:
            wait_futures(futs, timeout=timeout_s, return_when=FIRST_COMPLETED)
        return bool(futs)

    def _admit_compiled(self) -> list[GenerationDelta]:
        """Requests whose grammar is ready join the queue; those whose compile failed or ran out
        of time end here with an error (they hold no blocks)."""
        out: list[GenerationDelta] = []
        for rid, fut in list(self._grammar_pending.items()):
            if not fut.done():
                continue
            del self._grammar_pending[rid]
            if rid not in self.scheduler.waiting_for_grammar:  # aborted meanwhile
                continue
            err = fut.exception()
            if err is None:
                self._share_grammar_compiler()
                self.scheduler.grammar_ready(rid)
                continue
            req = self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
            assert req is not None
            d = self._final_delta(req)
            d.finish_reason = "error"
            d.error = str(err) if isinstance(err, InvalidRequestError) else f"grammar compile failed: {err}"
            out.append(d)
        return out

    def abort(self, request_ids: list[str]) -> list[GenerationDelta]:
        out = []
        for r in self.scheduler.abort_requests(request_ids):
            self.num_aborted_total += 1
            out.append(self._final_delta(r))
        self._drop_finished_if_idle()
        return out

    def has_unfinished(self) -> bool:
        return self._inflight is not None or self.scheduler.has_unfinished()

    @property
    def _tracked(self) -> dict[str, TrackedRequest]:
        """Requests admitted and not yet handed their final delta (``OutputProcessor.tracked``)."""
        return self.output_processor.tracked

    def num_queued(self) -> int:
        """Admitted requests never scheduled yet (``AdmissionController.queued``)."""
        return self.admission.num_queued()

    def expire_queued(self, now: float | None = None) -> list[GenerationDelta]:
        """Drop requests queued longer than ``max_queue_wait_s`` (a no-op when unset): each ends
        with an ``overloaded`` error delta and holds nothing."""
        wait = self.config.scheduler.max_queue_wait_s
        if wait is None or not self.scheduler.waiting:
            return []
        t = time.monotonic() if now is None else now
        old = [r for r in self.admission.queued() if t - r.arrival_time > wait]
        if not old:
            return []
        waited = {r.request_id: t - r.arrival_time for r in old}
        out = self.abort([r.request_id for r in old])
        for d in out:
            d.finish_reason, d.overloaded = "error", True
            d.error = (
                f"no room for the request: it waited {waited.get(d.request_id, wait):.1f} s in the "
                f"queue (max_queue_wait_s {wait:g}); retry later"
            )
        return out

    def has_runnable(self) -> bool:
        """A step would make progress: work to schedule, a launched step to process, or a
        compiled grammar to admit."""
        return (
            self._inflight is not None
            or self.scheduler.has_runnable()
            or any(fut.done() for fut in self._grammar_pending.values())
        )

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> list[GenerationDelta]:
        """Schedule and launch one step; returns the deltas of the step that completed (this one
        when synchronous, the previous one under asynchronous scheduling)."""
        deltas = self._admit_compiled() if self._grammar_pending else []
        if self._inflight is not None and not self.scheduler.can_schedule_ahead():
            deltas += self._complete_inflight()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if self.spec is not None:  # a drafter with weights drafts into the allocated slots
            self.spec.fill_drafts(sched)
        self.last_step_empty = sched.is_empty and not sched.kv_loads and self._inflight is None
        deltas += self.execute_scheduled(sched)
        if self.lora is not None:  # adapters unloaded while in use go once their last request ended
            self.lora.reap(self.scheduler.requests.values())
        self._drop_finished_if_idle()
        return deltas

    def _drop_finished_if_idle(self) -> None:
        """Nothing left to run: drop the finished requests' runner state (seeded generators,
        grammar matchers) now. The next step's schedule would, but an idle engine takes no step,
        and that state would stay until the next request (``request_state_entries``). Idempotent:
        the ids still reach the next schedule (TP workers, pipeline stages)."""
        if isinstance(self.runner, ModelRunner) and not self.has_unfinished():
            self.runner.drop_finished(self.scheduler.finished_pending())

    def take_kv_loads(self) -> list[KVLoadSpec]:
        """Remote KV pulls the last steps asked for (decode side); the connector starts them."""
        out, self._kv_loads = self._kv_loads, []
        return out

    def finish_kv_load(
        self,
        request_id: str,
        ok: bool,
        policy: KvLoadFailurePolicy,
        error: str = "",
        first_tokens: Sequence[int] = (),
    ) -> list[GenerationDelta]:
        """A remote KV pull ended (decode side). ``policy`` is kv_load_failure_policy: fail | recompute.
        ``first_tokens``: what prefill sampled, for a request admitted without them (a decode leg
        opened with the prefill leg): they join its history as if given at admission (counted as
        emitted, fed to the detokenizer), before it can be scheduled."""
        if ok and first_tokens:
            self.output_processor.add_first_tokens(request_id, first_tokens)
        req = self.scheduler.finish_kv_load(
            request_id, ok, recompute_on_failure=policy is KvLoadFailurePolicy.RECOMPUTE
        )
        if req is None or not req.is_finished or request_id not in self.output_processor.tracked:
            return []
        d = self._final_delta(req)
        if req.status == RequestStatus.FINISHED_ERROR:
            d.finish_reason, d.error = "error", f"KV transfer failed: {error or 'unknown error'}"
        return [d]

    def fail_all(self, message: str) -> list[GenerationDelta]:
        """Tier-three handling of an engine fault: every request ends with an error, blocks freed."""
        if self._inflight is not None:
            sched, pending = self._inflight
            self._inflight = None
            try:  # let its device work end before its blocks are reused
                pending.result()
            except Exception as e:  # the fault may be this very step; this rank still cleans up
                logger.error("in-flight step %d did not complete: %s", sched.step_seq, e)
            self.fence.advance(sched.step_seq)
        ids = list(self.scheduler.requests)
        self._grammar_pending.clear()
        out, self._undelivered = self._undelivered, []
        aborted = self.scheduler.abort_requests(ids)
        if self._failed_step_seq is not None:
            self.fence.advance(self._failed_step_seq)
            self._failed_step_seq = None
        self.kv.process_deferred_frees()
        for r in aborted:
            d = self._final_delta(r)
            d.finish_reason, d.error = "error", message
            out.append(d)
        return out

    def execute_scheduled(self, sched: SchedulerOutput) -> list[GenerationDelta]:
        """Launch ``sched``; returns the deltas of whichever step completed meanwhile."""
        if self.offload is not None:  # copies of evicted / offloaded blocks, ahead of any write
            self.offload.execute(sched.kv_offload, before_remote_writes=bool(sched.kv_loads))
        if sched.kv_loads:
            # Their blocks are allocated and counted as written by a transfer (deferred frees), so
            # the pulls start now rather than after this step: a decode step (a few ms under load)
            # less between a P/D request's admission and its first token here.
            if self.kv_load_sink is not None:
                self.kv_load_sink(sched.kv_loads)
            else:
                self._kv_loads.extend(sched.kv_loads)
        if sched.is_empty:
            deltas = self._complete_inflight()  # nothing to overlap it with
            self.runner.drop_finished(sched.finished_req_ids)
            self.fence.advance(sched.step_seq)
            return deltas
        runner = self.runner
        try:
            if self.async_scheduling:
                pending = runner.launch(sched, defer_masks=True)
            else:
                pending = runner.launch(sched)
        except BaseException:
            # The step never completes (e.g. a pipeline stage died): fail_all() passes its fence
            # so the blocks freed for its requests are not deferred forever.
            self._failed_step_seq = sched.step_seq
            raise
        n, ntok = len(sched.chunks), sched.total_num_scheduled_tokens
        self.num_steps_total += 1
        self.num_step_seqs_total += n
        self.num_step_tokens_total += ntok
        # A decode chunk computes one token (so does a prompt's one-token remainder, rarely). Every
        # chunk holds >= 1 token, so tokens == chunks means all of them: no loop in a decode step.
        self.num_step_decode_seqs_total += (
            n if ntok == n else sum(1 for c in sched.chunks if c.num_tokens == 1)
        )
        self.num_prefill_tokens_total += sum(
            max(0, min(c.start_pos + c.num_tokens, c.request.num_prompt_tokens) - c.start_pos)
            for c in sched.chunks
        )
        if not self.async_scheduling:
            return self._complete(sched, pending)
        prev, self._inflight = self._inflight, (sched, pending)
        if prev is None:
            if pending.deferred is not None:  # a pipeline's last stage samples in full: never deferred
                assert isinstance(runner, ModelRunner)
                runner.sample_deferred(pending)  # every token it depends on is on the host
            return []
        # A step with grammar rows came back with its sampler not launched: the previous step's
        # tokens advance the matchers first, then the masks are filled (its forward runs meanwhile).
        return self._complete(*prev, then=pending if pending.deferred is not None else None)

    def _complete_inflight(self) -> list[GenerationDelta]:
        if self._inflight is None:
            return []
        prev, self._inflight = self._inflight, None
        return self._complete(*prev)

    def _complete(
        self, sched: SchedulerOutput, pending: PendingStep, then: PendingStep | None = None
    ) -> list[GenerationDelta]:
        """Wait for a launched step, then advance the fence and process its samples. ``then``: the
        next step, launched with its sampler deferred; launched here once this step's tokens are
        in the requests' histories and before detokenizing (the host's work that can wait)."""
        out = pending.result()
        if then is not None:  # steady grammar rows: their accept and fill start now, on the filler
            runner = self.runner
            assert isinstance(runner, ModelRunner)
            runner.prepare_deferred_sampled(then, out.sampled)
        if self.spec is not None:  # MTP: its KV from this step's hidden states
            self.spec.after_step(sched, out.sampled, out.spec_sampled)
        self.fence.advance(sched.step_seq)
        self.kv.process_deferred_frees()  # e.g. an abort while this step was in flight
        if out.prompt_logprobs:
            self.output_processor.add_prompt_logprobs(out.prompt_logprobs)
        touched = self.scheduler.update_from_output(sched, out.sampled, out.spec_sampled)
        logprobs: dict[str, TokenLogprob | list[TokenLogprob]] = dict(out.logprobs)
        if out.spec_logprobs:
            logprobs.update(out.spec_logprobs)
        if then is None:
            return self._process(touched, logprobs)
        runner = self.runner
        assert isinstance(runner, ModelRunner)
        # The matchers advance now; the masks' fill (on the runner's filler thread, if any)
        # overlaps this step's processing, and the sampler is launched after it.
        runner.prepare_deferred(then)
        deltas: list[GenerationDelta] = []
        try:
            deltas = self._process(touched, logprobs)
        finally:
            try:
                runner.sample_deferred(then)
            except BaseException:
                self._undelivered.extend(deltas)  # fail_all() sends them
                raise
        return deltas

    def _process(
        self, touched: list[Request], logprobs: dict[str, TokenLogprob | list[TokenLogprob]]
    ) -> list[GenerationDelta]:
        """Detokenize, check stop strings and build the step's deltas (``OutputProcessor.process``);
        a method here so that the bench's phase timers and the tests can wrap it."""
        return self.output_processor.process(touched, logprobs)

    def _final_delta(self, req: Request) -> GenerationDelta:
        return self.output_processor.final_delta(req)

    # -- introspection ----------------------------------------------------------------------------
    def declined_prefix_tokens(self) -> dict[str, int]:
        """pdserve:prefix_cache_declined_tokens_total by reason (kv_cache_groups.DECLINE_REASONS)."""
        out = dict(self.kv.coordinator.declined_tokens)
        if self.offload is not None:
            out[DECLINE_OFFLOAD] += self.offload.manager.num_declined_tokens
        return out

    def num_used_blocks(self) -> int:
        return self.kv.pool.num_used_blocks
