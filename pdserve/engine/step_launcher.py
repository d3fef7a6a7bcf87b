"""A scheduled step launched on the executor and completed: at once, or one step later.

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

``launch()`` therefore returns the deltas of the step before the one it launched. When the next
step cannot be scheduled ahead (``Scheduler.can_schedule_ahead``: penalties, min_tokens, memory
short enough that a preemption may be needed), ``LLMEngine.step`` completes the in-flight step
first (``complete_inflight``), which is the synchronous order. A request that stops (eos, stop
string) is found one step late; the row computed for it meanwhile is dropped.

``StepLauncher`` holds the step in flight; ``LLMEngine.execute_scheduled`` calls ``launch``, and
``LLMEngine.fail_all`` calls ``abandon`` and ``pass_failed_step``. Completing a step waits for it,
advances the fence, updates the scheduler and builds the deltas (``OutputProcessor.process``).
``StepCounters`` are the node's engine_step_* counters, counted at each launch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.config.engine import EngineConfig
from pdserve.engine.executor import ModelExecutor
from pdserve.engine.kv_cache_manager import KVCacheManager, StepFence
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.outputs import GenerationDelta, TokenLogprob
from pdserve.engine.pending_step import PendingStep
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.spec_decode.engine import spec_async_scheduling
from pdserve.spec_decode.scheduling import SpecScheduling

logger = logging.getLogger(__name__)


def resolve_async_scheduling(config: EngineConfig, runner: ModelExecutor) -> bool:
    """On by default on one CUDA device. With TP ranks (they launch each step as rank 0 did)
    or pipeline stages (stage 0 waits for the previous step's samples; the engine processes
    that step while the later stages compute the next) it is tested on CPU ranks (gloo) only,
    so there it runs when set explicitly (``async_scheduling: true``)."""
    if config.speculative is not None:
        return spec_async_scheduling(config)
    if config.async_scheduling is None:
        p = config.parallel
        single = p.tensor_parallel_size == p.pipeline_parallel_size == p.prefill_context_parallel_size == 1
        return runner.device.type == "cuda" and single
    return config.async_scheduling


@dataclass
class StepCounters:
    """Steps launched with something scheduled, and their sums of sequences, tokens and
    single-token chunks (decodes): ratios of their rates are the mean batch, the mean tokens
    per step and the mean decode batch (the node's pdserve:engine_step_* counters)."""

    num_steps_total: int = 0
    num_step_seqs_total: int = 0
    num_step_tokens_total: int = 0
    num_step_decode_seqs_total: int = 0
    num_prefill_tokens_total: int = 0  # prompt positions computed (not hit in a cache or pulled)

    def count(self, sched: SchedulerOutput) -> None:
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


class StepLauncher:
    def __init__(
        self,
        config: EngineConfig,  # async_scheduling (resolve_async_scheduling)
        runner: ModelExecutor,
        scheduler: Scheduler,  # update_from_output of each completed step
        kv: KVCacheManager,  # its deferred frees, processed once a step completed
        fence: StepFence,  # advanced past each completed (or abandoned) step
        spec: SpecScheduling | None,  # MTP's after_step, fed each completed step
        output_processor: OutputProcessor,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.kv = kv
        self.fence = fence
        self.spec = spec
        self.output_processor = output_processor
        self.async_scheduling = resolve_async_scheduling(config, runner)
        self.counters = StepCounters()
        self.inflight: tuple[SchedulerOutput, PendingStep] | None = None  # launched, not processed
        # Deltas a step built before it failed (requests it finished are already untracked):
        # delivered by LLMEngine.fail_all(), ahead of its error deltas.
        self._undelivered: list[GenerationDelta] = []
        self._failed_step_seq: int | None = None  # a step whose launch raised (see fail_all)

    def launch(self, sched: SchedulerOutput) -> list[GenerationDelta]:
        """Launch ``sched``; returns the deltas of whichever step completed meanwhile."""
        if sched.is_empty:
            deltas = self.complete_inflight()  # nothing to overlap it with
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
        self.counters.count(sched)
        if not self.async_scheduling:
            return self._complete(sched, pending)
        prev, self.inflight = self.inflight, (sched, pending)
        if prev is None:
            if pending.deferred is not None:  # a pipeline's last stage samples in full: never deferred
                assert isinstance(runner, ModelRunner)
                runner.sample_deferred(pending)  # every token it depends on is on the host
            return []
        # A step with grammar rows came back with its sampler not launched: the previous step's
        # tokens advance the matchers first, then the masks are filled (its forward runs meanwhile).
        return self._complete(*prev, then=pending if pending.deferred is not None else None)

    def complete_inflight(self) -> list[GenerationDelta]:
        if self.inflight is None:
            return []
        prev, self.inflight = self.inflight, None
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
            return self.output_processor.process(touched, logprobs)
        runner = self.runner
        assert isinstance(runner, ModelRunner)
        # The matchers advance now; the masks' fill (on the runner's filler thread, if any)
        # overlaps this step's processing, and the sampler is launched after it.
        runner.prepare_deferred(then)
        deltas: list[GenerationDelta] = []
        try:
            deltas = self.output_processor.process(touched, logprobs)
        finally:
            try:
                runner.sample_deferred(then)
            except BaseException:
                self._undelivered.extend(deltas)  # fail_all() sends them
                raise
        return deltas

    def abandon(self) -> list[GenerationDelta]:
        """An engine fault (``LLMEngine.fail_all``): let the in-flight step's device work end
        before its blocks are reused and pass its fence; returns the deltas a failed step built
        and could not deliver."""
        if self.inflight is not None:
            sched, pending = self.inflight
            self.inflight = None
            try:
                pending.result()
            except Exception as e:  # the fault may be this very step; this rank still cleans up
                logger.error("in-flight step %d did not complete: %s", sched.step_seq, e)
            self.fence.advance(sched.step_seq)
        out, self._undelivered = self._undelivered, []
        return out

    def pass_failed_step(self) -> None:
        """After ``abandon`` and the requests' abort: the fence passes a step whose launch raised,
        so the blocks freed for its requests are not deferred forever."""
        if self._failed_step_seq is not None:
            self.fence.advance(self._failed_step_seq)
            self._failed_step_seq = None
