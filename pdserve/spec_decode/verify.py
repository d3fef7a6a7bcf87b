"""Verification of draft tokens against the target's logits (one forward, 1 + m rows a request).

Row j of a request scores position p + 1 + j with the drafts d_1..d_j in its history, so
penalties and min_tokens see them exactly as they would without speculation
(``pdserve.engine.sampler.penalise``); temperature, top-k, top-p and min-p then give the target
distribution P_j of that position (``apply_sampling_transforms``), the one the sampler draws from.

    greedy rows    accept d_{j+1} while it equals argmax P_j; then emit argmax P_a
    sampled rows   row j draws the token t_j that the sampler would draw at that position (the
                   exponential race over P_j, from the draws of the request's token index
                   k + j); accept d_{j+1} while t_j == d_{j+1}; then emit t_a

Drafts are point masses (n-gram lookup, and the draft model's and MTP module's argmax), so
"accept while the target's own sample equals the draft" is the rejection rule min(1, P(d) / Q(d))
= P(d), and a rejected position emits a sample of P given "not d", which is the residual
max(0, P - Q) normalised. Every emitted token is therefore the token the engine without drafts
would have drawn from the same logits and the same draws: a seeded request's tokens are a
function of its seed and token indices alone, whichever steps carried drafts (its draws come
from the counter-based stream at index k + j on CUDA, and from its generator, one row of V per
emitted token and nothing more, elsewhere). The test draws 20k tokens from synthetic logits and
compares distributions, and shows wrong rules failing. Logprobs of the emitted tokens come from
row j's penalised logits, as the sampler's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve import kernels
from pdserve.engine.fused_sampling import SeedDraw, fused_sampling_enabled
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.race import race_drawn
from pdserve.engine.sampler import (
    SamplerInput,
    ToDevice,
    apply_sampling_transforms,
    draw_,
    logprobs_of,
    penalise,
    race,
)

# (the target's sample at a draft's position, the draft) -> accept the draft?
AcceptRule = Callable[[int, int], bool]


def accept_point_mass_draft(sample: int, draft: int) -> bool:
    """Rejection sampling against a point-mass draft: accept while the target's own sample is
    the draft (probability P(d) = min(1, P(d) / Q(d)))."""
    return sample == draft


@dataclass
class VerifyGroup:
    """One request's rows: its sampling state (row 0's history) and the drafts of this step.
    ``input.seed_draw`` (seed, k), where set, is row 0's: row j draws at token index k + j."""

    request_id: str
    input: SamplerInput
    drafts: Sequence[int]


@dataclass
class VerifyOutput:
    tokens: dict[str, list[int]]  # request id -> accepted drafts + the correction / bonus token
    logprobs: dict[str, list[TokenLogprob]]  # requests that asked for logprobs: one per token


def _row_inputs(groups: Sequence[VerifyGroup]) -> list[SamplerInput]:
    rows: list[SamplerInput] = []
    for g in groups:
        x, p = g.input, g.input.params
        history_matters = p.has_penalties or len(x.output_token_ids) < p.min_tokens
        for j in range(len(g.drafts) + 1):
            if j and history_matters:
                rows.append(dataclasses.replace(x, output_token_ids=x.output_token_ids + list(g.drafts[:j])))
            else:
                rows.append(x)
    return rows


