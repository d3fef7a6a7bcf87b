"""The model runner's side of a step whose chunks carry drafts (``ModelRunner.launch`` hands over).

The step's sampled rows are split: chunks without drafts (prefill ends, grammar rows, rows the
drafter found nothing for) go through the runner's usual sampler job, unchanged; chunks with
drafts are verified (``verify.verify``) and their emitted tokens travel on the PendingStep,
already on the host (speculative steps are synchronous: LLMEngine turns asynchronous
scheduling off on a speculative node).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.prompt_logprobs import PromptLogprobTensors
from pdserve.engine.sampler import SamplerInput, argmax_only
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pdserve.spec_decode.verify import VerifyGroup, verify

if TYPE_CHECKING:
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.pending_step import PendingStep


def launch_verify(
    runner: ModelRunner, sched: SchedulerOutput, hidden: torch.Tensor, prompt: PromptLogprobTensors | None
) -> PendingStep:
    """``hidden`` [num_sampled_rows, hidden]: every sampling chunk's rows, 1 + m per chunk."""
    from pdserve.engine.pending_step import PendingStep, SampleJob

    logits = runner.model.compute_logits(hidden, upcast=True)  # [R, V] float32
    vocab_size = logits.shape[1]
    put = runner.staging.list_to_device
    plain_rows: list[int] = []
    plain: list[ScheduledChunk] = []
    spec_rows: list[int] = []
    groups: list[VerifyGroup] = []
    row = 0
    for c in sched.chunks:
        if not c.sample:
            continue
        n = 1 + len(c.spec_token_ids)
        req = c.request
        if c.spec_token_ids:
            spec_rows.extend(range(row, row + n))
            x = SamplerInput(
                req.sampling_params,
                req.prompt_token_ids,
                req.output_token_ids,
                runner.seeds.generator(req, vocab_size),
                req.eos_token_ids,
                runner.seeds.seed_draw(c),  # row 0's token index; row j draws at k + j (verify.py)
            )
            groups.append(VerifyGroup(req.request_id, x, c.spec_token_ids))
        else:
            plain_rows.append(row)
            plain.append(c)
        row += n
    assert row == logits.shape[0], (row, tuple(logits.shape))
    pending = PendingStep(
        [c.request.request_id for c in plain],
        None,
        None,
        timeout_s=runner.config.step_timeout_s,
        prompt=prompt,
    )
    if plain:
        reqs = [c.request for c in plain]
        argmax = all(argmax_only(r.sampling_params, len(r.output_token_ids)) for r in reqs)
        grammar_rows = [i for i, r in enumerate(reqs) if r.sampling_params.structured is not None]
        pending.deferred = SampleJob(logits[put(plain_rows, torch.long)], plain, argmax, grammar_rows)
        runner.sample_deferred(pending)
    else:
        runner._prev_sampled, runner._prev_rows = None, {}
        pending.event = runner.staging.end_step()
    out = verify(logits[put(spec_rows, torch.long)], groups, put, fused=runner.sampler.fused)
    pending.spec = (out.tokens, out.logprobs)
    return pending
