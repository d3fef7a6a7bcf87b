"""Engine behaviour through the offline API: seeds, stop handling, bad input."""

from __future__ import annotations

import pytest

from pdserve.config.choices import KvLoadFailurePolicy
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError, PromptTooLongError


def test_seeded_sampling_is_reproducible_regardless_of_batch(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["qwen2"], max_num_batched_tokens=64)
    target = list(range(3, 40))
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=32, ignore_eos=True)
    alone = llm.generate([target], sp)[0].outputs[0].token_ids
    others = [list(range(100, 100 + n)) for n in (5, 77, 130)]
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    mixed = llm.generate([others[0], target, others[1], others[2]], [noise, sp, noise, noise])
    assert mixed[1].outputs[0].token_ids == alone
    last = llm.generate([*others, target], [noise, noise, noise, sp])
    assert last[3].outputs[0].token_ids == alone
    other_seed = llm.generate([target], SamplingParams(**{**sp.__dict__, "seed": 99}))[0].outputs[0].token_ids
    assert other_seed != alone


def test_stop_strings_and_max_tokens(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["llama"])
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = llm.generate(["Once upon a time"], greedy)[0].outputs[0]
    assert len(full.token_ids) == 40 and full.finish_reason == "length"
    stop = full.text[10:13]
    assert stop
    cut = llm.generate(["Once upon a time"], SamplingParams(**{**greedy.__dict__, "stop": [stop]}))[
        0
    ].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    stop_tok = full.token_ids[5]
    by_id = llm.generate(
        ["Once upon a time"], SamplingParams(**{**greedy.__dict__, "stop_token_ids": [stop_tok]})
    )[0].outputs[0]
    assert (
        by_id.finish_reason == "stop"
        and by_id.token_ids == full.token_ids[: full.token_ids.index(stop_tok) + 1]
    )


def test_detokenize_off_gives_the_same_tokens_and_no_text(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["llama"])
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = llm.generate([[1, 2, 3]], sp)[0].outputs[0]
    ids_only = llm.generate([[1, 2, 3]], SamplingParams(**{**sp.__dict__, "detokenize": False}))[0].outputs[0]
    assert full.text and ids_only.text == ""
    assert ids_only.token_ids == full.token_ids and ids_only.finish_reason == full.finish_reason


def test_logprobs_are_returned(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["llama"])
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        # vLLM's shape: {token_id: Logprob}, the chosen token first; greedy: it is the top-1
        assert next(iter(lp)) == tok and len(lp) == 3 and lp[tok].rank == 1
        assert sorted(x.rank for x in lp.values()) == [1, 2, 3]
        assert all(x.decoded_token == llm.tokenizer.decode([t]) for t, x in lp.items())
    assert out.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True))
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 99}, "logprobs"),
        ({"presence_penalty": 5.0}, "presence_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"stop": ["x"], "detokenize": False}, "stop"),  # stop strings are matched on the text
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and field in str(e.value)


def test_bad_prompts_are_rejected_before_allocation(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["llama"], max_model_len=128)
    eng = llm.engine
    sp = SamplingParams(max_tokens=8)
    cases = [
        ([], InvalidRequestError, "empty"),
        ([1, 2, eng.arch.vocab_size], InvalidRequestError, "vocabulary"),
        ([-1], InvalidRequestError, "vocabulary"),
        (list(range(125)), PromptTooLongError, "max_model_len"),
    ]
    for prompt, exc, words in cases:
        with pytest.raises(exc) as e:
            llm.generate([prompt], sp)
        assert words in str(e.value)
        assert eng.kv.pool.num_used_blocks == 0 and not eng.has_unfinished()
    # A bad request in a batch admits nothing from the batch.
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2, 3], []], sp)
    assert not eng.has_unfinished() and eng.kv.pool.num_used_blocks == 0


def test_max_model_len_must_fit_the_cache(tiny_models) -> None:
    from pdserve.engine.llm import LLM
    from pdserve.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        LLM(str(tiny_models["llama"]), num_blocks_override=4, block_size=16, max_model_len=512)
    assert "max_model_len" in str(e.value) and "64 tokens" in str(e.value)


