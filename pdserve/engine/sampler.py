"""Turn one step's logits into next tokens (and logprobs), one row per running request.

Per row, in this order (vLLM / OpenAI semantics)::

    logits ─► grammar mask               done by the model runner, in place, before this module
           ─► repetition penalty         prompt + output tokens: x > 0 → x / r, else x · r
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
On the CPU the draws are uniform and turned into Exp(1) in one vectorised pass (``draw_``).

Where the logits take the Triton kernels (CUDA), greedy and temperature-only sampled rows get
their tokens from one race launch that reads each row once and draws q in registers, from the
counter-based stream (seeded rows: (seed, k); unseeded rows: a per-step key from torch's
default generator); other sampled rows race in the same kernel after their transforms
(``pdserve.engine.fused_sampling``). ``PDSERVE_FUSED_SAMPLING=0`` keeps the unfused path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve import kernels
from pdserve.engine.fused_sampling import (
    SeedDraw,
    ToDevice,
    counter_race_applies,
    fused_sampling_enabled,
    one_pass_only,
    temperature_only,
)
from pdserve.engine.host_batch import PinnedStaging
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.race import counter_race, race_drawn, step_key
from pdserve.engine.race import draw_ as draw_
from pdserve.engine.race import race as race
from pdserve.engine.sampled import SampledTensors, SamplerOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels.backend import small_to_device


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
    # Seeded requests on CUDA instead of ``generator``: (seed, k) for the request's k-th sampled
    # token (k = its output length when this token is sampled); the row's draws are the
    # counter-based stream of ``kernels.triton_seeded_draw``, all such rows in one launch.
    seed_draw: tuple[int, int] | None = None


def argmax_only(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a row's token is the plain argmax of its logits (the sampler's fast path): greedy,
    no penalties, no logprobs, min_tokens reached. A grammar does not leave this path: the model
    runner masks the row's logits in place before the argmax."""
    return (
        params.greedy
        and params.logprobs is None
        and not params.has_penalties
        and num_output_tokens >= params.min_tokens
    )


class SampledRequest(Protocol):
    """What ``Sampler.reads_half_logits`` reads of a request (``engine.request.Request``)."""

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def output_token_ids(self) -> list[int]: ...


class Sampler:
    """Stateless; one per model runner. Does not modify ``logits``; advances seeded generators.

    ``staging``: the runner's pinned buffers, so the small index tensors of penalties, top-k and
    the like reach the device without a synchronising copy. ``fused``: sampled rows race in one
    pass on the Triton path (``pdserve.engine.fused_sampling``); None reads
    ``PDSERVE_FUSED_SAMPLING``.
    """

    def __init__(self, staging: PinnedStaging | None = None, fused: bool | None = None) -> None:
        self.staging = staging
        self.fused = fused_sampling_enabled() if fused is None else fused

    def reads_half_logits(self, requests: Iterable[SampledRequest], counter_draws: bool) -> bool:
        """Whether ``sample`` races bf16 / fp16 logits of these requests' rows without widening
        them, so the caller may skip its fp32 copy: the one-pass path on, draws from the
        counter-based stream, every row ``one_pass_only``."""
        return (
            self.fused
            and counter_draws
            and all(one_pass_only(r.sampling_params, len(r.output_token_ids), True) for r in requests)
        )

    def _to_device(self, device: torch.device) -> ToDevice:
        staging = self.staging
        if staging is not None and staging.device.type == device.type:
            return staging.list_to_device
        return lambda data, dtype: small_to_device(data, dtype, device)

    def __call__(self, logits: torch.Tensor, inputs: Sequence[SamplerInput]) -> SamplerOutput:
        return self.sample(logits, inputs).output()

    def sample(self, logits: torch.Tensor, inputs: Sequence[SamplerInput]) -> SampledTensors:
        """The step's tokens (and logprobs) as device tensors. Greedy rows without penalties or
        min_tokens queue device work only; the other paths may copy small index tensors."""
        assert logits.dim() == 2 and logits.shape[0] == len(inputs), (tuple(logits.shape), len(inputs))
        if all(argmax_only(x.params, len(x.output_token_ids)) for x in inputs):
            return SampledTensors(kernels.argmax_rows(logits), [], [])  # the common case: one kernel
        fused = self.fused and counter_race_applies(logits)
        if logits.dtype != torch.float32:
            # Half-precision logits serve only rows the race launch alone handles (one_pass_only).
            if fused and all(
                one_pass_only(x.params, len(x.output_token_ids), x.generator is None) for x in inputs
            ):
                return SampledTensors(_race_all(logits, inputs, self._to_device(logits.device)), [], [])
            logits = logits.float()
        sampled = [i for i, x in enumerate(inputs) if not x.params.greedy]
        with_logprobs = [i for i, x in enumerate(inputs) if x.params.logprobs is not None]

        put = self._to_device(logits.device)
        logits = penalise(logits, inputs, put)

        if fused:
            token_ids = _race_all(logits, inputs, put)
        else:
            token_ids = kernels.argmax_rows(logits)  # [num_rows]; greedy rows keep theirs
            if sampled:
                idx = put(sampled, torch.long)
                # Advanced indexing copies, so _sample may work in place.
                rows = [inputs[i] for i in sampled]
                token_ids[idx] = _sample(logits[idx], rows, put, False, [x.seed_draw for x in rows])

        out = SampledTensors(token_ids, [], [])
        if with_logprobs:
            _logprobs(logits, token_ids, inputs, with_logprobs, out, put)
        return out


