"""Asynchronous scheduling: step N+1 is scheduled and launched before step N's samples are read.

On the CPU the forward blocks the host, so nothing overlaps here; these tests check the logic
that makes the overlap safe on CUDA (fed tokens, placeholders, late stops, deferred frees) by
comparing against the synchronous engine on the same requests. They pin device="cpu" (on a GPU
machine the CUDA versions are in tests/gpu/test_async_cuda.py).
"""

from __future__ import annotations

from array import array

import pytest
import torch

from pdserve.engine.host_batch import HostBatch, PinnedStaging, apply_feed
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from tests.engine.test_scheduler import make, req

PROMPTS = [list(range(3, 3 + n)) for n in (1, 9, 40, 77, 5, 130)]


CPU = {"device": "cpu"}


def _run_all(llm, prompts, params):
    outs = llm.generate(prompts, params)
    return [(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in (r.outputs[0] for r in outs)]


def _assert_same(got, want) -> None:
    """Tokens, text and finish reasons exactly; logprob values to 1e-4: which rows run beside a
    request changes fp32 rounding in the 7th digit, and the asynchronous engine batches a late
    stop's extra row."""
    assert [g[:3] for g in got] == [w[:3] for w in want]
    for g, w in zip(got, want, strict=True):
        assert (g[3] is None) == (w[3] is None)
        for a, b in zip(g[3] or [], w[3] or [], strict=True):  # {token_id: Logprob}, chosen first
            assert list(a) == list(b) and [x.rank for x in a.values()] == [x.rank for x in b.values()]
            assert [x.logprob for x in a.values()] == pytest.approx([x.logprob for x in b.values()], abs=1e-4)


def _mixed_params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True, logprobs=2),
        # These two force synchronous steps while they run (penalties) / until min_tokens: short,
        # so that the stop above is found under asynchronous scheduling.
        SamplingParams(temperature=0.0, max_tokens=3, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=18, min_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True),
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_async_equals_sync_on_mixed_requests(arch, tiny_models, make_llm) -> None:
    """Stops found late, penalties and min_tokens (which force synchronous steps), seeded
    sampling and logprobs: every output identical to the synchronous engine's."""
    model_dir = tiny_models[arch]
    sync = make_llm(model_dir, max_num_batched_tokens=64, async_scheduling=False, **CPU)
    greedy = sync.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    stop_token = greedy[0].outputs[0].token_ids[6]  # request 1 stops on it mid-run, beside running requests
    params = _mixed_params(stop_token)
    want = _run_all(sync, PROMPTS, params)
    assert want[1][2] == "stop" and len(want[1][0]) <= 7
    asy = make_llm(model_dir, max_num_batched_tokens=64, async_scheduling=True, **CPU)
    assert asy.engine.async_scheduling
    events = record_runner_events(asy)
    got = _run_all(asy, PROMPTS, params)
    _assert_same(got, want)
    ahead = [s for e, s in events if e == "launch" and ("result", s - 1) in events[events.index((e, s)) :]]
    assert len(ahead) >= 15, events  # most steps were launched before the previous one was read
    # Stop strings are found by the detokenizer, a step later than the token itself.
    text = greedy[0].outputs[0].text
    stop_str = text[len(text) // 2 : len(text) // 2 + 2]
    p = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop_str])
    _assert_same(_run_all(asy, [PROMPTS[1]] * 3, p), _run_all(sync, [PROMPTS[1]] * 3, p))


