"""Admission of a new request: every check it must pass, then its ``Request``.

``AdmissionController`` checks the sampling params, the prompt (token ids or ``prompt_embeds``),
the images, the engine's queue limit (``max_queue_len``), the request id and the LoRA adapter,
and builds the ``Request``; it allocates nothing, so a request it rejects (a typed error naming
the field) leaves no trace. ``LLMEngine.add_request`` calls ``make_request``, then tracks and
schedules the request; ``LLMEngine.validate_prompt``, ``check_prompt_embeds`` (which services
call before admission) and ``num_queued`` delegate here, and ``LLMEngine.expire_queued`` aborts
the requests ``expired`` names (``max_queue_wait_s``).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable, Container, Sequence
from typing import Any

from pdserve.config.engine import EngineConfig
from pdserve.engine.grammar_spec import check_size
from pdserve.engine.mm_inputs import check_mm_items
from pdserve.engine.request import MultiModalItem, Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.errors import CapacityError, InvalidRequestError, PromptTooLongError
from pdserve.kvtransfer.params import KVTransferParams, RemotePrefillParams
from pdserve.lora.serving import LoRAServing
from pdserve.models.config import ModelArchConfig


class AdmissionController:
    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArchConfig,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        tokenize: Callable[[str], list[int]],
        scheduler: Scheduler,  # read only: its waiting queue
        running: Container[str],  # ids of requests admitted and not handed their final delta
        lora: LoRAServing | None,  # the adapters a request may name; None: no lora settings
    ) -> None:
        self.config = config
        self.arch = arch
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.tokenize = tokenize
        self.scheduler = scheduler
        self.running = running
        self.lora = lora

    def queued(self) -> list[Request]:
        """Admitted requests never scheduled yet (not preempted ones, not those pulling KV)."""
        return [
            r
            for r in self.scheduler.waiting
            if r.num_computed_tokens == 0 and r.num_preemptions == 0 and r.request_id in self.running
        ]

    def num_queued(self) -> int:
        return len(self.queued())

    def expired(self, now: float | None = None) -> dict[str, str]:
        """Requests queued longer than ``max_queue_wait_s`` (none when unset) -> the error each
        ends with."""
        wait = self.config.scheduler.max_queue_wait_s
        if wait is None or not self.scheduler.waiting:
            return {}
        t = time.monotonic() if now is None else now
        return {
            r.request_id: (
                f"no room for the request: it waited {t - r.arrival_time:.1f} s in the "
                f"queue (max_queue_wait_s {wait:g}); retry later"
            )
            for r in self.queued()
            if t - r.arrival_time > wait
        }

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise a typed error for a request the engine must not admit (nothing is allocated)."""
        if not prompt_token_ids:
            raise InvalidRequestError("prompt: must not be empty", field="prompt")
        vocab = self.arch.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", field="prompt"
            )
        max_tokens = params.max_tokens or 1
        if len(prompt_token_ids) + max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})",
                field="max_tokens" if len(prompt_token_ids) < self.max_model_len else "prompt",
            )

    def check_prompt_embeds(self, t: Any) -> Any:
        """A [n, hidden] finite float tensor on the host, or InvalidRequestError naming the problem."""
        import torch

        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != self.arch.hidden_size:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidRequestError(
                f"prompt_embeds: must be [num_tokens, {self.arch.hidden_size}], got {shape}",
                field="prompt_embeds",
            )
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise InvalidRequestError(
                f"prompt_embeds: dtype {t.dtype} is not a float type", field="prompt_embeds"
            )
        if t.shape[0] < 1 or not bool(torch.isfinite(t).all()):
            raise InvalidRequestError("prompt_embeds: empty, or holds NaN/inf", field="prompt_embeds")
        return t.detach().cpu().contiguous()

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None,
        *,
        priority: int,
        kv_transfer_params: KVTransferParams | None,
        output_token_ids: list[int] | None,
        prompt_embeds: Any | None,
        mm_items: Sequence[MultiModalItem],
        lora_name: str,
    ) -> Request:
        """The checked ``Request`` (its prompt ids resolved, its id drawn if not given), or a
        typed error; see ``LLMEngine.add_request`` for the arguments."""
        if params.structured is not None:
            check_size(params.structured[1], self.config.max_grammar_bytes, "the node's max_grammar_bytes")
        params.validate()
        salt = b""
        if prompt_embeds is not None:
            prompt_embeds = self.check_prompt_embeds(prompt_embeds)
            prompt = [0] * int(prompt_embeds.shape[0])
            salt = hashlib.blake2b(prompt_embeds.float().numpy().tobytes(), digest_size=16).digest()
        if params.n != 1:
            raise InvalidRequestError("n: the engine takes n=1 per request; fan out above it", field="n")
        if params.prompt_logprobs is not None and (
            prompt_embeds is not None or isinstance(kv_transfer_params, RemotePrefillParams)
        ):
            raise InvalidRequestError(
                "prompt_logprobs: needs prompt token ids computed on this node (not prompt_embeds, "
                "not KV prefilled elsewhere: the prefilling node returns them)",
                field="prompt_logprobs",
            )
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(ids, params)
        items = check_mm_items(mm_items, len(ids), self.arch.hidden_size)
        rid = request_id or uuid.uuid4().hex
        limit = self.config.scheduler.max_queue_len
        if limit is not None and self.num_queued() >= limit:
            raise CapacityError(
                f"the engine's queue is full ({self.num_queued()} requests waiting, max_queue_len "
                f"{limit}); retry later"
            )
        if rid in self.running:
            raise InvalidRequestError(f"request_id: {rid!r} is already running", field="request_id")
        req = Request(
            request_id=rid,
            prompt_token_ids=ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            kv_transfer_params=kv_transfer_params,
            prompt_embeds=prompt_embeds,
            cache_salt=salt,
            mm_items=items,
        )
        if output_token_ids:
            req.output_token_ids.extend(output_token_ids)
        if lora_name:
            if self.lora is None:
                raise InvalidRequestError(
                    f"model {lora_name!r}: this engine serves no LoRA adapters (no lora settings)",
                    field="model",
                )
            req.cache_salt = self.lora.admit(lora_name) + req.cache_salt
            req.lora_name = lora_name
        return req