def _run(eng, rid: str, **kw) -> list[int]:
    eng.add_request(
        kw.pop("prompt", None), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), rid, **kw
    )
    toks: list[int] = []
    while eng.has_unfinished():
        for d in eng.step():
            toks += d.token_ids
    return toks


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_embeds_equal_their_token_ids(async_scheduling, tiny_models, make_llm) -> None:
    import torch

    # chunked (embeds cross steps)
    llm = make_llm(tiny_models["qwen3"], max_num_batched_tokens=16, async_scheduling=async_scheduling)
    eng = llm.engine
    ids = list(range(5, 45))
    table = eng.runner.model.model.embed_tokens.weight.detach()
    want = _run(eng, "ids", prompt=ids)
    got = _run(eng, "embeds", prompt_embeds=table[ids].clone())
    assert got == want
    # Other embeddings: different tokens, and no prefix-cache hit on the placeholders.
    hits = eng.kv.pool.num_hit_blocks
    other = _run(eng, "other", prompt_embeds=table[ids].clone() * 1.5)
    assert eng.kv.pool.num_hit_blocks == hits and other != want
    with pytest.raises(InvalidRequestError, match="prompt_embeds"):
        eng.add_request(None, SamplingParams(), "bad", prompt_embeds=torch.zeros(3, 7))
    with pytest.raises(InvalidRequestError, match="NaN"):
        eng.add_request(
            None, SamplingParams(), "nan", prompt_embeds=torch.full((2, table.shape[1]), float("nan"))
        )
    assert not eng.has_unfinished()


def test_the_engine_sets_torchs_cpu_threads_from_cpu_threads(tiny_models, make_llm) -> None:
    """A CPU engine applies ``cpu_threads`` to torch (a set value as it is; auto: half the
    usable cores, at least one) and still generates."""
    import torch

    from pdserve.config.engine import usable_cpus

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        llm = make_llm(tiny_models["llama"], device="cpu", cpu_threads=1)
        assert torch.get_num_threads() == 1
        out = llm.generate(["Say"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 3
        make_llm(tiny_models["llama"], device="cpu")
        assert torch.get_num_threads() == max(1, usable_cpus() // 2)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_step_counters_sum_sequences_tokens_and_decodes(async_scheduling, tiny_models, make_llm) -> None:
    """The engine's step counters (the nodes' pdserve:engine_step_* metrics): one step per launch
    with something scheduled, its chunks, tokens and one-token chunks (decodes) summed."""
    llm = make_llm(tiny_models["llama"], max_num_batched_tokens=16, async_scheduling=async_scheduling)
    c = llm.engine.counters
    assert (c.num_steps_total, c.num_step_seqs_total, c.num_step_tokens_total) == (0, 0, 0)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate([list(range(3, 23)), list(range(100, 105))], sp)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    # 1: A's first 16 prompt tokens (the budget); 2: A's last 4 + B's 5 (both sample); 3-5: two
    # decodes each. Under asynchronous scheduling the same chunks (no row past max_tokens).
    assert c.num_steps_total == 5
    assert c.num_step_seqs_total == 1 + 2 + 3 * 2
    assert c.num_step_tokens_total == 16 + (4 + 5) + 3 * 2
    assert c.num_step_decode_seqs_total == 3 * 2


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_kv_load_sink_gets_the_pull_when_its_blocks_are_allocated(
    async_scheduling, tiny_models, make_llm
) -> None:
    """With a sink (the node's connector) a remote-KV request's pull is handed over from inside
    the step that allocated its blocks, before that step's work runs (not after it, where
    take_kv_loads() finds it without a sink); the request waits for the load and runs after it."""
    from pdserve.kvtransfer.params import RemotePrefillParams

    eng = make_llm(tiny_models["llama"], async_scheduling=async_scheduling).engine
    eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=8, ignore_eos=True), "busy")
    eng.step()
    seen: list[tuple[str, int]] = []
    launch = eng.runner.launch

    def spy_launch(*a, **kw):  # the step's work: the sink was called before it
        seen.append(("launch", len(got)))
        return launch(*a, **kw)

    eng.runner.launch = spy_launch
    got: list = []
    eng.kv_loads.sink = got.extend
    eng.add_request(
        list(range(10, 30)),
        SamplingParams(max_tokens=3, ignore_eos=True),
        "remote",
        kv_transfer_params=RemotePrefillParams("t-1", "p:1"),
        output_token_ids=[42],
    )
    eng.step()
    assert [s.request_id for s in got] == ["remote"] and got[0].num_tokens == 20
    assert seen and seen[0] == ("launch", 1)  # handed over before the step launched
    assert eng.take_kv_loads() == []
    for _ in range(3):
        eng.step()
    assert eng.scheduler.requests["remote"].status.name == "WAITING_FOR_REMOTE_KV"
    eng.finish_kv_load("remote", True, KvLoadFailurePolicy.FAIL)
    while eng.has_unfinished():
        eng.step()
    assert eng.num_used_blocks() == 0