def record_runner_events(llm) -> list[tuple[str, int]]:
    """Log ('launch' | 'result' | 'sample', step_seq) of the runner; 'sample' = a deferred sampler
    (a step with grammar rows: ``sample_deferred`` called after its launch returned)."""
    runner = llm.engine.runner
    events: list[tuple[str, int]] = []
    launch, sample = runner.launch, runner.sample_deferred

    def recording_launch(sched, *a, **kw):
        pending = launch(sched, *a, **kw)
        events.append(("launch", sched.step_seq))
        pending.step_seq = sched.step_seq
        result = pending.result

        def recording_result():
            events.append(("result", sched.step_seq))
            return result()

        pending.result = recording_result
        return pending

    def recording_sample(pending):
        seq = getattr(pending, "step_seq", None)  # None: called inside launch (not deferred)
        if seq is not None:
            events.append(("sample", seq))
        return sample(pending)

    runner.launch, runner.sample_deferred = recording_launch, recording_sample
    return events


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_next_step_launches_before_previous_result_is_read(async_scheduling, tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["llama"], async_scheduling=async_scheduling, **CPU)
    events = record_runner_events(llm)
    llm.generate([PROMPTS[2]] * 2, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    launches = [s for e, s in events if e == "launch"]
    assert len(launches) == 8  # one prefill step, 7 decode steps: nothing computed past max_tokens
    for seq in launches[:-1]:
        read_before_next_launch = events.index(("result", seq)) < events.index(("launch", seq + 1))
        assert read_before_next_launch is not async_scheduling, (seq, events)


def rows_computed(make_llm, model_dir, **kw) -> dict[bool, tuple[int, list[list[int]]]]:
    """Tokens scheduled by the sync and the async engine for one long request beside one that
    stops on a token (mode -> (scheduled tokens, outputs))."""
    scheduled = {}
    for mode in (False, True):
        llm = make_llm(model_dir, async_scheduling=mode, **kw)
        sched = llm.engine.scheduler
        orig = sched.schedule
        total = [0]

        def counting(orig=orig, total=total):
            out = orig()
            total[0] += out.total_num_scheduled_tokens
            return out

        sched.schedule = counting
        ref = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        stop = ref[0].outputs[0].token_ids[4]
        params = [
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop]),
        ]
        total[0] = 0
        outs = llm.generate([PROMPTS[3], PROMPTS[1]], params)
        assert outs[1].outputs[0].finish_reason == "stop" and outs[1].outputs[0].token_ids[-1] == stop
        scheduled[mode] = (total[0], [o.outputs[0].token_ids for o in outs])
        sched.schedule = orig  # no cycle through the wrapper: the engine is freed with the test
    return scheduled


def test_rows_computed_ahead_are_only_the_late_stops(tiny_models, make_llm) -> None:
    """Requests that end by length are never scheduled past their end; a stop token costs at most
    one extra row (computed while the stop was still in flight), and its token is dropped."""
    scheduled = rows_computed(make_llm, tiny_models["llama"], **CPU)
    assert scheduled[True][1] == scheduled[False][1]
    assert scheduled[True][0] - scheduled[False][0] in (0, 1)


def test_abort_while_a_step_is_in_flight_frees_everything(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["qwen3"], async_scheduling=True, **CPU)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:4]):
        eng.add_request(p, params, f"r{i}")
    seen: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    for _ in range(5):
        for d in eng.step():
            seen[d.request_id] += d.token_ids
    assert eng.launcher.inflight is not None  # a step was launched and not yet read
    finals = eng.abort(["r1", "r2"])
    assert {d.request_id for d in finals} == {"r1", "r2"}
    aborted_len = {rid: len(seen[rid]) for rid in ("r1", "r2")}
    while eng.has_unfinished():
        for d in eng.step():
            seen[d.request_id] += d.token_ids
    assert {rid: len(seen[rid]) for rid in ("r1", "r2")} == aborted_len  # nothing after the abort
    assert len(seen["r0"]) == len(seen["r3"]) == 40
    assert eng.kv.num_deferred_blocks == 0 and eng.kv.pool.num_used_blocks == 0


def test_apply_feed_writes_fed_rows_only() -> None:
    prev = torch.tensor([101, 102, 103, 104])  # the previous step's samples
    empty = array("q")
    batch = HostBatch(
        array("q", [7, 0, 8, 0, 0]), empty, empty, [], [], array("i"), 0, [], [1, 3, 4], [2, 0, 3]
    )
    ids = torch.tensor([7, 0, 8, 0, 0])
    apply_feed(ids, batch, prev, PinnedStaging(torch.device("cpu")))
    assert ids.tolist() == [7, 103, 8, 101, 104]
    batch.feed_dst, batch.feed_src = [0, 1], [0, 1]  # the in-order fast path
    ids = torch.zeros(3, dtype=torch.long)
    apply_feed(ids, batch, prev, PinnedStaging(torch.device("cpu")))
    assert ids.tolist() == [101, 102, 0]


