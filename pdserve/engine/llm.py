"""Offline API in vLLM's shapes: ``LLM(model).generate(prompts, sampling_params)`` and
``LLM(model).chat(messages, sampling_params)`` return ``RequestOutput``s; ``model``: a checkpoint
folder, a ``.gguf`` file or a Hugging Face id (pdserve/models/resolve.py)."""

from __future__ import annotations

import atexit
import dataclasses
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from pdserve.config.engine import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from pdserve.config.kv_offload import KVOffloadConfig
from pdserve.engine.chat_template import render_chat
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.offline import OfflineRequest, PromptType, SampleState, parse_prompts
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import EngineStalledError, InvalidRequestError
from pdserve.lora.offline import LoRARequestLike, lora_config_from_dict, lora_names
from pdserve.models.resolve import resolve_model_path


class LLM:
    """Runs a whole batch to completion in this process; ``generate`` and ``chat`` return
    vLLM-shaped ``RequestOutput``s (one per prompt, its ``n`` samples in ``.outputs``).

    Keyword arguments are EngineConfig fields, or CacheConfig / SchedulerConfig / ParallelConfig
    fields (e.g. ``block_size=16``, ``max_num_batched_tokens=256``, ``tensor_parallel_size=2``;
    ``pcp=2`` for ``prefill_context_parallel_size``).
    With tensor parallelism, worker processes run until ``close()`` (or the end of a ``with``
    block, or interpreter exit). They are started with ``spawn``, so a script that builds a TP
    engine at import time needs the usual ``if __name__ == "__main__":`` guard.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
        sched_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
        cache_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in cache_fields}
        sched_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in sched_fields}
        if "pcp" in kwargs:  # LLM(..., pcp=N), as the cluster file's key
            kwargs["prefill_context_parallel_size"] = kwargs.pop("pcp")
        par_fields = {f.name for f in dataclasses.fields(ParallelConfig)}
        par_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in par_fields}
        if isinstance(kwargs.get("lora"), Mapping):  # LLM(..., lora={"max_loras": 4, "modules": {...}})
            kwargs["lora"] = lora_config_from_dict(kwargs["lora"])
        if "kv_offload" in kwargs:  # a dict, as the cluster file's section, or a KVOffloadConfig
            kwargs["kv_offload"] = KVOffloadConfig.coerce(kwargs["kv_offload"])
        self.config = EngineConfig(
            model=str(resolve_model_path(model)),  # a folder, a .gguf file or an HF id
            cache=CacheConfig(**cache_kw),
            scheduler=SchedulerConfig(**sched_kw),
            parallel=ParallelConfig(**par_kw),
            **kwargs,
        )
        self.engine = LLMEngine(self.config)
        self._counter = 0
        par = self.config.parallel
        if max(par.tensor_parallel_size, par.pipeline_parallel_size, par.prefill_context_parallel_size) > 1:
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
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priorities: Sequence[int] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequestLike | Sequence[LoRARequestLike] = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list, in vLLM's shapes.

        A prompt is a string, a list of token ids, ``{"prompt": str}`` or
        ``{"prompt_token_ids": [...]}``. One SamplingParams applies to every prompt, or give one
        per prompt. Returns one RequestOutput per prompt, in order, each with ``n`` samples.
        """
        parsed = parse_prompts(prompts)
        params = self._params_per_prompt(sampling_params, len(parsed))
        ids_list = []
        for p in parsed:
            if p.token_ids is None:
                assert p.text is not None
                ids_list.append(self.engine.tokenize(p.text))
            else:
                ids_list.append(p.token_ids)
        loras = lora_names(self.engine, lora_request, len(parsed))
        return self._run([p.text for p in parsed], ids_list, params, priorities, use_tqdm, loras)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages) or a
        list of them, through the checkpoint's chat template (or ``chat_template``), as vLLM's
        ``LLM.chat``. Each RequestOutput's ``prompt`` is the rendered template text."""
        if not messages:
            raise InvalidRequestError("messages: give at least one conversation", field="messages")
        one = isinstance(messages[0], Mapping)
        conversations = [messages] if one else list(messages)
        texts, ids_list = [], []
        for conv in conversations:
            text, ids = render_chat(
                self.tokenizer,
                conv,  # type: ignore[arg-type]
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
            )
            texts.append(text)
            ids_list.append(ids)
        params = self._params_per_prompt(sampling_params, len(conversations))
        return self._run(texts, ids_list, params, None, use_tqdm)

    @staticmethod
    def _params_per_prompt(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise InvalidRequestError(
                f"sampling_params: {num_prompts} prompts but {len(params)} sampling params; give one "
                "SamplingParams for all, or one per prompt",
                field="sampling_params",
            )
        return params

    def _run(
        self,
        texts: Sequence[str | None],
        ids_list: list[list[int]],
        params: list[SamplingParams],
        priorities: Sequence[int] | None,
        use_tqdm: bool,
        loras: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        # Validate everything before admitting anything: a bad request allocates nothing.
        for ids, sp in zip(ids_list, params, strict=True):
            sp.validate()
            self.engine.validate_prompt(ids, sp)
        if priorities is not None and len(priorities) != len(ids_list):
            raise InvalidRequestError(
                f"priorities: {len(ids_list)} prompts but {len(priorities)} priorities", field="priorities"
            )
        outputs: list[OfflineRequest] = []
        samples: dict[str, SampleState] = {}  # engine request id -> its sample
        for p, (text, ids, sp) in enumerate(zip(texts, ids_list, params, strict=True)):
            req = OfflineRequest(f"offline-{self._counter}", text, ids, sp)
            self._counter += 1
            outputs.append(req)
            for i, state in enumerate(req.samples):
                engine_rid = req.request_id if sp.n == 1 else f"{req.request_id}-{i}"
                samples[engine_rid] = state
                prio = priorities[p] if priorities else 0
                sample_sp = sp.for_sample(i)
                if i > 0 and sample_sp.prompt_logprobs is not None:
                    # sample 0 scores the prompt; the others may then take prefix-cache hits
                    sample_sp = dataclasses.replace(sample_sp, prompt_logprobs=None)
                lora = loras[p] if loras else ""
                self.engine.add_request(ids, sample_sp, engine_rid, priority=prio, lora_name=lora)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(samples), desc="generate")
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
                samples[d.request_id].add(d)
                if d.finish_reason is not None and bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [r.result(self.tokenizer) for r in outputs]
