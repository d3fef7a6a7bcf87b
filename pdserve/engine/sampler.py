"""Turn one step's logits into next tokens (and logprobs), one row per running request.

Per row, in this order (vLLM / OpenAI semantics)::

    logits ─► repetition penalty         prompt + output tokens: x > 0 → x / r, else x · r
           ─► presence / frequency        output tokens only:     x -= p·[count > 0] + f·count
           ─► min_tokens mask             eos (unless ignore_eos) and stop_token_ids → -inf
           ─► logprobs taken here         log_softmax in float32: after penalties, before temperature
           ─► greedy rows:  argmax        ties → lowest token id
           ─► sampled rows: / temperature ─► top-k ─► top-p ─► min-p ─► exponential race

Logprobs therefore describe the penalised distribution at temperature 1, not the tempered and
truncated one the token was drawn from (vLLM's "processed logits" minus sampling transforms).

The exponential race draws q ~ Exp(1) per vocabulary entry and takes argmax(probs / q), which
samples exactly from probs. It is computed as argmax(logits - log q): same argmax, no softmax,
no underflow. A seeded row draws its q with its own generator, V values per step, so its tokens
depend only on its own logits and seed, never on the other rows of the batch or its position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams


@dataclass
class SamplerInput:
    """One row of logits: the request's parameters and the token history that they read."""

    params: SamplingParams
    prompt_token_ids: list[int]  # repetition penalty reads these
    output_token_ids: list[int]  # generated so far: penalties and min_tokens read these
    # Seeded requests only: made by the caller from params.seed on the logits' device and kept
    # for the request's lifetime. None: the default generator.
    generator: torch.Generator | None
    eos_token_ids: frozenset[int]


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # Per row: the sampled token's logprob and the top-N alternatives (N = params.logprobs),
    # best first, when params.logprobs is not None; else None.
    logprobs: list[TokenLogprob | None]


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class Sampler:
    """Stateless; one per model runner. Does not modify ``logits``; advances seeded generators."""

    def __call__(self, logits: torch.Tensor, inputs: Sequence[SamplerInput]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(inputs), (tuple(logits.shape), len(inputs))
        assert logits.dtype == torch.float32, logits.dtype
        num_rows = len(inputs)
        penalised = [i for i, x in enumerate(inputs) if _has_penalty(x.params)]
        min_tokens = [i for i, x in enumerate(inputs) if len(x.output_token_ids) < x.params.min_tokens]
        sampled = [i for i, x in enumerate(inputs) if not x.params.greedy]
        with_logprobs = [i for i, x in enumerate(inputs) if x.params.logprobs is not None]

        if not (penalised or min_tokens or sampled or with_logprobs):
            # The common case: one kernel, one device-to-host copy.
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * num_rows)

        if penalised or min_tokens:
            logits = logits.clone()
            if penalised:
                _apply_penalties(logits, [inputs[i] for i in penalised], penalised)
            if min_tokens:
                _mask_stop_tokens(logits, [inputs[i] for i in min_tokens], min_tokens)

        token_ids = logits.argmax(dim=-1)  # [num_rows]; greedy rows keep theirs
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            # Advanced indexing copies, so _sample may work in place.
            token_ids[idx] = _sample(logits[idx], [inputs[i] for i in sampled])

        logprobs: list[TokenLogprob | None] = [None] * num_rows
        if with_logprobs:
            for i, lp in zip(with_logprobs, _logprobs(logits, token_ids, inputs, with_logprobs), strict=True):
                logprobs[i] = lp
        return SamplerOutput(token_ids.tolist(), logprobs)


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def _apply_penalties(logits: torch.Tensor, inputs: list[SamplerInput], rows: list[int]) -> None:
    """Repetition, presence and frequency penalties on ``logits[rows]``, in place."""
    num_rows, vocab_size = len(rows), logits.shape[1]
    device = logits.device
    idx = torch.tensor(rows, device=device)
    x = logits[idx]  # [P, V]
    pen = torch.tensor(
        [[p.repetition_penalty, p.presence_penalty, p.frequency_penalty] for p in (i.params for i in inputs)],
        dtype=torch.float32,
        device=device,
    )  # [P, 3]
    # Column V collects the padding and is dropped.
    out_ids = _pad([i.output_token_ids for i in inputs], vocab_size, device)  # [P, max_out]
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
    counts = counts[:, :vocab_size]  # [P, V]
    seen_in_output = counts > 0
    if any(i.params.repetition_penalty != 1.0 for i in inputs):
        prompt_ids = _pad([i.prompt_token_ids for i in inputs], vocab_size, device)  # [P, max_prompt]
        seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab_size] | seen_in_output  # [P, V]
        rep = pen[:, 0:1]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x -= pen[:, 1:2] * seen_in_output + pen[:, 2:3] * counts
    logits[idx] = x