def test_scheduler_schedules_ahead_with_placeholders() -> None:
    s = make(num_blocks=16, budget=64)
    r = req("a", 6, max_tokens=2)
    s.add_request(r)
    first = s.schedule()
    assert [(c.start_pos, c.num_tokens, c.sample) for c in first.chunks] == [(0, 6, True)]
    assert r.num_computed_tokens == 6 and r.num_output_placeholders == 1
    assert s.can_schedule_ahead()
    second = s.schedule()  # before `first`'s token is known
    assert [(c.start_pos, c.num_tokens, c.sample) for c in second.chunks] == [(6, 1, True)]
    assert r.num_output_placeholders == 2 and r.num_tokens == 6
    s.kv.fence.advance(first.step_seq)
    s.update_from_output(first, {"a": 11})
    third = s.schedule()  # the 2nd token (max_tokens) is in flight: nothing left to schedule
    assert r.output_token_ids == [11] and r.num_output_placeholders == 1
    assert third.chunks == []
    s.kv.fence.advance(third.step_seq)
    s.update_from_output(second, {"a": 12})
    assert r.output_token_ids == [11, 12] and r.is_finished and s.kv.pool.num_used_blocks == 0


def test_can_schedule_ahead_refuses_history_and_short_memory() -> None:
    s = make(num_blocks=16, budget=64)
    pen = Request("p", [1, 2, 3], SamplingParams(max_tokens=9, presence_penalty=0.5))
    s.add_request(pen)
    s.schedule()
    assert not s.can_schedule_ahead()  # the penalty needs the in-flight token
    s = make(num_blocks=16, budget=64)
    mt = Request("m", [1, 2, 3], SamplingParams(max_tokens=9, min_tokens=4))
    s.add_request(mt)
    s.schedule()
    assert not s.can_schedule_ahead()  # min_tokens not yet reached
    s = make(num_blocks=2, budget=64)  # 8 slots of 4 tokens
    tight = req("t", 8, max_tokens=5)  # both blocks full: the next token needs a third block
    s.add_request(tight)
    s.schedule()
    assert s.kv.pool.num_free_blocks == 0 and not s.can_schedule_ahead()


def test_wait_event_gives_up_after_the_step_timeout() -> None:
    from pdserve.engine.host_batch import wait_event
    from pdserve.errors import EngineStalledError

    class NeverDone:  # stands in for a CUDA event behind a hung kernel
        def query(self) -> bool:
            return False

    class DoneLater:
        def __init__(self) -> None:
            self.polls = 0

        def query(self) -> bool:
            self.polls += 1
            return self.polls > 3

    with pytest.raises(EngineStalledError, match=r"step_timeout_s=0\.05"):
        wait_event(NeverDone(), 0.05, "a launched step")  # type: ignore[arg-type]
    later = DoneLater()
    wait_event(later, 5.0, "a launched step")  # type: ignore[arg-type]
    assert later.polls == 4


def test_generate_raises_instead_of_spinning_when_nothing_can_run(tiny_models, make_llm) -> None:
    """If no step can ever schedule the remaining requests, generate() says so (a stuck fence
    here blocks the preemption that would make room)."""
    from pdserve.errors import EngineStalledError

    llm = make_llm(
        tiny_models["llama"], num_blocks_override=12, max_model_len=128, max_num_batched_tokens=512, **CPU
    )
    eng = llm.engine
    eng.kv.can_free_now = lambda request_id: False  # every victim looks still written
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    with pytest.raises(EngineStalledError, match="no step can schedule"):
        llm.generate([list(range(1, 60)), list(range(100, 160))], params)
    eng.abort(list(eng.scheduler.requests))
