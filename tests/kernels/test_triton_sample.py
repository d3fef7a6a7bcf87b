"""kernels/triton_sample.py and the sampler's one-pass path (engine/fused_sampling.py): the race
kernel's tokens against the unfused reference computed from the same draws (x / T - log q, q
from kernels/triton_seeded_draw.py), ties, -inf entries, batch-position independence, a mixed
batch through ``Sampler.sample``, and the distribution of the stream. CPU runs use
TRITON_INTERPRET=1 (tests/kernels/conftest.py), which costs ~20-50 ms a program whatever its
width: few rows, few chunks. tests/gpu/test_fused_sample_gpu.py runs the full shape."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.engine.sampler import Sampler, SamplerInput
from pdserve.engine.sampling_params import SamplingParams

TINY = torch.finfo(torch.float32).tiny


@pytest.fixture
def kern(force_triton):
    from pdserve.kernels import triton_sample, triton_seeded_draw

    return triton_sample, triton_seeded_draw


def _reference(x: torch.Tensor, rows: list[tuple[int, int, float]], draw) -> torch.Tensor:
    """The unfused race: q from the seeded draw kernel, clamp, log, subtract, torch argmax."""
    q = torch.ones_like(x)
    seeds, ks = [r[0] for r in rows], [r[1] for r in rows]
    ids = torch.arange(len(rows), device=x.device)
    draw(q, ids, torch.tensor(seeds, device=x.device), torch.tensor(ks, device=x.device))
    t = torch.tensor([[r[2]] for r in rows], device=x.device)
    raced = x / t.clamp(min=TINY) - q.clamp(min=TINY).log()
    return torch.where(t > 0, raced, x).argmax(dim=-1)


def _race(kern, x: torch.Tensor, rows: list[tuple[int, int, float]]) -> torch.Tensor:
    ts, _ = kern
    table = torch.tensor([ts.race_table_row(*r) for r in rows], device=x.device)
    return ts.race_rows(x, table)


def test_tokens_equal_the_unfused_race_on_the_same_draws(kern, device) -> None:
    n_cols = 9000  # three chunks of 4,096, the last partial
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, n_cols, generator=g) * 3).to(device)
    x[2, [7000, 100, 60]] = 50.0  # greedy row: ties within a chunk and across go to the lowest index
    x[3] = float("-inf")
    finite = [17, 4100, 8999]
    x[3, finite] = torch.tensor([-40.0, -41.0, -40.5], device=device)  # tiny but finite mass
    rows = [(1234, 0, 1.0), (2**62 + 5, 123_456_789, 0.5), (9, 3, 0.0), (77, 2, 1.0)]
    out = _race(kern, x, rows)
    assert out.tolist() == _reference(x, rows, kern[1].seeded_exponential_).tolist()
    assert out[2] == 60
    assert int(out[3]) in finite


def test_rows_are_independent_of_their_batch_position(kern, device) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 300, generator=g).to(device)
    rows = [(5, 0, 0.7), (5, 1, 0.7), (6, 0, 1.3)]
    out = _race(kern, x, rows)
    flipped = _race(kern, x.flip(0).contiguous(), rows[::-1])
    assert out.tolist() == flipped.flip(0).tolist()
    assert out.tolist() == _reference(x, rows, kern[1].seeded_exponential_).tolist()


def _input(params: SamplingParams, seed_draw: tuple[int, int] | None = None) -> SamplerInput:
    return SamplerInput(params, [], [], None, frozenset(), seed_draw=seed_draw)


def test_a_mixed_batch_through_the_sampler(kern, device) -> None:
    """Greedy, temperature-only (seeded and not), top-k, top-p and penalised rows in one step:
    one-pass rows equal the unfused race over the same draws (unseeded rows: the step key's at
    k = their row), the others their own path, and torch.manual_seed replays the step."""
    from pdserve.engine.race import step_key

    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 64, generator=g).to(device)
    sp = SamplingParams
    inputs = [
        _input(sp(temperature=0.0)),
        _input(sp(temperature=1.0)),
        _input(sp(temperature=0.5, seed=3), seed_draw=(3, 4)),
        _input(sp(temperature=1.0, top_k=1, seed=8), seed_draw=(8, 0)),
        _input(sp(temperature=2.0, top_p=1e-6)),
        _input(sp(temperature=0.5, presence_penalty=2.0), seed_draw=(1, 1)),
        _input(sp(temperature=1.5, top_k=3, seed=9), seed_draw=(9, 2)),  # transformed, then raced
        _input(sp(temperature=1.5, top_k=3)),  # at T = 1 with its own draws
    ]
    inputs[5].output_token_ids = [int(x[5].argmax())]  # the penalty moves this row's argmax
    torch.manual_seed(11)
    key = step_key()
    sampler = Sampler(fused=True)
    torch.manual_seed(11)
    tokens = sampler.sample(x, inputs).token_ids.tolist()
    torch.manual_seed(11)
    assert sampler.sample(x, inputs).token_ids.tolist() == tokens
    pen = x.clone()
    pen[5, inputs[5].output_token_ids[0]] -= 2.0
    one_pass = _reference(pen[:6], [(0, 0, 0.0), (key, 1, 1.0), (3, 4, 0.5), (0, 0, 0.0), (0, 0, 0.0), (1, 1, 0.5)],
                          kern[1].seeded_exponential_)  # fmt: skip
    assert [tokens[i] for i in (0, 1, 2, 5)] == [int(one_pass[i]) for i in (0, 1, 2, 5)]
    assert tokens[3:5] == x[3:5].argmax(dim=-1).tolist()  # top-k 1, top-p 1e-6: the argmax
    # top-k 3 at T = 1.5: x / T outside the top 3 masked, raced at T = 1 over (seed, k) or (key, row)
    top = x[6:8] / 1.5
    top[top < top.topk(3, dim=-1).values[:, -1:]] = float("-inf")
    rest = _reference(top, [(9, 2, 1.0), (key, 7, 1.0)], kern[1].seeded_exponential_)
    assert tokens[6:8] == rest.tolist()


def _philox_exponential(seed: int, counters: np.ndarray) -> np.ndarray:
    from tests.kernels.test_seeded_draw import _philox_uniform

    return -np.log(np.float32(1.0) - _philox_uniform(seed, counters))


def test_the_keyed_stream_samples_the_softmax() -> None:
    """20,000 unseeded rows of one step (key, k = row) raced as the kernel races them, with the
    stream computed by the numpy Philox reference (the kernel equals it: tests above and
    test_seeded_draw.py): the tokens' distribution is softmax(x / T) within sampling noise (TV
    ~0.005 expected; 0.02 bound), and a wrong temperature (x * T) is far off."""
    n_rows, logits, t = 20_000, np.array([2.0, 1.0, 0.5, 0.0, -1.0, -np.inf], np.float32), 0.7
    v = len(logits)
    counters = (np.arange(n_rows, dtype=np.int64)[:, None] * v + np.arange(v)).ravel()
    q = np.maximum(_philox_exponential(987_654_321, counters).reshape(n_rows, v), np.float32(TINY))
    target = torch.softmax(torch.tensor(logits) / t, dim=0).numpy()
    for scale, expect_close in ((1 / t, True), (t, False)):
        tokens = np.argmax(logits * np.float32(scale) - np.log(q), axis=1)
        tv = 0.5 * np.abs(np.bincount(tokens, minlength=v) / n_rows - target).sum()
        assert (tv < 0.02) == expect_close, (scale, tv)
    assert not np.any(tokens == v - 1)  # -inf never drawn


def test_half_logits_race_as_their_fp32_copy(kern, device) -> None:
    """bf16 logits: rows the race alone serves are read as bf16 (widened on load, exact); a
    batch with a top-k row is widened first. Tokens equal those of the fp32 copy either way."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
    sp = SamplingParams
    one_pass = [
        _input(sp(temperature=0.0)),
        _input(sp(temperature=0.8)),
        _input(sp(seed=4), seed_draw=(4, 2)),
    ]
    with_top_k = [*one_pass[:2], _input(sp(top_k=3, seed=4), seed_draw=(4, 2))]
    sampler = Sampler(fused=True)
    for inputs in (one_pass, with_top_k):
        torch.manual_seed(5)
        half = sampler.sample(x, inputs).token_ids.tolist()
        torch.manual_seed(5)
        assert half == sampler.sample(x.float(), inputs).token_ids.tolist()


