"""Overload: the engine's queue limit and queue wait, and merged deltas."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.config.cluster import ClusterConfig
from pdserve.config.resolver import resolve_node_settings
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.outputs import GenerationDelta, TokenLogprob, merge_deltas
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import CapacityError, ConfigError

LONG = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_queue_limit_refuses_and_frees_room_once_scheduled(tiny_models, make_llm) -> None:
    eng = make_llm(tiny_models["llama"], max_queue_len=2, max_num_seqs=1).engine
    eng.add_request([5, 6, 7], LONG, "a")
    eng.add_request([5, 6, 8], LONG, "b")
    with pytest.raises(CapacityError, match=r"queue is full .*max_queue_len 2"):
        eng.add_request([5, 6, 9], LONG, "c")
    assert "c" not in eng.output_processor.tracked  # refused before anything was admitted
    eng.step()  # "a" runs: one waiting now, room for one more
    eng.add_request([5, 6, 9], LONG, "c")
    with pytest.raises(CapacityError):
        eng.add_request([5, 6, 10], LONG, "d")
    while eng.has_unfinished():
        eng.step()
    assert eng.num_used_blocks() == 0


def test_queue_wait_drops_only_requests_never_scheduled(tiny_models, make_llm) -> None:
    eng = make_llm(tiny_models["llama"], max_queue_wait_s=0.05, max_num_seqs=1).engine
    eng.add_request([5, 6, 7], LONG, "runs")
    tokens = [t for x in eng.step() for t in x.token_ids]
    eng.add_request([5, 6, 8], LONG, "waits")
    assert eng.expire_queued() == []  # not old yet
    time.sleep(0.08)
    out = eng.expire_queued()
    assert [d.request_id for d in out] == ["waits"]
    d = out[0]
    assert d.finish_reason == "error" and d.overloaded and d.token_ids == []
    assert "max_queue_wait_s 0.05" in (d.error or "")
    while eng.has_unfinished():
        tokens += [t for x in eng.step() for t in x.token_ids]
    assert len(tokens) == 12  # the running one is untouched
    assert eng.num_used_blocks() == 0


def test_engine_loop_expires_queued_requests_with_an_overloaded_delta(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["llama"], max_queue_wait_s=0.2, max_num_seqs=1)

    async def run(el: EngineLoop, rid: str, n: int) -> GenerationDelta:
        last = None
        async for d in el.generate(
            [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), rid
        ):
            last = d
        assert last is not None
        return last

    async def main() -> None:
        el = EngineLoop(llm.engine, asyncio.get_running_loop())
        el.start()
        try:
            first = asyncio.ensure_future(run(el, "long", 1500))
            await asyncio.sleep(0.05)
            queued = await run(el, "queued", 4)
            assert queued.finish_reason == "error" and queued.overloaded
            el.post_and_dispatch(lambda e: e.abort(["long"]))
            await first
        finally:
            el.stop()

    asyncio.run(main())


def test_queue_settings_reach_the_engine_and_bad_values_are_refused(tiny_models) -> None:
    model = str(tiny_models["llama"])
    node = {"name": "d", "role": "colocated", "grpc_port": 1, "metrics_port": 2}
    cfg = ClusterConfig.from_dict(
        {"model": model, "nodes": [{**node, "max_queue_len": 7, "max_queue_wait_s": 1.5}]}
    )
    sched = resolve_node_settings(cfg, "d").engine_config().scheduler
    assert (sched.max_queue_len, sched.max_queue_wait_s) == (7, 1.5)
    with pytest.raises(ConfigError, match="max_queue_len"):
        ClusterConfig.from_dict({"model": model, "nodes": [{**node, "max_queue_len": 0}]})
    with pytest.raises(ConfigError, match="max_queue_wait_s"):
        ClusterConfig.from_dict({"model": model, "nodes": [{**node, "max_queue_wait_s": 0}]})


def test_merge_deltas_concatenates_and_takes_the_finish_of_the_last() -> None:
    lp = [TokenLogprob(1, -0.5)]
    a = GenerationDelta("r", [1], "a", logprobs=lp, num_prompt_tokens=3, num_output_tokens=1)
    b = GenerationDelta("r", [2, 3], "bc", logprobs=[TokenLogprob(2, -1.0), TokenLogprob(3, -2.0)])
    c = GenerationDelta("r", [4], "d", finish_reason="stop", stop_reason=4, num_output_tokens=4)
    m = merge_deltas(merge_deltas(a, b), c)
    assert (m.token_ids, m.text, m.finish_reason, m.stop_reason) == ([1, 2, 3, 4], "abcd", "stop", 4)
    assert m.logprobs is not None and [x.token_id for x in m.logprobs] == [1, 2, 3]
    assert (m.num_prompt_tokens, m.num_output_tokens) == (3, 4)
    assert merge_deltas(GenerationDelta("r", [1], "x"), GenerationDelta("r", [2], "y")).logprobs is None
    with pytest.raises(AssertionError):
        merge_deltas(c, a)
