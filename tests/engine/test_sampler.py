from __future__ import annotations

import itertools
import math

import pytest
import torch

from pdserve.engine.sampler import Sampler, SamplerInput
from pdserve.engine.sampling_params import SamplingParams

EOS = 1


def make_input(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: frozenset[int] = frozenset({EOS}),
    **kw: object,
) -> SamplerInput:
    params = SamplingParams(**kw)  # type: ignore[arg-type]
    gen = None
    if params.seed is not None:
        gen = torch.Generator().manual_seed(params.seed)
    return SamplerInput(params, prompt or [], output or [], gen, eos)


@pytest.fixture
def sampler() -> Sampler:
    return Sampler()


def test_greedy_is_argmax_with_lowest_id_on_ties(sampler: Sampler) -> None:
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    logits[2, 7] = logits[2, 3] = 100.0
    rng_before = torch.get_rng_state()
    out = sampler(logits, [make_input(temperature=0.0) for _ in range(5)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[2] == 3
    assert out.logprobs == [None] * 5
    assert torch.equal(torch.get_rng_state(), rng_before)  # no randomness used


def test_logits_not_modified(sampler: Sampler) -> None:
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    sampler(logits, [make_input(output=[3, 3], repetition_penalty=1.5, min_tokens=5, top_p=0.5)] * 2)
    assert torch.equal(logits, before)


def test_top_k_1_and_tiny_top_p_equal_greedy(sampler: Sampler) -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(1))
    greedy = logits.argmax(dim=-1).tolist()
    assert sampler(logits, [make_input(top_k=1, temperature=2.0) for _ in range(16)]).token_ids == greedy
    assert sampler(logits, [make_input(top_p=1e-6, temperature=2.0) for _ in range(16)]).token_ids == greedy


def _frequencies(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(token_ids), minlength=vocab_size).float() / len(token_ids)


NUM_DRAWS = 4000  # one batch of identical rows; std of a frequency <= 0.008


def test_temperature_distribution(sampler: Sampler) -> None:
    torch.manual_seed(0)
    base = torch.tensor([2.0, 1.0, 0.0, -1.0])
    for temperature in (0.5, 1.0, 2.0):
        out = sampler(base.expand(NUM_DRAWS, 4), [make_input(temperature=temperature)] * NUM_DRAWS)
        expected = (base / temperature).softmax(dim=-1)
        assert torch.allclose(_frequencies(out.token_ids, 4), expected, atol=0.03), temperature


def test_seeded_rows_draw_from_the_distribution_and_one_seed_one_stream(sampler: Sampler) -> None:
    """Rows with their own generators (one seed each) sample the tempered distribution; a seed
    gives the same token over the same logits, and skipping one step's draws with ``draw_`` (what
    a node continuing a request does) lands where sampling that step would have."""
    from pdserve.engine.sampler import draw_

    base = torch.tensor([1.5, 0.5, 0.0, -2.0])
    rows = [make_input(temperature=1.0, seed=s) for s in range(NUM_DRAWS)]
    out = sampler(base.expand(NUM_DRAWS, 4), rows)
    assert torch.allclose(_frequencies(out.token_ids, 4), base.softmax(dim=-1), atol=0.03)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    a = sampler(logits, [make_input(temperature=1.0, seed=7) for _ in range(3)])
    b = sampler(logits, [make_input(temperature=1.0, seed=7) for _ in range(3)])
    assert a.token_ids == b.token_ids
    two_steps = make_input(temperature=1.0, seed=9)
    sampler(logits[:1], [two_steps])
    second = sampler(logits[1:2], [two_steps]).token_ids
    skipped = make_input(temperature=1.0, seed=9)
    assert skipped.generator is not None
    draw_(torch.empty(50), skipped.generator)
    assert sampler(logits[1:2], [skipped]).token_ids == second


def test_top_k_renormalises(sampler: Sampler) -> None:
    torch.manual_seed(0)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    out = sampler(base.expand(NUM_DRAWS, 5), [make_input(top_k=2)] * NUM_DRAWS)
    expected = torch.zeros(5)
    expected[:2] = base[:2].softmax(dim=-1)
    assert torch.allclose(_frequencies(out.token_ids, 5), expected, atol=0.03)


def test_top_p_keeps_smallest_nucleus(sampler: Sampler) -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    base = probs.log()
    # Mass before token 1 is 0.5 < top_p, before token 2 it is 0.8 >= top_p: the top two.
    for top_p in (0.51, 0.79):
        freq = _frequencies(
            sampler(base.expand(NUM_DRAWS, 4), [make_input(top_p=top_p)] * NUM_DRAWS).token_ids, 4
        )
        assert freq[2:].sum() == 0 and torch.allclose(freq[:2], torch.tensor([0.625, 0.375]), atol=0.03)
    freq = _frequencies(sampler(base.expand(NUM_DRAWS, 4), [make_input(top_p=0.81)] * NUM_DRAWS).token_ids, 4)
    assert freq[3] == 0 and freq[2] > 0.1


def test_min_p(sampler: Sampler) -> None:
    torch.manual_seed(0)
    base = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # Threshold 0.25 * 0.5 = 0.125: tokens 0, 1, 2 survive.
    freq = _frequencies(sampler(base.expand(NUM_DRAWS, 4), [make_input(min_p=0.25)] * NUM_DRAWS).token_ids, 4)
    assert freq[3] == 0
    assert torch.allclose(freq[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95, atol=0.03)
    freq = _frequencies(sampler(base.expand(NUM_DRAWS, 4), [make_input(min_p=0.7)] * NUM_DRAWS).token_ids, 4)
    assert freq[0] == 1.0


def test_seeded_row_ignores_batch_composition(sampler: Sampler) -> None:
    vocab_size, num_steps = 64, 20
    step_logits = torch.randn(num_steps, vocab_size, generator=torch.Generator().manual_seed(123))
    kw = {"seed": 42, "temperature": 1.5, "top_p": 0.95, "top_k": 40, "presence_penalty": 0.3}
    others_rng = torch.Generator().manual_seed(7)
    other_kws = [
        {"temperature": 1.0},
        {"temperature": 0.0, "logprobs": 2},
        {"seed": 5, "temperature": 0.7, "min_p": 0.1},
    ]

    def run(batched: bool) -> list[int]:
        req = make_input(prompt=[1, 2, 3], **kw)
        others = [make_input(**okw) for okw in other_kws]
        for step in range(num_steps):
            if not batched:
                rows, pos = [req], 0
            else:
                pos = step % 4
                rows = [*others[:pos], req, *others[pos:]]
            logits = torch.randn(len(rows), vocab_size, generator=others_rng) * 3
            logits[pos] = step_logits[step]
            token = sampler(logits, rows).token_ids[pos]
            req.output_token_ids.append(token)
        return req.output_token_ids

    alone, batched = run(False), run(True)
    assert alone == batched
    assert len(set(alone)) > 5  # really sampled, not greedy
    kw["seed"] = 43
    assert run(False) != alone


def test_penalties_exact_values(sampler: Sampler) -> None:
    # Logprobs are log_softmax of the penalised logits, so they expose them up to a constant.
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    inp = make_input(
        prompt=[0, 1],
        output=[3, 3, 4],
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        temperature=0.0,
        logprobs=6,
    )
    out = sampler(logits.repeat(2, 1), [inp, make_input(temperature=0.0, logprobs=6)])
    # rep over {0, 1, 3, 4}: 2/2, -1*2, 3/2, -2*2; then token 3 (count 2): 1.5 - 0.5 - 2*0.25,
    # token 4 (count 1): -4 - 0.5 - 0.25. Tokens 2 and 5 untouched.
    expected = torch.tensor([1.0, -2.0, 0.5, 0.5, -4.75, 1.0]).log_softmax(dim=-1)
    lp = out.logprobs[0]
    assert lp is not None
    got = torch.zeros(6)
    for t, v in lp.top:
        got[t] = v
    assert torch.allclose(got, expected, atol=1e-6)
    assert out.token_ids[0] == 0  # ties 0 and 5 at 1.0 -> lowest id
    # The unpenalised row in the same batch sees the raw logits.
    lp1 = out.logprobs[1]
    assert lp1 is not None and out.token_ids[1] == 3
    assert math.isclose(lp1.logprob, logits[0].log_softmax(dim=-1)[3].item(), abs_tol=1e-6)


def test_frequency_penalty_negative_and_presence_only(sampler: Sampler) -> None:
    logits = torch.zeros(1, 4)
    out = sampler(logits, [make_input(output=[2, 2, 2], frequency_penalty=-1.0, temperature=0.0, logprobs=4)])
    assert out.token_ids == [2]  # 0 + 3
    lp = out.logprobs[0]
    assert lp is not None
    assert math.isclose(lp.logprob, torch.tensor([0.0, 0, 3, 0]).log_softmax(-1)[2].item(), abs_tol=1e-6)


def test_min_tokens_masks_eos_and_stop_ids(sampler: Sampler) -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0, 7.0]]).repeat(4, 1)  # eos=1 best, then stop id 2
    rows = [
        make_input(output=[3], min_tokens=2, stop_token_ids=[2], temperature=0.0),  # masked: 3
        make_input(output=[3, 3], min_tokens=2, stop_token_ids=[2], temperature=0.0),  # reached: eos
        make_input(output=[3], min_tokens=2, ignore_eos=True, temperature=0.0),  # eos not masked
        make_input(output=[3], min_tokens=2, stop_token_ids=[2], logprobs=1),  # sampled row too
    ]
    out = sampler(logits, rows)
    assert out.token_ids[:3] == [3, 1, 1]
    assert out.token_ids[3] in (0, 3)
    lp = out.logprobs[3]
    assert lp is not None and lp.top[0][0] == 3


