"""The n-gram drafter and the scheduler's side of speculative decoding (no torch, no model):
drafts capped by max_tokens / max_model_len, none for grammar rows, a verified chunk's tokens
applied through the stop checks, rejected slots' blocks returned to the pool."""

from __future__ import annotations

import pytest

from pdserve.config.engine import SchedulerConfig
from pdserve.config.speculative import SpeculativeConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.errors import ConfigError
from pdserve.spec_decode.ngram import NgramProposer
from pdserve.spec_decode.scheduling import SpecScheduling


def test_ngram_proposer() -> None:
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3))
    assert p.propose([1, 2, 3, 4, 9, 9, 1, 2, 3], 3) == [4, 9, 9]  # suffix "1 2 3" seen at 0
    assert p.propose([1, 2, 3, 4, 9, 9, 1, 2, 3], 2) == [4, 9]  # capped
    assert p.propose([5, 6, 7, 8], 3) == []  # no earlier occurrence
    assert p.propose([7, 7, 7, 7, 7], 3) == [7, 7]  # no occurrence fills 3: the longest continuation
    assert p.propose([7] * 8, 3) == [7, 7, 7]
    # the longest n-gram wins: "2 3" -> 8 (seen once), over "3" -> 5 (the latest "3")
    assert p.propose([2, 3, 8, 3, 5, 2, 3], 1) == [8]


def test_config_refusals() -> None:
    with pytest.raises(ConfigError, match="'medusa' \\(known, not built here\\) is not supported"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="prompt_lookup_min <= prompt_lookup_max"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)


def _setup(max_tokens: int = 100, structured: tuple[str, str] | None = None) -> tuple[Scheduler, Request]:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=64)
    sched.spec = SpecScheduling(SpeculativeConfig(num_speculative_tokens=4), 64)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    object.__setattr__(sp, "structured", structured)
    req = Request("r", [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], sp)
    sched.add_request(req)
    out = sched.schedule()  # the prompt
    sched.kv.fence.advance(out.step_seq)
    sched.update_from_output(out, {"r": 3})
    return sched, req


def test_drafts_scheduled_applied_and_rolled_back() -> None:
    sched, req = _setup()
    assert sched.spec is not None
    sched.spec.propose(sched.running)
    assert req.spec_token_ids == [4, 5, 1, 2]
    out = sched.schedule()
    (c,) = out.chunks
    assert (c.start_pos, c.num_tokens, c.sample, c.spec_token_ids) == (12, 5, True, (4, 5, 1, 2))
    assert len(sched.kv.block_ids("r")) == 5  # 17 positions
    sched.kv.fence.advance(out.step_seq)
    sched.update_from_output(out, {}, {"r": [4, 5, 9]})  # two accepted, then a correction
    assert req.output_token_ids == [3, 4, 5, 9] and req.num_computed_tokens == 15
    assert len(sched.kv.block_ids("r")) == 4  # the rejected slots' block went back
    assert sched.kv.pool.num_used_blocks == 4
    st = sched.spec.stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, st.accepted_per_pos) == (
        1,
        4,
        2,
        [1, 1, 0, 0],
    )


def test_drafts_capped_and_stops_exact() -> None:
    sched, req = _setup(max_tokens=3)  # one token out: at most 3 - 1 - 1 = 1 draft
    assert sched.spec is not None
    sched.spec.propose(sched.running)
    assert req.spec_token_ids == [4]
    req.sampling_params.stop_token_ids = [4]
    out = sched.schedule()
    sched.kv.fence.advance(out.step_seq)
    sched.update_from_output(out, {}, {"r": [4, 5]})  # the accepted draft is a stop token
    assert req.output_token_ids == [3, 4] and req.is_finished and req.stop_reason == 4
    assert sched.kv.pool.num_used_blocks == 0


def test_grammar_rows_get_no_drafts() -> None:
    sched, req = _setup(structured=("regex", "[a-z]+"))
    assert sched.spec is not None
    sched.spec.propose(sched.running)
    assert req.spec_token_ids == []