def verify(
    logits: torch.Tensor,
    groups: Sequence[VerifyGroup],
    put: ToDevice,
    accept: AcceptRule = accept_point_mass_draft,
    fused: bool | None = None,
) -> VerifyOutput:
    """``logits`` [sum(1 + m_g), V] float32, the groups' rows back to back. ``accept`` exists for
    the test that shows a wrong rule failing; callers keep the default. ``fused``: the node's
    sampler's setting (``Sampler.fused``), so verified rows race as its plain rows do (None: the
    process setting, ``PDSERVE_FUSED_SAMPLING``)."""
    if fused is None:
        fused = fused_sampling_enabled()
    assert logits.dtype == torch.float32 and logits.shape[0] == sum(len(g.drafts) + 1 for g in groups)
    inputs = _row_inputs(groups)
    pen = penalise(logits, inputs, put)  # [R, V]
    greedy_ids = kernels.argmax_rows(pen).tolist()
    offsets, off = [], 0
    for g in groups:
        offsets.append(off)
        off += len(g.drafts) + 1
    sampled = [i for i, g in enumerate(groups) if not g.input.params.greedy]
    samples: dict[int, list[int]] = {}
    if sampled:
        rows = [offsets[i] + j for i in sampled for j in range(len(groups[i].drafts) + 1)]
        x = pen[put(rows, torch.long)]  # [S, V], a copy
        apply_sampling_transforms(x, [inputs[r].params for r in rows], put)
        samples = _sample_rows(x, groups, sampled, put, accept, fused)
    tokens: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        m = len(g.drafts)
        drawn = samples[i] if i in samples else greedy_ids[offsets[i] : offsets[i] + m + 1]
        rule = accept if i in samples else accept_point_mass_draft
        a = 0
        while a < m and rule(drawn[a], g.drafts[a]):
            a += 1
        tokens[g.request_id] = list(g.drafts[:a]) + [drawn[a]]
    return VerifyOutput(tokens, _logprobs(pen, groups, offsets, inputs, tokens, put))


def _sample_rows(
    x: torch.Tensor,
    groups: Sequence[VerifyGroup],
    sampled: list[int],
    put: ToDevice,
    accept: AcceptRule,
    fused: bool,
) -> dict[int, list[int]]:
    """Sampled group -> the target's sample of each of its rows that decides something: every
    row of a group drawing from the default generator or the counter-based stream (one race over
    them all), and, for a group with its own generator, rows drawn one at a time up to the first
    rejection, so the generator advances by one row of V draws per emitted token, as the plain
    sampler advances it. ``x`` [S, V]: the sampled groups' rows after the sampling transforms."""
    starts, s = {}, 0
    for i in sampled:
        starts[i] = s
        s += len(groups[i].drafts) + 1
    lazy = [i for i in sampled if groups[i].input.generator is not None]
    batch = [i for i in sampled if groups[i].input.generator is None]
    out: dict[int, list[int]] = {}
    if batch:
        rows = [starts[i] + j for i in batch for j in range(len(groups[i].drafts) + 1)]
        xb = x if not lazy else x[put(rows, torch.long)]
        draws: list[SeedDraw] = []  # row j of a group draws at its token index k + j
        for i in batch:
            sd = groups[i].input.seed_draw
            draws.extend(None if sd is None else (sd[0], sd[1] + j) for j in range(len(groups[i].drafts) + 1))
        drawn = race_drawn(xb, draws, put, fused).tolist()
        r = 0
        for i in batch:
            n = len(groups[i].drafts) + 1
            out[i] = drawn[r : r + n]
            r += n
    for i in lazy:
        g = groups[i]
        gen, m = g.input.generator, len(g.drafts)
        out[i] = []
        for j in range(m + 1):
            row = x[starts[i] + j : starts[i] + j + 1]
            q = torch.empty_like(row)
            draw_(q[0], gen)
            out[i].append(int(race(row, q)[0]))
            if j == m or not accept(out[i][j], g.drafts[j]):
                break
    return out


def _logprobs(
    pen: torch.Tensor,
    groups: Sequence[VerifyGroup],
    offsets: list[int],
    inputs: list[SamplerInput],
    tokens: dict[str, list[int]],
    put: ToDevice,
) -> dict[str, list[TokenLogprob]]:
    want = [i for i, g in enumerate(groups) if g.input.params.logprobs is not None]
    if not want:
        return {}
    rows = [offsets[i] + j for i in want for j in range(len(tokens[groups[i].request_id]))]
    ids = [t for i in want for t in tokens[groups[i].request_id]]
    lps = logprobs_of(pen[put(rows, torch.long)], put(ids, torch.long), [inputs[r] for r in rows], put)
    out: dict[str, list[TokenLogprob]] = {}
    it = iter(lps)
    for i in want:
        rid = groups[i].request_id
        out[rid] = [lp for lp in (next(it) for _ in tokens[rid]) if lp is not None]
    return out
