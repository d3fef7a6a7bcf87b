"""Verification of draft tokens against the target's logits (one forward, 1 + m rows a request).

Row j of a request scores position p + 1 + j with the drafts d_1..d_j in its history, so
penalties and min_tokens see them exactly as they would without speculation
(``pdserve.engine.sampler.penalise``); temperature, top-k, top-p and min-p then give the target
distribution P_j of that position (``apply_sampling_transforms``), the one the sampler draws from.

    greedy rows    accept d_{j+1} while it equals argmax P_j; then emit argmax P_a
    sampled rows   the drafter's distribution is a point mass on d_{j+1} (n-gram), so the
                   rejection rule min(1, P(d) / Q(d)) is: accept with probability P_j(d_{j+1});
                   on the first rejection draw from the residual max(0, P_a - Q) normalised =
                   P_a without d_{a+1}; after m acceptances draw the bonus token from P_m

Every emitted token is therefore distributed as without speculation (the test draws 20k tokens
from synthetic logits and compares, and shows a wrong rule failing). A seeded request draws its
m uniforms, then one race row of V values, from its own generator: the same seed, batch and
drafts give the same tokens. Logprobs of the emitted tokens come from row j's penalised logits,
as the sampler's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve import kernels
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampler import (
    SamplerInput,
    ToDevice,
    apply_sampling_transforms,
    draw_,
    logprobs_of,
    penalise,
    race,
)

# (uniform draw u in [0, 1), target probability of the draft token) -> accept?
AcceptRule = Callable[[float, float], bool]


def accept_point_mass_draft(u: float, p_draft: float) -> bool:
    """Rejection sampling against a point-mass draft: accept with probability P(d) = min(1, P/Q)."""
    return u < p_draft


@dataclass
class VerifyGroup:
    """One request's rows: its sampling state (row 0's history) and the drafts of this step."""

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
    residual: bool = True,
) -> VerifyOutput:
    """``logits`` [sum(1 + m_g), V] float32, the groups' rows back to back. ``accept`` and
    ``residual`` (draw from P less the rejected draft) exist for the test that shows a wrong
    rule failing; callers keep the defaults."""
    assert logits.dtype == torch.float32 and logits.shape[0] == sum(len(g.drafts) + 1 for g in groups)
    device = logits.device
    inputs = _row_inputs(groups)
    pen = penalise(logits, inputs, put)  # [R, V]
    greedy_ids = kernels.argmax_rows(pen).tolist()
    offsets, off = [], 0
    for g in groups:
        offsets.append(off)
        off += len(g.drafts) + 1
    sampled = [i for i, g in enumerate(groups) if not g.input.params.greedy]
    # Sampled groups: their rows' processed logits (x) and the target probability of each draft.
    srow_of: dict[int, int] = {}  # logits row -> row of x
    x = None
    p_draft: list[float] = []
    uniforms: list[list[float]] = []
    if sampled:
        rows = [offsets[i] + j for i in sampled for j in range(len(groups[i].drafts) + 1)]
        srow_of = {r: k for k, r in enumerate(rows)}
        x = pen[put(rows, torch.long)]  # [S, V], a copy
        apply_sampling_transforms(x, [inputs[r].params for r in rows], put)
        d_rows = [srow_of[offsets[i] + j] for i in sampled for j in range(len(groups[i].drafts))]
        d_tok = [t for i in sampled for t in groups[i].drafts]
        if d_rows:
            logp = x[put(d_rows, torch.long)].log_softmax(dim=-1)
            p_draft = logp.gather(1, put(d_tok, torch.long)[:, None]).exp().squeeze(1).tolist()
        # Acceptance draws: a seeded request's from its generator, the others' in one call.
        unseeded = [len(groups[i].drafts) for i in sampled if groups[i].input.generator is None]
        shared = iter(torch.rand(sum(unseeded), device=device).tolist())
        for i in sampled:
            m, gen = len(groups[i].drafts), groups[i].input.generator
            if gen is None:
                uniforms.append([next(shared) for _ in range(m)])
            else:
                uniforms.append(torch.rand(m, generator=gen, device=device).tolist() if m else [])
    # Host decisions.
    tokens: dict[str, list[int]] = {}
    finals: list[tuple[int, int, int | None]] = []  # (group, final row of x, draft to exclude)
    k_s = 0
    pd = iter(p_draft)
    for i, g in enumerate(groups):
        m, base = len(g.drafts), offsets[i]
        a = 0
        if g.input.params.greedy:
            while a < m and greedy_ids[base + a] == g.drafts[a]:
                a += 1
            tokens[g.request_id] = list(g.drafts[:a]) + [greedy_ids[base + a]]
            continue
        probs = [next(pd) for _ in range(m)]
        u = uniforms[k_s]
        k_s += 1
        while a < m and accept(u[a], probs[a]):
            a += 1
        tokens[g.request_id] = list(g.drafts[:a])
        finals.append((i, srow_of[base + a], g.drafts[a] if a < m and residual else None))
    if finals:
        assert x is not None
        f = x[put([r for _, r, _ in finals], torch.long)]  # [F, V], a copy
        excl = [(k, d) for k, (_, _, d) in enumerate(finals) if d is not None]
        if excl:
            minus_inf = torch.full((len(excl),), float("-inf"), device=device)
            f.index_put_(
                (put([k for k, _ in excl], torch.long), put([d for _, d in excl], torch.long)), minus_inf
            )
        q = torch.empty_like(f)
        seeded = [(k, groups[i].input.generator) for k, (i, _, _) in enumerate(finals)]
        if any(gen is None for _, gen in seeded):
            draw_(q, None)
        for k, gen in seeded:
            if gen is not None:
                draw_(q[k], gen)
        for (i, _, _), t in zip(finals, race(f, q).tolist(), strict=True):
            tokens[groups[i].request_id].append(t)
    return VerifyOutput(tokens, _logprobs(pen, groups, offsets, inputs, tokens, put))


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
