"""Scheduler tests: ints and ids only, no model (milliseconds)."""

from __future__ import annotations

import pytest

from pdserve.config.engine import SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager, StepFence
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.kvtransfer.params import RemoteDecodeParams, RemotePrefillParams

BS = 4


def make(num_blocks: int = 16, budget: int = 64, policy: str = "fcfs", max_seqs: int = 8, fence=None):
    kv = KVCacheManager(num_blocks, BS, True, fence or StepFence())
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy)  # type: ignore[arg-type]
    return Scheduler(cfg, kv, max_model_len=1024)


def req(rid: str, n: int, max_tokens: int = 8, priority: int = 0, base: int = 0) -> Request:
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens), priority=priority)


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {c.request.request_id: token for c in out.chunks if c.sample}
    s.kv.fence.advance(out.step_seq)  # the step ran: its writes are done
    s.update_from_output(out, sampled)
    return out


def test_counter_model_chunked_prefill_then_decode() -> None:
    s = make(budget=8)
    r = req("a", 20, max_tokens=3)
    s.add_request(r)
    sizes = []
    while s.has_unfinished():
        out = run_step(s)
        sizes.append([(c.start_pos, c.num_tokens, c.sample) for c in out.chunks])
    # 20 prompt tokens in chunks of 8, 8, 4 (sampling on the last), then 2 decode steps of 1.
    assert sizes == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)], [(20, 1, True)], [(21, 1, True)]]
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 3
    assert s.kv.pool.num_used_blocks == 0


def test_continuous_batching_respects_budget_and_max_seqs() -> None:
    s = make(budget=10, max_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 6, max_tokens=2, base=100 * i))
    out = s.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("r0", 6), ("r1", 4)]
    assert out.total_num_scheduled_tokens == 10 and len(s.running) == 2 and len(s.waiting) == 1


def test_prefix_hit_counts_cached_tokens() -> None:
    s = make()
    a = req("a", 9, max_tokens=1)
    s.add_request(a)
    while s.has_unfinished():
        run_step(s)
    b = req("b", 11, max_tokens=1)  # shares the first 8 tokens (2 blocks)
    s.add_request(b)
    out = s.schedule()
    assert out.chunks[0].start_pos == 8 and b.num_cached_tokens == 8
    assert s.kv.pool.num_hit_blocks == 2


def test_priority_policy_admits_by_priority() -> None:
    s = make(policy="priority", budget=4, max_seqs=1)
    s.add_request(req("low", 4, priority=5))
    s.add_request(req("high", 4, priority=1, base=50))
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["high"]


def _fill_until_preemption(policy: str, fence: StepFence) -> Scheduler:
    # 6 blocks of 4 tokens; two requests of 12 tokens use 3 blocks each; the next decode
    # token of the first needs a 4th block -> a victim must go.
    s = make(num_blocks=6, budget=64, policy=policy, fence=fence)
    s.add_request(req("first", 12, max_tokens=8, priority=0))
    s.add_request(req("second", 12, max_tokens=8, priority=1, base=500))
    out = s.schedule()
    assert len(out.chunks) == 2
    s.update_from_output(out, {"first": 1, "second": 2})
    return s


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_zero_progress_has_zero_side_effects(policy: str) -> None:
    fence = StepFence(0)  # never advanced: step 1's writes are still "in flight"
    s = _fill_until_preemption(policy, fence)
    second = s.requests["second"]
    before = (
        list(s.running),
        list(s.waiting),
        [(r.status, r.num_computed_tokens, r.num_preemptions) for r in s.running],
        s.num_preemptions_total,
        s.kv.pool.num_free_blocks,
    )
    out = s.schedule()
    # The victim ("second", last by both policies) was written by step 1 > fence: nothing moves.
    assert out.chunks == [] and out.preempted_req_ids == []
    after = (
        list(s.running),
        list(s.waiting),
        [(r.status, r.num_computed_tokens, r.num_preemptions) for r in s.running],
        s.num_preemptions_total,
        s.kv.pool.num_free_blocks,
    )
    assert before == after
    assert second.status == RequestStatus.RUNNING and second.num_preemptions == 0
    # Once the fence passes step 1, preemption proceeds.
    fence.advance(1)
    out = s.schedule()
    assert out.preempted_req_ids == ["second"]
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert second.num_preemptions == 1 and s.num_preemptions_total == 1
    assert [c.request.request_id for c in out.chunks] == ["first"]


def test_preempted_request_recomputes_and_finishes() -> None:
    s = make(num_blocks=6, budget=64)
    a, b = req("a", 11, max_tokens=6), req("b", 11, max_tokens=6, base=300)
    s.add_request(a)
    s.add_request(b)
    while s.has_unfinished():
        run_step(s)
    assert b.num_preemptions >= 1
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert s.kv.pool.num_used_blocks == 0


def test_abort_frees_everywhere() -> None:
    s = make(budget=4)
    s.add_request(req("a", 8))
    s.add_request(req("b", 8, base=40))
    run_step(s)
    s.abort_requests(["a", "b", "unknown"])
    assert not s.has_unfinished() and s.kv.pool.num_used_blocks == 0