def test_logprobs_top_n_and_sampled_value(sampler: Sampler) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    rows = [
        make_input(logprobs=5, temperature=0.7),
        make_input(logprobs=0, temperature=1.0),
        make_input(),
        make_input(logprobs=3, temperature=0.0),
    ]
    out = sampler(logits, rows)
    ref = logits.log_softmax(dim=-1)  # before temperature
    assert out.logprobs[2] is None
    for row, n in ((0, 5), (1, 0), (3, 3)):
        lp = out.logprobs[row]
        assert lp is not None and lp.token_id == out.token_ids[row]
        assert math.isclose(lp.logprob, ref[row, lp.token_id].item(), abs_tol=1e-6)
        assert len(lp.top) == n
        values, indices = ref[row].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in lp.top] == indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-6)
        assert all(a[1] >= b[1] for a, b in itertools.pairwise(lp.top))
    lp3 = out.logprobs[3]
    assert lp3 is not None and lp3.top[0][0] == out.token_ids[3]


def test_mixed_batch_greedy_rows_stay_greedy(sampler: Sampler) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(4))
    rows = [make_input(temperature=0.0 if i % 2 else 1.0, top_k=3) for i in range(6)]
    out = sampler(logits, rows)
    top3 = logits.topk(3, dim=-1).indices
    for i, t in enumerate(out.token_ids):
        if i % 2:
            assert t == logits[i].argmax().item()
        else:
            assert t in top3[i].tolist()