def test_no_drafts_until_the_prompt_is_computed() -> None:
    """A prompt whose last token is still to compute (a chunk or prefix hit left one) gets no
    drafts: drafts only ever follow output positions (prompt logprobs, prompt embeddings)."""
    spec = SpecScheduling(SpeculativeConfig(num_speculative_tokens=4), 64)
    req = Request("p", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0.0))
    req.num_computed_tokens = req.num_prompt_tokens - 1
    spec.propose([req])
    assert req.spec_token_ids == []
    req.output_token_ids.append(3)
    req.num_computed_tokens = req.num_prompt_tokens
    spec.propose([req])
    assert req.spec_token_ids == [1, 2, 3]  # the 4-gram "3 1 2 3" matched: 3 tokens follow it


def test_ngram_proposer_matches_a_brute_force_search() -> None:
    """The candidate scan against the definition (every window compared), on random sequences
    over 4 token values (many overlapping matches)."""
    import random

    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=4))

    def brute(toks: list[int], k: int) -> list[int]:
        num = len(toks)
        for n in range(min(p.max_n, num - 1), p.min_n - 1, -1):
            hits = [s for s in range(num - n) if toks[s : s + n] == toks[num - n :]]
            if hits:
                full = [h for h in hits if h + n + k <= num]
                begin = (full[-1] if full else hits[0]) + n
                return toks[begin : begin + k]
        return []

    rng = random.Random(0)
    for _ in range(500):
        toks = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        k = rng.randrange(1, 5)
        assert p.propose(toks, k) == brute(toks, k), (toks, k)


def test_speculation_off_under_load() -> None:
    spec = SpecScheduling(SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=2), 64)
    reqs = [Request(f"r{i}", [1, 2, 1, 2, 1], SamplingParams(temperature=0.0)) for i in range(2)]
    for r in reqs:
        r.output_token_ids.append(2)
        r.num_computed_tokens = 5
    spec.propose(reqs)
    assert [r.spec_token_ids for r in reqs] == [[], []] and spec.num_steps_off == 1
    spec.propose(reqs[:1])
    assert reqs[0].spec_token_ids == [1, 2]
    with pytest.raises(ConfigError, match="disable_by_batch_size"):
        SpeculativeConfig(disable_by_batch_size=0)


class _FakeDrafter:
    """Drafts ``[100, 101, ...]`` for every row (a unit test of the scheduling side only)."""

    def __init__(self, ready: bool) -> None:
        self.ready = ready
        self.dropped: list[str] = []

    def can_draft(self, req: Request) -> bool:
        return self.ready

    def draft(self, chunks: list) -> None:
        for c in chunks:
            c.spec_token_ids = tuple(100 + i for i in range(len(c.spec_token_ids)))
            c.request.spec_token_ids = list(c.spec_token_ids)

    def after_step(self, sched: object, sampled: dict, spec_sampled: dict, drafting_off: bool) -> None:
        pass

    def drop(self, request_ids: list[str]) -> None:
        self.dropped.extend(request_ids)


def test_a_drafter_with_weights_fills_the_scheduled_placeholders() -> None:
    """Placeholders before the scheduler (capped like n-gram drafts), the drafter's tokens in the
    scheduled chunk after it, none for a request the drafter cannot draft for yet."""
    from pdserve.spec_decode.scheduling import DRAFT_PLACEHOLDER

    sched, req = _setup(max_tokens=4)  # one token out: at most 4 - 1 - 1 = 2 drafts
    assert sched.spec is not None
    sched.spec.drafter = _FakeDrafter(ready=False)
    sched.spec.propose(sched.running)
    assert req.spec_token_ids == []
    sched.spec.drafter = drafter = _FakeDrafter(ready=True)
    sched.spec.propose(sched.running)
    assert req.spec_token_ids == [DRAFT_PLACEHOLDER] * 2
    out = sched.schedule()
    sched.spec.fill_drafts(out)
    (c,) = out.chunks
    assert (c.start_pos, c.num_tokens, c.spec_token_ids) == (12, 3, (100, 101))
    assert drafter.dropped == []
    sched.kv.fence.advance(out.step_seq)
    sched.update_from_output(out, {}, {"r": [100, 7]})
    assert req.output_token_ids == [3, 100, 7] and req.num_computed_tokens == 14