def test_stop_token_and_eos() -> None:
    s = make()
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    s.add_request(r)
    run_step(s, token=7)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 7
    r2 = Request("b", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=2), eos_token_ids=frozenset({9}))
    s.add_request(r2)
    run_step(s, token=9)
    assert not r2.is_finished  # min_tokens not reached
    run_step(s, token=9)
    assert r2.status == RequestStatus.FINISHED_STOPPED


def test_remote_kv_load_and_hold_for_transfer() -> None:
    held: list[tuple[str, list[int]]] = []
    kv = KVCacheManager(16, BS)
    s = Scheduler(
        SchedulerConfig(), kv, 1024, on_hold_for_transfer=lambda r, b: held.append((r.request_id, b)) or True
    )
    # Decode side: prompt KV comes from afar, the first token from prefill.
    d = Request(
        "d", list(range(10)), SamplingParams(max_tokens=3), kv_transfer_params=RemotePrefillParams("t", "p:1")
    )
    d.output_token_ids.append(42)
    s.add_request(d)
    out = s.schedule()
    assert out.chunks == [] and len(out.kv_loads) == 1 and out.kv_loads[0].num_tokens == 10
    assert d.status == RequestStatus.WAITING_FOR_REMOTE_KV and not kv.can_free_now("d")
    s.finish_kv_load("d", ok=True, recompute_on_failure=False)
    out = s.schedule()
    assert [(c.start_pos, c.num_tokens) for c in out.chunks] == [(10, 1)]
    # Prefill side: the finished request's blocks are held for the pull, then released.
    p = Request(
        "p", list(range(100, 110)), SamplingParams(max_tokens=1), kv_transfer_params=RemoteDecodeParams("t")
    )
    s.add_request(p)
    s.update_from_output(out, {"d": 5})
    out = s.schedule()
    s.update_from_output(out, {c.request.request_id: 5 for c in out.chunks if c.sample})
    assert held and held[0][0] == "p" and kv.holds("p")
    assert s.release_held("p") and not kv.holds("p")


def test_remote_kv_failure_policies() -> None:
    s = make()
    d = Request(
        "d", list(range(10)), SamplingParams(max_tokens=3), kv_transfer_params=RemotePrefillParams("t", "p:1")
    )
    s.add_request(d)
    s.schedule()
    s.finish_kv_load("d", ok=False, recompute_on_failure=True)
    assert d.status == RequestStatus.WAITING and d.kv_transfer_params is None
    out = s.schedule()
    assert out.chunks[0].num_tokens == 10  # local prefill
    e = Request(
        "e", list(range(50, 60)), SamplingParams(), kv_transfer_params=RemotePrefillParams("t", "p:1")
    )
    s.add_request(e)
    s.update_from_output(out, {"d": 1})
    s.schedule()
    s.finish_kv_load("e", ok=False, recompute_on_failure=False)
    assert e.status == RequestStatus.FINISHED_ERROR and not s.kv.holds("e")


def test_abort_while_remote_kv_in_flight_frees_after_load_ends() -> None:
    s = make()
    d = Request("d", list(range(10)), SamplingParams(), kv_transfer_params=RemotePrefillParams("t", "p:1"))
    s.add_request(d)
    s.schedule()
    s.abort_requests(["d"])
    assert s.kv.holds("d")  # the pull may still write: not freed yet
    s.finish_kv_load("d", ok=True, recompute_on_failure=False)
    assert not s.kv.holds("d") and s.kv.pool.num_used_blocks == 0


def test_a_request_waiting_for_its_grammar_is_never_scheduled_until_ready() -> None:
    s = make()
    g, h, free = req("g", 5), req("h", 5, base=50), req("free", 5, base=100)
    s.add_request(g, wait_for_grammar=True)
    s.add_request(h, wait_for_grammar=True)
    s.add_request(free)
    assert s.has_unfinished() and s.num_unfinished == 3
    for _ in range(2):
        out = run_step(s)
        assert {c.request.request_id for c in out.chunks} == {"free"}
    assert g.status == h.status == RequestStatus.WAITING_FOR_GRAMMAR and not s.kv.holds("g")
    assert s.finish_request("h", RequestStatus.FINISHED_ERROR) is h  # its compile failed
    assert s.grammar_ready("h") is None and "h" not in s.requests
    late = req("late", 5, base=200)
    s.add_request(late)  # arrived after g, queued before g's grammar was ready
    assert s.grammar_ready("g") is g and g.status == RequestStatus.WAITING
    assert [r.request_id for r in s.waiting] == ["late", "g"]  # g queues as if it arrived now (TP lockstep)
    out = run_step(s)
    assert {"g", "late"} <= {c.request.request_id for c in out.chunks}
    while s.has_unfinished():
        run_step(s)
    assert s.kv.pool.num_used_blocks == 0 and not s.waiting_for_grammar
