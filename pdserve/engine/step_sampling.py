"""The sampling tail of a step on the last pipeline stage, after the forward.

    sample_step       prompt logprobs; rows with drafts -> spec_decode/runner.py; else the
                      sampled rows' logits (the weights' dtype where no row needs fp32) as a
                      ``SampleJob`` (engine/pending_step.py) on the step's PendingStep
    launch_sampler    that job's grammar masks (in place, or fused with the argmax), argmax or
                      Sampler.sample -> SampledTensors on the device; nothing waits for it
    SeededStreams     where seeded rows draw: a counter-based stream (CUDA with Triton), else a
                      torch.Generator per request

ModelRunner.launch ends in ``sample_step``; ModelRunner.sample_deferred calls ``launch_sampler``,
at once or, with asynchronous scheduling and grammar rows, once the masks can be filled.
spec_decode/runner.py's verification draws from the runner's SeededStreams.
"""

from __future__ import annotations

import importlib.util
from array import array
from typing import TYPE_CHECKING

import torch

from pdserve import kernels
from pdserve.engine.grammar_masks import GrammarMasker
from pdserve.engine.host_batch import HostBatch
from pdserve.engine.pending_step import PendingStep, SampleJob
from pdserve.engine.prompt_logprobs import compute_prompt_logprobs, prompt_logprob_spans
from pdserve.engine.request import Request
from pdserve.engine.sampler import SampledTensors, Sampler, SamplerInput, argmax_only, draw_
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:
    from pdserve.engine.model_runner import ModelRunner


class SeededStreams:
    """The draws of seeded requests. Seeded rows on CUDA draw from a counter-based stream, all in
    one launch (kernels/triton_seeded_draw.py); on the CPU, or without Triton, from a generator
    per request, kept until ``drop``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counter_draws = (
            device.type == "cuda"
            and kernels.get_backend() != "torch"
            and importlib.util.find_spec("triton") is not None
        )
        self._generators: dict[str, torch.Generator] = {}

    def seed_draw(self, chunk: ScheduledChunk) -> tuple[int, int] | None:
        """(seed, k) of a seeded chunk whose first sampled row draws its k-th output token (the
        row after its last known token; drafts, when the chunk has them, come after it), where
        seeded rows draw from the counter-based stream (CUDA with Triton); None elsewhere
        (``generator`` serves)."""
        seed = chunk.request.sampling_params.seed
        if seed is None or not self.counter_draws:
            return None
        last_known = chunk.start_pos + chunk.num_tokens - len(chunk.spec_token_ids)
        return seed, last_known - chunk.request.num_prompt_tokens

    def generator(self, request: Request, vocab_size: int) -> torch.Generator | None:
        """The seeded request's generator (made on first use); None for unseeded requests, and on
        the counter-based path (``seed_draw`` serves)."""
        seed = request.sampling_params.seed
        if seed is None or self.counter_draws:
            return None
        g = self._generators.get(request.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            # Tokens it already has were sampled elsewhere from the same seed (prefill's first
            # token on P/D, a recompute): skip their draws, one row of vocab_size per token as the
            # sampler draws them, so the stream goes on where that node left it, not from its start.
            skip = torch.empty(vocab_size, device=self.device)
            for _ in range(len(request.output_token_ids)):
                draw_(skip, g)
            self._generators[request.request_id] = g
        return g

    @property
    def num_generators(self) -> int:
        return len(self._generators)

    def drop(self, request_id: str) -> None:
        self._generators.pop(request_id, None)


def sample_step(
    runner: ModelRunner, sched: SchedulerOutput, batch: HostBatch, out: torch.Tensor, defer_masks: bool
) -> PendingStep:
    """The last stage's side of ``runner``'s step after the forward (``out``: [num_tokens,
    hidden]): prompt logprobs, then the sampled rows' logits and their sampler, launched here or
    left in the step's ``deferred`` job (``ModelRunner.launch``'s ``defer_masks``)."""
    spans = prompt_logprob_spans(sched)
    prompt = (
        compute_prompt_logprobs(out, spans, runner.model.compute_logits, runner.staging) if spans else None
    )
    if prompt is not None and runner.staging.pinned:
        prompt = prompt.copy_to_host(runner.staging.host_like)  # read after the step's event
    sample_idx = batch.sample_idx
    if sample_idx and any(c.spec_token_ids for c in sched.chunks):
        from pdserve.spec_decode.runner import launch_verify

        return launch_verify(
            runner, sched, out[runner.staging.to_device(array("q", sample_idx), torch.int64)], prompt
        )
    if not sample_idx:
        runner._prev_sampled, runner._prev_rows = None, {}
        return PendingStep(
            [], None, runner.staging.end_step(), timeout_s=runner.config.step_timeout_s, prompt=prompt
        )
    if len(sample_idx) == batch.num_tokens:  # every token samples (decode): no gather
        hidden = out
    else:
        hidden = out[runner.staging.to_device(array("q", sample_idx), torch.int64)]
    sampling_chunks = (
        [c for c in sched.chunks if c.sample] if len(sample_idx) < batch.num_seqs else sched.chunks
    )
    reqs = [c.request for c in sampling_chunks]
    argmax = all(argmax_only(r.sampling_params, len(r.output_token_ids)) for r in reqs)
    # bf16 -> fp32 is exact: the argmax (first maximum on ties) and the one-pass race are the same without it
    half = argmax or runner.sampler.reads_half_logits(reqs, runner.seeds.counter_draws)
    logits = runner.model.compute_logits(hidden, upcast=not half)  # [num_sampled, vocab]
    grammar_rows = [i for i, r in enumerate(reqs) if r.sampling_params.structured is not None]
    pending = PendingStep(
        [r.request_id for r in reqs],
        None,
        None,
        timeout_s=runner.config.step_timeout_s,
        prompt=prompt,
        deferred=SampleJob(logits, sampling_chunks, argmax, grammar_rows),
    )
    if not (defer_masks and grammar_rows):
        runner.sample_deferred(pending)
    return pending


def launch_sampler(
    job: SampleJob, grammar: GrammarMasker, sampler: Sampler, seeds: SeededStreams
) -> SampledTensors:
    """Queue ``job``'s sampling: grammar masks (in place), argmax or the sampler."""
    masks = None
    if job.grammar_rows:
        # If this raises (a fill failed or timed out), the step's ``deferred`` stays set: its
        # result() then waits for the fill and the device and raises (the fault path).
        masks = job.masks or grammar.start(job.chunks, job.grammar_rows, job.logits.shape[1], overlap=False)
    if job.argmax:
        # no SamplerInput rows; grammar rows: the mask fused with the argmax on CUDA
        token_ids = kernels.argmax_rows(job.logits) if masks is None else grammar.argmax(job.logits, masks)
        return SampledTensors(token_ids, [], [])
    if masks is not None:
        grammar.apply(job.logits, masks)
    inputs = [
        SamplerInput(
            params=c.request.sampling_params,
            prompt_token_ids=c.request.prompt_token_ids,
            output_token_ids=c.request.output_token_ids,
            generator=seeds.generator(c.request, job.logits.shape[1]),
            eos_token_ids=c.request.eos_token_ids,
            seed_draw=seeds.seed_draw(c),
        )
        for c in job.chunks
    ]
    return sampler.sample(job.logits, inputs)