@pytest.mark.parametrize("other", [{"top_k": 3}, {"top_p": 0.79}, {"top_k": 3, "top_p": 0.6}])
def test_per_row_top_k_top_p_in_one_batch(sampler: Sampler, other: dict[str, float]) -> None:
    # top-k on every row takes the topk path; a row without top-k forces the full sort. top-p
    # sees the top-k renormalised: with k=3, p=0.6 keeps 0.5/0.95 + 0.3/0.95.
    torch.manual_seed(0)
    base = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    rows = [make_input(top_k=2) if i % 2 else make_input(**other) for i in range(2000)]  # type: ignore[arg-type]
    out = sampler(base.expand(len(rows), 4), rows)
    support_k2 = set(out.token_ids[1::2])
    support_other = set(out.token_ids[0::2])
    assert support_k2 == {0, 1}
    assert support_other == ({0, 1, 2} if other == {"top_k": 3} else {0, 1})


@pytest.mark.parametrize(("value", "fused"), [(None, True), ("1", True), ("0", False), ("yes", None)])
def test_fused_sampling_setting(
    monkeypatch: pytest.MonkeyPatch, value: str | None, fused: bool | None
) -> None:
    from pdserve.engine.fused_sampling import ENV_FUSED_SAMPLING, fused_sampling_enabled
    from pdserve.errors import ConfigError

    if value is None:
        monkeypatch.delenv(ENV_FUSED_SAMPLING, raising=False)
    else:
        monkeypatch.setenv(ENV_FUSED_SAMPLING, value)
    fused_sampling_enabled.cache_clear()
    try:
        if fused is None:
            with pytest.raises(ConfigError, match="PDSERVE_FUSED_SAMPLING='yes'"):
                Sampler()
        else:
            assert Sampler().fused is fused
    finally:
        fused_sampling_enabled.cache_clear()
