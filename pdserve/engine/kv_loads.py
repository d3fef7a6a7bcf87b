"""Remote KV pulls on the decode side of P/D: handed to the connector, and their outcome applied.

The scheduler allocates a remote-prefill request's blocks and emits a ``KVLoadSpec`` in the
step's ``SchedulerOutput.kv_loads``. ``KVLoadQueue.put`` hands them to ``sink`` (the node's
connector, set by EngineLoop) as the step is launched; without a sink they wait for ``take``.
``finish`` applies a pull's outcome: the request runs, is recomputed, or ends in error
(kv_load_failure_policy). ``LLMEngine.execute_scheduled`` calls ``put``; ``LLMEngine.take_kv_loads``
and ``LLMEngine.finish_kv_load`` delegate here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve.config.choices import KvLoadFailurePolicy
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.outputs import GenerationDelta
from pdserve.engine.request import RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.kvtransfer.params import KVLoadSpec


class KVLoadQueue:
    def __init__(self, scheduler: Scheduler, output_processor: OutputProcessor) -> None:
        self.scheduler = scheduler  # finish_kv_load: the request runs or ends
        self.output_processor = output_processor  # the first tokens, the final delta
        self._kv_loads: list[KVLoadSpec] = []
        # Where a step's remote KV pulls go as soon as the scheduler allocated their blocks (the
        # node's connector, set by EngineLoop), before the step runs; None: take() after it.
        self.sink: Callable[[list[KVLoadSpec]], None] | None = None

    def put(self, kv_loads: list[KVLoadSpec]) -> None:
        if self.sink is not None:
            self.sink(kv_loads)
        else:
            self._kv_loads.extend(kv_loads)

    def take(self) -> list[KVLoadSpec]:
        """Remote KV pulls the last steps asked for; the connector starts them."""
        out, self._kv_loads = self._kv_loads, []
        return out

    def finish(
        self, request_id: str, ok: bool, policy: KvLoadFailurePolicy, error: str, first_tokens: Sequence[int]
    ) -> list[GenerationDelta]:
        """A remote KV pull ended. ``policy`` is kv_load_failure_policy: fail | recompute.
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
        d = self.output_processor.final_delta(req)
        if req.status == RequestStatus.FINISHED_ERROR:
            d.finish_reason, d.error = "error", f"KV transfer failed: {error or 'unknown error'}"
        return [d]
