"""Asynchronous scheduling on CUDA: launching a step never waits for the device, and the
overlapped engine gives the synchronous engine's outputs (eager and CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampling_params import SamplingParams
from tests.engine.test_async_scheduling import PROMPTS, _assert_same, _mixed_params, _run_all

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
KV_BYTES = 128 << 20


def _llm(make_llm, model_dir, **kw):
    return make_llm(model_dir, device="cuda", max_num_batched_tokens=64, kv_cache_memory_bytes=KV_BYTES, **kw)


def test_async_is_the_cuda_default(tiny_models, make_llm) -> None:
    assert _llm(make_llm, tiny_models["llama"]).engine.async_scheduling


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_equals_sync_on_cuda(dtype, enforce_eager, tiny_models, make_llm) -> None:
    model_dir = tiny_models["qwen3"]
    kw = dict(dtype=dtype, enforce_eager=enforce_eager)
    sync = _llm(make_llm, model_dir, async_scheduling=False, **kw)
    greedy = sync.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    params = _mixed_params(greedy[0].outputs[0].token_ids[6])
    want = _run_all(sync, PROMPTS, params)
    asy = _llm(make_llm, model_dir, async_scheduling=True, **kw)
    _assert_same(_run_all(asy, PROMPTS, params), want)
    if not enforce_eager:
        assert asy.engine.runner.cuda_graphs is not None and asy.engine.runner.cuda_graphs.num_runs >= 10


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_launch_does_not_wait_for_the_device(enforce_eager, tiny_models, make_llm) -> None:
    """With CUDA's sync debug mode set to "error", a synchronising call (``.tolist()``, a copy from
    pageable memory, ``torch.tensor(..., device="cuda")``) inside a launch raises. Covers mixed
    prefill + decode steps, fed tokens, greedy and sampled rows, penalties and logprobs."""
    llm = _llm(make_llm, tiny_models["llama"], enforce_eager=enforce_eager)
    eng = llm.engine
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, frequency_penalty=0.3, min_tokens=4),
    ]
    llm.generate(PROMPTS[:4], params)  # warm-up: Triton compiles, allocator pools
    runner = eng.runner
    launch = runner.launch
    launches = [0]

    def strict_launch(sched, *a, **kw):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(sched, *a, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            launches[0] += 1

    runner.launch = strict_launch
    outs = llm.generate(PROMPTS[:4] + PROMPTS[2:4], params + params[:2])
    assert launches[0] >= 12 and all(len(o.outputs[0].token_ids) >= 4 for o in outs)


def test_pinned_staging_reuses_a_slot_only_after_its_copies_ran() -> None:
    """The GPU sleeps while 3x more steps than there are slots stage new values: each copy must
    still deliver its own step's values (a slot rewritten too early would deliver later ones)."""
    from array import array

    from pdserve.engine.host_batch import PinnedStaging

    staging = PinnedStaging(torch.device("cuda"), num_slots=4, slot_bytes=4096)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before every copy below
    outs = []
    for step in range(12):
        staging.begin_step()  # waits for slot (step - 4)'s copies: the sleep, then those copies
        outs.append(staging.to_device(array("q", [step] * 300), torch.int64))
        staging.end_step()
    torch.cuda.synchronize()
    assert [int(o.min()) == int(o.max()) == i for i, o in enumerate(outs)] == [True] * 12


def test_a_hung_step_fails_after_step_timeout() -> None:
    """A step whose device work outlives step_timeout_s raises instead of blocking forever."""
    from pdserve.engine.pending_step import PendingStep
    from pdserve.errors import EngineStalledError

    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time: a "hung" kernel for this test
    ev = torch.cuda.Event()
    ev.record()
    with pytest.raises(EngineStalledError, match="step_timeout_s"):
        PendingStep([], None, ev, timeout_s=0.05).result()
    torch.cuda.synchronize()


def test_rows_computed_ahead_on_cuda(tiny_models, make_llm) -> None:
    """The CPU test of late stops (tests/engine/test_async_scheduling.py), on CUDA with graphs and
    a bounded KV budget. (With the KV cache at 90% of free memory per engine and no step
    deadline, the run does not finish: docs/benchmarks.md, "GPU tests".)"""
    from tests.engine.test_async_scheduling import rows_computed

    scheduled = rows_computed(make_llm, tiny_models["llama"], device="cuda", kv_cache_memory_bytes=KV_BYTES)
    assert scheduled[True][1] == scheduled[False][1]
    assert scheduled[True][0] - scheduled[False][0] in (0, 1)
