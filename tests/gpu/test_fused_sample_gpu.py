"""The one-pass race of sampled rows (kernels/triton_sample.py, engine/fused_sampling.py) on the
device at the Llama-1B decode shape (64 x 128,256 fp32 logits): against the unfused path over the
same seeded draws, ties to the lowest index, and the distribution of unseeded rows."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pdserve.engine.sampler import Sampler, SamplerInput
from pdserve.engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROWS, VOCAB = 64, 128_256


def _input(params: SamplingParams, seed_draw: tuple[int, int] | None = None) -> SamplerInput:
    return SamplerInput(params, [], [], None, frozenset(), seed_draw=seed_draw)


@dataclass
class _Req:
    sampling_params: SamplingParams
    output_token_ids: list[int]


def _logits(seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(ROWS, VOCAB, device="cuda", generator=g) * 4


@torch.inference_mode()
def test_seeded_rows_equal_the_unfused_path_at_decode_shape() -> None:
    """Every row seeded (temperature 1 and 0.7, greedy rows between): the one-pass sampler's
    tokens equal the unfused sampler's (seeded draw kernel, torch clamp / log / argmax) and the
    torch reference computed from the same draws."""
    from pdserve.kernels.triton_seeded_draw import seeded_exponential_

    x = _logits(0)
    temps = [(1.0, 0.7, 0.0)[i % 3] for i in range(ROWS)]
    draws = [(1000 + i, 7 * i) for i in range(ROWS)]
    inputs = [
        _input(SamplingParams(temperature=t, seed=s), seed_draw=(s, k))
        for t, (s, k) in zip(temps, draws, strict=True)
    ]
    fused = Sampler(fused=True).sample(x, inputs).token_ids
    unfused = Sampler(fused=False).sample(x, inputs).token_ids
    q = torch.empty_like(x)
    table = torch.tensor([[i, s, k] for i, (s, k) in enumerate(draws)], device="cuda")
    seeded_exponential_(q, table[:, 0], table[:, 1], table[:, 2])
    t = torch.tensor(temps, device="cuda")[:, None]
    ref = torch.where(t > 0, x / t.clamp(min=1e-30) - q.clamp(min=torch.finfo(torch.float32).tiny).log(), x)
    assert fused.tolist() == unfused.tolist() == ref.argmax(dim=-1).tolist()
    # bf16 logits are raced as read (widened on load): the tokens of their fp32 copy.
    half = x.to(torch.bfloat16)
    assert Sampler(fused=True).reads_half_logits([_Req(i.params, []) for i in inputs], counter_draws=True)
    assert torch.equal(
        Sampler(fused=True).sample(half, inputs).token_ids,
        Sampler(fused=True).sample(half.float(), inputs).token_ids,
    )
    # A row's tokens do not depend on its batch position.
    rolled = Sampler(fused=True).sample(x.roll(5, 0), inputs[-5:] + inputs[:-5]).token_ids
    assert rolled.roll(-5, 0).tolist() == fused.tolist()


@torch.inference_mode()
def test_ties_and_minus_inf_at_decode_shape() -> None:
    x = _logits(1)
    x[0, [100_000, 5000, 4097]] = 100.0  # greedy: first of three maxima in two chunks
    x[1, [300, 200]] = 100.0  # greedy: a tie inside one chunk
    x[2:] = float("-inf")
    allowed = [3, 4095, 4096, 77_777, VOCAB - 1]
    x[2:, allowed] = torch.tensor([0.0, 1.0, -1.0, 0.5, 2.0], device="cuda")
    inputs = [_input(SamplingParams(temperature=0.0))] * 2 + [_input(SamplingParams(temperature=1.0))] * (
        ROWS - 2
    )
    tokens = Sampler(fused=True).sample(x, inputs).token_ids.tolist()
    assert tokens[:2] == [4097, 200]
    assert set(tokens[2:]) <= set(allowed) and len(set(tokens[2:])) > 2


@torch.inference_mode()
def test_unseeded_rows_sample_the_softmax() -> None:
    """20,000 unseeded temperature-0.7 rows in one step (the step key's draws at k = row): TV
    distance to softmax(x / T) within sampling noise (~0.005 expected, 0.02 bound); mixed with
    top-k rows, which keep their own path."""
    rows, logits, t = 20_000, torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")]), 0.7
    x = logits.cuda().expand(rows, -1).contiguous()
    inputs = [_input(SamplingParams(temperature=t, top_k=2 if i % 10 == 0 else 0)) for i in range(rows)]
    torch.manual_seed(0)
    tokens = Sampler(fused=True).sample(x, inputs).token_ids.cpu()
    one_pass = tokens[torch.arange(rows) % 10 != 0]
    tv = (
        0.5
        * (torch.bincount(one_pass, minlength=6) / len(one_pass) - torch.softmax(logits / t, 0)).abs().sum()
    )
    assert float(tv) < 0.02, float(tv)
    assert set(tokens[::10].tolist()) <= {0, 1}  # top-k 2
    torch.manual_seed(0)
    assert torch.equal(Sampler(fused=True).sample(x, inputs).token_ids.cpu(), tokens)