def test_one_pass_rows_cost_one_small_copy(kern, device) -> None:
    """Greedy and temperature-only rows, seeded and not: the parameters reach the device in one
    table (one ``put``), not one copy per index list."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).to(device)
    inputs = [
        _input(SamplingParams(temperature=0.0)),
        _input(SamplingParams()),
        _input(SamplingParams(seed=2), (2, 0)),
    ]
    sampler, calls = Sampler(fused=True), []
    put = sampler._to_device(x.device)
    sampler._to_device = lambda _device: lambda data, dtype: calls.append(dtype) or put(data, dtype)  # type: ignore[method-assign]
    sampler.sample(x, inputs)
    assert calls == [torch.long]


@pytest.mark.parametrize("top_k", [0, 5])  # one-pass rows, and rows transformed then raced at T = 1
def test_verified_rows_draw_what_the_plain_sampler_draws(kern, device, top_k) -> None:
    """A seeded row in a verification step (speculative decoding) races at token index k + j
    through the same path as the plain sampler at k + j: its tokens do not depend on whether a
    step carried drafts."""
    from pdserve.spec_decode.verify import VerifyGroup, verify
    from tests.spec_decode.test_verify import DRAFTS, LOGITS

    def put(data, dtype):
        return torch.tensor(data, dtype=dtype, device=device)

    logits = LOGITS.to(device)
    params = SamplingParams(temperature=0.8, top_k=top_k, seed=7)
    sampler = Sampler(fused=True)
    for k0 in range(3, 9):
        inp = SamplerInput(params, [1, 2, 3], [4], None, frozenset(), seed_draw=(7, k0))
        got = verify(logits.clone(), [VerifyGroup("s", inp, DRAFTS)], put, fused=True).tokens["s"]
        want: list[int] = []
        for j in range(len(DRAFTS) + 1):
            x = SamplerInput(params, [1, 2, 3], [4, *DRAFTS[:j]], None, frozenset(), seed_draw=(7, k0 + j))
            want.append(int(sampler.sample(logits[j : j + 1].clone(), [x]).token_ids[0]))
            if j == len(DRAFTS) or want[j] != DRAFTS[j]:
                break
        assert got == want, (k0, got, want)
