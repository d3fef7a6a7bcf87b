"""Offline API: ``LLM(model_dir).generate(prompts, sampling_params)``."""

from __future__ import annotations

import atexit
import dataclasses
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from pdserve.config.engine import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import EngineStalledError

Prompt = str | list[int]


class LLM:
    """Runs a whole batch to completion in this process.

    Keyword arguments are EngineConfig fields, or CacheConfig / SchedulerConfig / ParallelConfig
    fields (e.g. ``block_size=16``, ``max_num_batched_tokens=256``, ``tensor_parallel_size=2``).
    With tensor parallelism, worker processes run until ``close()`` (or the end of a ``with``
    block, or interpreter exit). They are started with ``spawn``, so a script that builds a TP
    engine at import time needs the usual ``if __name__ == "__main__":`` guard.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
        sched_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
        cache_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in cache_fields}
        sched_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in sched_fields}
        par_fields = {f.name for f in dataclasses.fields(ParallelConfig)}
        par_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in par_fields}
        self.config = EngineConfig(
            model=str(model),
            cache=CacheConfig(**cache_kw),
            scheduler=SchedulerConfig(**sched_kw),
            parallel=ParallelConfig(**par_kw),
            **kwargs,
        )
        self.engine = LLMEngine(self.config)
        self._counter = 0
        par = self.config.parallel
        if par.tensor_parallel_size > 1 or par.pipeline_parallel_size > 1:
            atexit.register(self.close)

    def close(self) -> None:
        """Stop the engine's TP worker processes, if any (idempotent)."""
        self.engine.close()
        atexit.unregister(self.close)

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _stall_message(self) -> str:
        eng = self.engine
        stuck = list(eng.scheduler.requests.values())[:4]
        about = ", ".join(f"{r.request_id} ({r.status.name}, {r.num_tokens} tokens)" for r in stuck)
        return (
            f"no step can schedule the remaining {eng.scheduler.num_unfinished} request(s) ({about}); "
            f"the KV cache holds {eng.cache_sizes.num_tokens} tokens, "
            f"{eng.kv.pool.num_free_blocks} of {eng.cache_sizes.num_blocks} blocks free"
        )

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priorities: Sequence[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # Validate everything before admitting anything: a bad request allocates nothing.
        ids_list = [self.engine.tokenize(p) if isinstance(p, str) else list(p) for p in prompts]  # type: ignore[arg-type]
        for ids, sp in zip(ids_list, params, strict=True):
            sp.validate()
            self.engine.validate_prompt(ids, sp)
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for i, (ids, sp) in enumerate(zip(ids_list, params, strict=True)):
            rid = f"offline-{self._counter}"
            self._counter += 1
            self.engine.add_request(ids, sp, rid, priority=priorities[i] if priorities else 0)
            results[rid] = RequestOutput(rid, ids, logprobs=[] if sp.logprobs is not None else None)
            order.append(rid)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="generate")
        idle_steps = 0
        while self.engine.has_unfinished():
            if not self.engine.has_runnable() and self.engine.wait_for_grammars(timeout_s=0.1):
                continue  # only requests whose grammar compiles are left
            deltas = self.engine.step()
            # Offline nothing else can free memory: a few empty steps in a row (the first ones
            # may still release deferred blocks) mean no step will ever schedule these requests.
            idle_steps = idle_steps + 1 if self.engine.last_step_empty and not deltas else 0
            if idle_steps >= 3:
                raise EngineStalledError(self._stall_message())
            for d in deltas:
                r = results[d.request_id]
                r.token_ids.extend(d.token_ids)
                r.text += d.text
                if d.logprobs and r.logprobs is not None:
                    r.logprobs.extend(d.logprobs)
                r.num_cached_tokens = d.num_cached_tokens
                if d.prompt_logprobs is not None:
                    r.prompt_logprobs = d.prompt_logprobs
                if d.finish_reason is not None:
                    r.finish_reason = d.finish_reason
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[rid] for rid in order]