def _pad(rows: list[list[int]], pad: int, put: ToDevice) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return put([r + [pad] * (width - len(r)) for r in rows], torch.long)


def _apply_penalties(
    logits: torch.Tensor, inputs: list[SamplerInput], rows: list[int], put: ToDevice
) -> None:
    """Repetition, presence and frequency penalties on ``logits[rows]``, in place."""
    num_rows, vocab_size = len(rows), logits.shape[1]
    device = logits.device
    idx = put(rows, torch.long)
    x = logits[idx]  # [P, V]
    pen = put(
        [[p.repetition_penalty, p.presence_penalty, p.frequency_penalty] for p in (i.params for i in inputs)],
        torch.float32,
    )  # [P, 3]
    # Column V collects the padding and is dropped.
    out_ids = _pad([i.output_token_ids for i in inputs], vocab_size, put)  # [P, max_out]
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
    counts = counts[:, :vocab_size]  # [P, V]
    seen_in_output = counts > 0
    if any(i.params.repetition_penalty != 1.0 for i in inputs):
        prompt_ids = _pad([i.prompt_token_ids for i in inputs], vocab_size, put)  # [P, max_prompt]
        seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab_size] | seen_in_output  # [P, V]
        rep = pen[:, 0:1]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x -= pen[:, 1:2] * seen_in_output + pen[:, 2:3] * counts
    logits[idx] = x


def _mask_stop_tokens(
    logits: torch.Tensor, inputs: list[SamplerInput], rows: list[int], put: ToDevice
) -> None:
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
        # index_put_ of a device tensor: assigning a Python float would copy it from the host.
        minus_inf = torch.full((len(r),), float("-inf"), dtype=logits.dtype, device=logits.device)
        logits.index_put_((put(r, torch.long), put(c, torch.long)), minus_inf)


def _race_all(logits: torch.Tensor, inputs: Sequence[SamplerInput], put: ToDevice) -> torch.Tensor:
    """Every row's token on the Triton path: one race launch for greedy and temperature-only
    rows, then ``_sample`` for the other sampled rows (``pdserve.engine.fused_sampling``)."""
    draws: list[SeedDraw] = []
    temps: list[float] = []
    rest: list[int] = []  # sampled rows that are not one-pass
    need_key = False
    for i, x in enumerate(inputs):
        draws.append(x.seed_draw)
        need_key = need_key or (x.seed_draw is None and x.generator is None and not x.params.greedy)
        one_pass = x.generator is None and temperature_only(x.params)
        temps.append(x.params.temperature if one_pass else 0.0)
        if not one_pass and not x.params.greedy:
            rest.append(i)
    key = step_key() if need_key else 0
    token_ids = counter_race(logits, draws, temps, key, put)
    if rest:
        # An unseeded row draws at k = its row in ``logits``, here too.
        rest_draws = [draws[i] if draws[i] is not None else (key, i) for i in rest]
        idx = put(rest, torch.long)
        token_ids[idx] = _sample(logits[idx], [inputs[i] for i in rest], put, True, rest_draws)
    return token_ids


