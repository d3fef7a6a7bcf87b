"""What a launched step hands back: ``PendingStep`` (its queued device work and the host copies of its
samples, read once by ``result()``), the sampler job kept while a step's grammar masks wait for the
previous step's tokens (``SampleJob``), and the step's ``RunnerOutput``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from pdserve.engine.grammar_masks import GrammarMasks
from pdserve.engine.host_batch import PinnedStaging, wait_event
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.prompt_logprobs import PromptLogprobTensors
from pdserve.engine.sampler import SampledTensors
from pdserve.engine.scheduler_output import ScheduledChunk
from pdserve.models.config import IntermediateTensors


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request id -> sampled token (chunks with sample=True)
    logprobs: dict[str, TokenLogprob]  # for requests that asked for logprobs
    intermediate: IntermediateTensors | None = None  # non-last pipeline stages
    # request id -> (index of the first entry, entries): prompt logprobs computed this step
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # Speculative decoding: request id -> tokens a chunk with drafts emitted (and their logprobs)
    spec_sampled: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


@dataclass
class SampleJob:
    """A launched step's logits and what its sampler needs. Kept when the step has grammar rows
    whose masks can only be filled once the previous step's tokens are on the host."""

    logits: torch.Tensor  # [num_sampled, vocab]: the weights' dtype when ``argmax``, else fp32
    chunks: list[ScheduledChunk]  # the sampling chunks, one per logits row
    argmax: bool  # every row is argmax_only: masked rows too take the argmax of these logits
    grammar_rows: list[int]  # logits rows of requests with a structured-output constraint
    masks: GrammarMasks | None = None  # set once the matchers advanced (prepare_deferred)


@dataclass
class PendingStep:
    """A launched step: its device work is queued, its samples are being copied to the host.

    ``result()`` waits for exactly that work (an event recorded after the copies), not for any
    step launched later, and reads the samples. Call it once.
    """

    req_ids: list[str]  # request id of each sampled row
    samples: SampledTensors | None  # host copies (pinned on CUDA), valid once the event passed
    event: torch.cuda.Event | None  # None on CPU: the work is already done
    intermediate: IntermediateTensors | None = None
    # (staging, slot, generation) holding ``samples``: the slot must not have been reused.
    staging: tuple[PinnedStaging, int, int] | None = None

    timeout_s: float = 300.0  # EngineConfig.step_timeout_s
    prompt: PromptLogprobTensors | None = None  # host copies (pinned on CUDA); read after the event
    # Set while the sampler is not launched yet (ModelRunner.sample_deferred launches it).
    deferred: SampleJob | None = None
    taken: bool = False  # result() was called (TP: whether the next launch overlaps this step)
    # Speculative decoding: (spec_sampled, spec_logprobs) of the verified rows, already on the host
    spec: tuple[dict[str, list[int]], dict[str, list[TokenLogprob]]] | None = None

    def result(self) -> RunnerOutput:
        out = self._result()
        if self.spec is not None:
            out.spec_sampled, out.spec_logprobs = self.spec
        return out

    def _result(self) -> RunnerOutput:
        self.taken = True
        if self.deferred is not None:  # only on a fault path (the engine failed between the halves)
            masks = self.deferred.masks
            if masks is not None and masks.fill is not None:
                with contextlib.suppress(Exception):  # a fill still writing its slot; the interval back
                    masks.fill.wait(self.timeout_s)
            if self.deferred.logits.is_cuda:
                torch.cuda.synchronize(self.deferred.logits.device)  # its forward still writes KV
            raise RuntimeError("the step's sampler was never launched (its grammar masks were not filled)")
        if self.event is not None:
            wait_event(self.event, self.timeout_s, "a launched step")
        if self.staging is not None:
            st, slot, gen = self.staging
            assert st.generation(slot) == gen, "a step's samples were read after its staging slot was reused"
        prompt = self.prompt.output() if self.prompt is not None else {}
        if self.samples is None:
            return RunnerOutput({}, {}, intermediate=self.intermediate, prompt_logprobs=prompt)
        out = self.samples.output()
        sampled = dict(zip(self.req_ids, out.token_ids, strict=True))
        logprobs = {rid: lp for rid, lp in zip(self.req_ids, out.logprobs, strict=True) if lp is not None}
        return RunnerOutput(sampled, logprobs, prompt_logprobs=prompt)
