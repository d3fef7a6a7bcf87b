"""The engine: admit requests, and step() = schedule -> run the model -> post-process.

Single-threaded; services drive it from one engine thread (see ``pdserve.engine.engine_loop``).
``LLMEngine`` builds and wires the engine's parts and is the class callers use. Its parts:
``AdmissionController`` (a new request's checks), ``GrammarAdmission`` (constrained requests wait
for their grammar), ``Scheduler``, ``StepLauncher`` (a step launched and completed, at once or,
under asynchronous scheduling, one step later: engine/step_launcher.py), ``OutputProcessor``
(deltas) and ``KVLoadQueue`` (P/D's remote KV pulls).

The engine runs its steps on a ``ModelExecutor`` (``engine.executor``): the model here, or, with
``tensor_parallel_size`` or ``pipeline_parallel_size`` N > 1, TP rank 0 / pipeline stage 0 here
sending each step to N-1 worker processes (``pdserve.engine.workers``); ``close()`` stops them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.config.choices import KvLoadFailurePolicy
from pdserve.config.engine import EngineConfig
from pdserve.engine.admission import AdmissionController
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.device import set_intra_op_threads
from pdserve.engine.executor import ModelExecutor, make_executor
from pdserve.engine.grammar_admission import GrammarAdmission
from pdserve.engine.grammar_compile import GrammarCompileService
from pdserve.engine.kv_cache_groups import DECLINE_OFFLOAD
from pdserve.engine.kv_loads import KVLoadQueue
from pdserve.engine.kv_setup import build_kv_layout
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.outputs import GenerationDelta
from pdserve.engine.request import MultiModalItem, Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.step_launcher import StepLauncher
from pdserve.kvoffload.tier import KVOffloadTier
from pdserve.kvtransfer.params import KVLoadSpec, KVTransferParams
from pdserve.lora.serving import make_lora_serving
from pdserve.models.loader import load_tokenizer
from pdserve.spec_decode.engine import make_spec_scheduling

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
            self.lora,
        )
        self.grammar_admission = GrammarAdmission(
            config, arch, self.tokenizer, self.runner, self.scheduler, self.output_processor
        )
        self.kv_loads = KVLoadQueue(self.scheduler, self.output_processor)  # P/D's decode side
        self.launcher = StepLauncher(
            config, self.runner, self.scheduler, self.kv, self.fence, self.spec, self.output_processor
        )
        # The node's pdserve:engine_step_* counters (StepLauncher counts each launched step).
        self.async_scheduling, self.counters = self.launcher.async_scheduling, self.launcher.counters
        self.num_aborted_total = 0
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

    def close(self) -> None:
        """Stop the TP worker ranks or pipeline stages and the grammar compiler, if any (idempotent)."""
        grammar_admission: GrammarAdmission | None = getattr(self, "grammar_admission", None)
        if grammar_admission is not None:
            grammar_admission.close()
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
            lora_name=lora_name,
        )
        grammar = self.grammar_admission.submit(params)
        self.output_processor.add_request(req, output_token_ids)
        waits = grammar is not None and not grammar.done()
        self.scheduler.add_request(req, wait_for_grammar=waits)
        if grammar is not None:
            self.grammar_admission.admitted(req.request_id, grammar, waits)
        return req

    def grammar_service(self) -> GrammarCompileService:
        """The engine's grammar compiler (made on first use; any thread: EngineLoop.admit asks
        from the event loop)."""
        return self.grammar_admission.compile_service()

    def wait_for_grammars(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until a pending grammar is settled (offline use); False when
        none is pending (``GrammarAdmission.wait``)."""
        return self.grammar_admission.wait(timeout_s)

    def abort(self, request_ids: list[str]) -> list[GenerationDelta]:
        out = []
        for r in self.scheduler.abort_requests(request_ids):
            self.num_aborted_total += 1
            out.append(self.output_processor.final_delta(r))
        self._drop_finished_if_idle()
        return out

    def has_unfinished(self) -> bool:
        return self.launcher.inflight is not None or self.scheduler.has_unfinished()

    def num_queued(self) -> int:
        """Admitted requests never scheduled yet (``AdmissionController.queued``)."""
        return self.admission.num_queued()

    def expire_queued(self, now: float | None = None) -> list[GenerationDelta]:
        """Drop requests queued longer than ``max_queue_wait_s`` (a no-op when unset): each ends
        with an ``overloaded`` error delta and holds nothing."""
        errors = self.admission.expired(now)
        out = self.abort(list(errors)) if errors else []
        for d in out:
            d.finish_reason, d.overloaded, d.error = "error", True, errors[d.request_id]
        return out

    def has_runnable(self) -> bool:
        """A step would make progress: work to schedule, a launched step to process, or a
        compiled grammar to admit."""
        return (
            self.launcher.inflight is not None
            or self.scheduler.has_runnable()
            or self.grammar_admission.has_ready()
        )

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> list[GenerationDelta]:
        """Schedule and launch one step; returns the deltas of the step that completed (this one
        when synchronous, the previous one under asynchronous scheduling)."""
        deltas, sched = self._schedule()
        deltas += self.execute_scheduled(sched)  # the model runs; a completed step's deltas
        self._after_step()
        return deltas

    def _schedule(self) -> tuple[list[GenerationDelta], SchedulerOutput]:
        """Requests whose grammar is settled join the queue (or end: their deltas), the in-flight
        step is completed first when the next cannot be scheduled ahead of it, then the schedule."""
        deltas = self.grammar_admission.admit_compiled() if self.grammar_admission.pending else []
        if self.launcher.inflight is not None and not self.scheduler.can_schedule_ahead():
            deltas += self.launcher.complete_inflight()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if self.spec is not None:  # a drafter with weights drafts into the allocated slots
            self.spec.fill_drafts(sched)
        self.last_step_empty = sched.is_empty and not sched.kv_loads and self.launcher.inflight is None
        return deltas, sched

    def execute_scheduled(self, sched: SchedulerOutput) -> list[GenerationDelta]:
        """Launch ``sched``; returns the deltas of whichever step completed meanwhile."""
        if self.offload is not None:  # copies of evicted / offloaded blocks, ahead of any write
            self.offload.execute(sched.kv_offload, before_remote_writes=bool(sched.kv_loads))
        if sched.kv_loads:
            # Their blocks are allocated and counted as written by a transfer (deferred frees), so
            # the pulls start now rather than after this step: a decode step (a few ms under load)
            # less between a P/D request's admission and its first token here.
            self.kv_loads.put(sched.kv_loads)
        return self.launcher.launch(sched)

    def _after_step(self) -> None:
        if self.lora is not None:  # adapters unloaded while in use go once their last request ended
            self.lora.reap(self.scheduler.requests.values())
        self._drop_finished_if_idle()

    def _drop_finished_if_idle(self) -> None:
        """Nothing left to run: drop the finished requests' runner state (seeded generators,
        grammar matchers) now. The next step's schedule would, but an idle engine takes no step,
        and that state would stay until the next request (``request_state_entries``). Idempotent:
        the ids still reach the next schedule (TP workers, pipeline stages)."""
        if isinstance(self.runner, ModelRunner) and not self.has_unfinished():
            self.runner.drop_finished(self.scheduler.finished_pending())

    def take_kv_loads(self) -> list[KVLoadSpec]:
        """Remote KV pulls the last steps asked for (decode side); the connector starts them."""
        return self.kv_loads.take()

    def finish_kv_load(
        self,
        request_id: str,
        ok: bool,
        policy: KvLoadFailurePolicy,
        error: str = "",
        first_tokens: Sequence[int] = (),
    ) -> list[GenerationDelta]:
        """A remote KV pull ended (decode side): ``KVLoadQueue.finish``."""
        return self.kv_loads.finish(request_id, ok, policy, error, first_tokens)

    def fail_all(self, message: str) -> list[GenerationDelta]:
        """Tier-three handling of an engine fault: every request ends with an error, blocks freed."""
        out = self.launcher.abandon()
        self.grammar_admission.pending.clear()
        aborted = self.scheduler.abort_requests(list(self.scheduler.requests))
        self.launcher.pass_failed_step()
        self.kv.process_deferred_frees()
        for r in aborted:
            d = self.output_processor.final_delta(r)
            d.finish_reason, d.error = "error", message
            out.append(d)
        return out

    # -- introspection ----------------------------------------------------------------------------
    def declined_prefix_tokens(self) -> dict[str, int]:
        """pdserve:prefix_cache_declined_tokens_total by reason (kv_cache_groups.DECLINE_REASONS)."""
        out = dict(self.kv.coordinator.declined_tokens)
        if self.offload is not None:
            out[DECLINE_OFFLOAD] += self.offload.manager.num_declined_tokens
        return out

    def num_used_blocks(self) -> int:
        return self.kv.pool.num_used_blocks