def _sample(
    x: torch.Tensor, inputs: list[SamplerInput], put: ToDevice, fused: bool, draws: list[SeedDraw]
) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then the exponential race. ``x`` [S, V] is overwritten."""
    apply_sampling_transforms(x, [i.params for i in inputs], put)
    return race_drawn(x, draws, put, fused, [i.generator for i in inputs])


def penalise(logits: torch.Tensor, inputs: Sequence[SamplerInput], put: ToDevice) -> torch.Tensor:
    """Penalties and the min_tokens mask of every row (a copy when any applies, else ``logits``):
    what greedy rows take the argmax of and logprobs describe."""
    penalised = [i for i, x in enumerate(inputs) if x.params.has_penalties]
    min_tokens = [i for i, x in enumerate(inputs) if len(x.output_token_ids) < x.params.min_tokens]
    if penalised or min_tokens:
        logits = logits.clone()
        if penalised:
            _apply_penalties(logits, [inputs[i] for i in penalised], penalised, put)
        if min_tokens:
            _mask_stop_tokens(logits, [inputs[i] for i in min_tokens], min_tokens, put)
    return logits


def apply_sampling_transforms(x: torch.Tensor, params: list[SamplingParams], put: ToDevice) -> None:
    """Temperature, top-k, top-p and min-p of sampled rows, in place: softmax(x) is then the
    distribution a row's token is drawn from."""
    vocab_size = x.shape[1]
    f = put([[p.temperature, p.top_p, p.min_p] for p in params], torch.float32)
    temperature, top_p, min_p = f[:, 0:1], f[:, 1:2], f[:, 2:3]  # each [S, 1]
    x.div_(temperature)

    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        top_k = put(ks, torch.long)[:, None]  # [S, 1]
        _apply_top_k_top_p(x, top_k, top_p, max(ks))
    if any(p.min_p > 0.0 for p in params):
        probs = x.softmax(dim=-1)  # [S, V]
        x.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))


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
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    inputs: Sequence[SamplerInput],
    rows: list[int],
    out: SampledTensors,
    put: ToDevice,
) -> None:
    """Fill ``out``'s logprob tensors for ``rows`` (device tensors; nothing is read back here)."""
    idx = put(rows, torch.long)
    lp = logits[idx].log_softmax(dim=-1)  # [L, V], float32
    out.logprob_rows = list(rows)
    out.chosen_logprobs = lp.gather(1, token_ids[idx][:, None]).squeeze(1)  # [L]
    out.num_top = [inputs[i].params.logprobs or 0 for i in rows]
    num_top = min(max(out.num_top), lp.shape[1])
    if num_top > 0:
        out.top_logprobs, out.top_token_ids = lp.topk(num_top, dim=-1)  # [L, num_top], best first


def logprobs_of(
    logits: torch.Tensor, token_ids: torch.Tensor, inputs: Sequence[SamplerInput], put: ToDevice
) -> list[TokenLogprob | None]:
    """Each row's TokenLogprob for ``token_ids`` (rows whose params ask for logprobs; else None),
    read back to the host (pdserve.spec_decode's verified rows)."""
    rows = [i for i, x in enumerate(inputs) if x.params.logprobs is not None]
    if not rows:
        return [None] * len(inputs)
    out = SampledTensors(token_ids, [], [])
    _logprobs(logits, token_ids, inputs, rows, out, put)
    return out.output().logprobs
