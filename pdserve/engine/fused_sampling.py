"""Sampled rows in one pass over the vocabulary on the Triton path (``kernels/triton_sample.py``).

Where the sampler's logits take the Triton kernels (CUDA, or the interpreter with the backend
forced), a step's rows go to one race launch (two kernels: chunks, merge):

    greedy rows                          argmax (temperature 0 in the table)
    sampled rows, temperature only       argmax(x / T - log q), q drawn in registers: the logits
    (no top-k / top-p / min-p, no         are read once instead of ~8 full-vocabulary passes
    per-request torch.Generator)          (gather, divide, draw, clamp, log, subtract, argmax,
                                          scatter)
    other sampled rows                   argmax here, then replaced by ``Sampler``'s path:
                                          gather, transforms, and the same race launch at T = 1

Penalties and the min_tokens mask come before (``penalise``). The draws ``q`` are the
counter-based stream of ``kernels/triton_seeded_draw.py``: a seeded row's (seed, k) from
``SamplerInput.seed_draw``; an unseeded row's (key, row), ``key`` drawn once per step on the
host from torch's default generator (``race.step_key``), so ``torch.manual_seed`` makes a run
reproducible and no device generator is read. The per-row parameters travel in one int64 table,
one host-to-device copy (``race.counter_race``).

``PDSERVE_FUSED_SAMPLING`` (default 1) is read once, when the first sampler is made; 0 keeps the
unfused path everywhere (torch ops, ``exponential_`` for unseeded rows, the seeded draw kernel
for seeded ones). The two paths compute x / T - log q with different log implementations, so a
seeded request can differ between them where two candidates tie to the last bit: give every
node of a deployment the same setting.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import torch

from pdserve import kernels
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import ConfigError
from pdserve.kernels.backend import device_unsupported_reason

ENV_FUSED_SAMPLING = "PDSERVE_FUSED_SAMPLING"

# Makes a small device tensor from Python values: (data, dtype) -> tensor on the logits' device.
ToDevice = Callable[[list, torch.dtype], torch.Tensor]
# (seed, k) of a row's draws, or None: the step key's draws at k = the row's index
SeedDraw = tuple[int, int] | None


@functools.cache
def fused_sampling_enabled() -> bool:
    """``PDSERVE_FUSED_SAMPLING``: "1" (default) or "0"; anything else raises ConfigError."""
    value = os.environ.get(ENV_FUSED_SAMPLING, "1")
    if value not in ("0", "1"):
        raise ConfigError(
            f"{ENV_FUSED_SAMPLING}={value!r} is not supported: set 1 (one-pass sampling on the "
            "Triton path, the default) or 0 (the unfused torch path)"
        )
    return value == "1"


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def counter_race_applies(logits: torch.Tensor) -> bool:
    """Whether these logits' rows race in the Triton kernel (CUDA with the backend not forced to
    torch, or the interpreter with it forced to triton)."""
    return (
        kernels.wants_triton(logits)
        and _triton_installed()
        and logits.dim() == 2
        and logits.shape[1] > 0
        and device_unsupported_reason(logits) is None
    )


def temperature_only(params: SamplingParams) -> bool:
    """A sampled row whose distribution is softmax(x / T): no top-k, top-p or min-p."""
    return not params.greedy and params.top_k == 0 and params.top_p >= 1.0 and params.min_p == 0.0


def one_pass_only(params: SamplingParams, num_output_tokens: int, counter_draws: bool) -> bool:
    """Whether the race launch alone gives a row its token: greedy or temperature-only (drawn
    from the counter-based stream: ``counter_draws``, or no seed), no penalties, no logprobs,
    min_tokens reached. Such rows may hand the sampler bf16 / fp16 logits: the kernel widens
    them to fp32 as it loads them, exactly as an fp32 copy would hold them, and the copy's
    pass over the vocabulary is saved."""
    drawn_here = params.greedy or (temperature_only(params) and (counter_draws or params.seed is None))
    return (
        drawn_here
        and params.logprobs is None
        and not params.has_penalties
        and num_output_tokens >= params.min_tokens
    )