def _mask_stop_tokens(logits: torch.Tensor, inputs: list[SamplerInput], rows: list[int]) -> None:
    """min_tokens not reached yet: eos (unless ignore_eos) and stop_token_ids can't be drawn."""
    vocab_size = logits.shape[1]
    r: list[int] = []
    c: list[int] = []
    for row, inp in zip(rows, inputs, strict=True):
        banned = set(inp.params.stop_token_ids)
        if not inp.params.ignore_eos:
            banned |= inp.eos_token_ids
        for t in sorted(banned):
            if t < vocab_size:
                r.append(row)
                c.append(t)
    if r:
        device = logits.device
        logits[torch.tensor(r, device=device), torch.tensor(c, device=device)] = float("-inf")


def _sample(x: torch.Tensor, inputs: list[SamplerInput]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then the exponential race. ``x`` [S, V] is overwritten."""
    num_rows, vocab_size = x.shape
    device = x.device
    params = [i.params for i in inputs]
    f = torch.tensor([[p.temperature, p.top_p, p.min_p] for p in params], dtype=torch.float32, device=device)
    temperature, top_p, min_p = f[:, 0:1], f[:, 1:2], f[:, 2:3]  # each [S, 1]
    x.div_(temperature)

    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        top_k = torch.tensor(ks, device=device)[:, None]  # [S, 1]
        _apply_top_k_top_p(x, top_k, top_p, max(ks))
    if any(p.min_p > 0.0 for p in params):
        probs = x.softmax(dim=-1)  # [S, V]
        x.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))

    q = torch.empty_like(x)  # [S, V] ~ Exp(1)
    seeded = [(j, i.generator) for j, i in enumerate(inputs) if i.generator is not None]
    if len(seeded) < num_rows:
        q.exponential_()
    for j, gen in seeded:
        assert gen.device.type == device.type, (gen.device, device)
        q[j].exponential_(generator=gen)
    # Exp(1) draws can be exactly 0 (u == 0); keep log finite so a masked -inf stays -inf.
    q.clamp_(min=torch.finfo(torch.float32).tiny)
    return (x - q.log()).argmax(dim=-1)


def _apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_top_k: int) -> None:
    """Mask to -inf all but the top_k largest, then all but the nucleus of mass top_p, in place.

    ``top_k`` [S, 1] (V when off), ``top_p`` [S, 1] (1.0 when off). One sort serves both; when
    every row has a top-k, a top-``max_top_k`` replaces the full-vocabulary sort (top-p only
    ever looks inside the top-k, so this is exact).
    """
    vocab_size = x.shape[1]
    if max_top_k < vocab_size:
        sorted_x, order = x.topk(max_top_k, dim=-1)  # [S, max_top_k], best first
        x.fill_(float("-inf"))
    else:
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # [S, V]
    pos = torch.arange(sorted_x.shape[1], device=x.device)[None, :]  # [1, K]
    sorted_x.masked_fill_(pos >= top_k, float("-inf"))
    probs = sorted_x.softmax(dim=-1)
    # Keep token i while the mass strictly before it is < top_p: the smallest prefix reaching
    # top_p, and always the first token (mass before it is 0 < top_p). Rows with top_p == 1
    # are left alone so float round-off in the cumsum can't drop their tail.
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_x.masked_fill_((mass_before >= top_p) & (top_p < 1.0), float("-inf"))
    x.scatter_(1, order, sorted_x)


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, inputs: Sequence[SamplerInput], rows: list[int]
) -> list[TokenLogprob]:
    idx = torch.tensor(rows, device=logits.device)
    lp = logits[idx].log_softmax(dim=-1)  # [L, V], float32
    chosen_ids = token_ids[idx]  # [L]
    chosen = lp.gather(1, chosen_ids[:, None]).squeeze(1).tolist()
    nums = [inputs[i].params.logprobs or 0 for i in rows]
    num_top = min(max(nums), lp.shape[1])
    top_lp: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if num_top > 0:
        values, indices = lp.topk(num_top, dim=-1)  # [L, num_top], sorted best first
        top_lp, top_ids = values.tolist(), indices.tolist()
    return [
        TokenLogprob(token_id=t, logprob=c, top=tuple(zip(ids[:n], vals[:n], strict=True)))
        for t, c, n, ids, vals in zip(chosen_ids.tolist(), chosen, nums, top_ids, top_lp, strict=True)
    ]
