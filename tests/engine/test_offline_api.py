"""The offline API in vLLM's shapes: ``LLM.generate`` with n samples and vLLM's prompt forms,
``LLM.chat`` through the chat template (greedy tokens equal transformers' on the rendered prompt)."""

from __future__ import annotations

import pytest

from pdserve.engine.chat_template import render_chat
from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError
from tests.engine.test_engine_parity import NEW_TOKENS, _reference, compare_greedy

PROMPT = "Once upon a time"


def _ids(r: RequestOutput) -> list[list[int]]:
    return [o.token_ids for o in r.outputs]


def test_generate_n_samples_in_vllms_shape(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["qwen3"])
    sp = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate(PROMPT, sp)
    assert isinstance(out, RequestOutput) and out.finished and out.request_id
    assert out.prompt == PROMPT and out.prompt_token_ids == llm.engine.tokenize(PROMPT)
    assert out.prompt_logprobs is None
    assert [type(o) for o in out.outputs] == [CompletionOutput] * 3
    assert [o.index for o in out.outputs] == [0, 1, 2]
    for o in out.outputs:
        assert len(o.token_ids) == 8 and o.text and o.finished()
        assert (o.finish_reason, o.stop_reason, o.cumulative_logprob, o.logprobs) == (
            "length",
            None,
            None,
            None,
        )
    assert len({tuple(t) for t in _ids(out)}) == 3  # seeded samples differ from each other ...
    assert _ids(llm.generate(PROMPT, sp)[0]) == _ids(out)  # ... and replay
    # sample i runs with seed + i, as the router's choices do
    one = SamplingParams(temperature=1.0, seed=12, max_tokens=8, ignore_eos=True)
    assert _ids(llm.generate(PROMPT, one)[0]) == [out.outputs[1].token_ids]
    # greedy n > 1: n identical samples, equal to n = 1
    greedy = SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True)
    (g,) = llm.generate([PROMPT], greedy)
    want = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert _ids(g) == _ids(want) * 3 and len({o.text for o in g.outputs}) == 1
    # logprobs: a cumulative logprob per sample, the sum of its chosen tokens'
    (lp,) = llm.generate(PROMPT, SamplingParams(n=2, temperature=0.0, max_tokens=4, logprobs=1))
    for o in lp.outputs:
        assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids)
        chosen = [pos[t].logprob for pos, t in zip(o.logprobs, o.token_ids, strict=True)]
        assert o.cumulative_logprob == pytest.approx(sum(chosen))
    # prompt logprobs once per prompt (sample 0 scores it), None first as vLLM's
    (pl,) = llm.generate(PROMPT, SamplingParams(n=2, temperature=0.0, max_tokens=2, prompt_logprobs=1))
    lps = pl.prompt_logprobs
    assert lps is not None and len(lps) == len(pl.prompt_token_ids) and lps[0] is None
    assert [next(iter(d or {})) for d in lps[1:]] == pl.prompt_token_ids[1:]
    assert pl.outputs[0].token_ids == pl.outputs[1].token_ids


def test_generate_takes_vllms_prompt_forms(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["llama"])
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    ids = llm.engine.tokenize(PROMPT)
    outs = llm.generate([PROMPT, {"prompt": PROMPT}, {"prompt_token_ids": ids}, ids, "other"], sp)
    assert [o.prompt for o in outs] == [PROMPT, PROMPT, None, None, "other"]
    assert [o.prompt_token_ids for o in outs[:4]] == [ids] * 4
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:4]}) == 1
    assert len({o.request_id for o in outs}) == 5
    # one SamplingParams per prompt, each with its own n
    mixed = llm.generate(["a", "b"], [SamplingParams(n=2, max_tokens=2), SamplingParams(max_tokens=3)])
    assert [[len(t) for t in _ids(r)] for r in mixed] == [[2, 2], [3]]
    # refused before anything is admitted, naming the problem
    for bad, words in [
        ({"prompt": "x", "multi_modal_data": {}}, "multi_modal_data"),
        (3.5, "float"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
    ]:
        with pytest.raises(InvalidRequestError, match=words):
            llm.generate(["fine", bad], sp)  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError, match="2 prompts but 3 sampling params"):
        llm.generate(["a", "b"], [sp] * 3)
    assert not llm.engine.has_unfinished() and llm.engine.kv.pool.num_used_blocks == 0


def test_chat_greedy_equals_transformers_on_the_rendered_prompt(tiny_models, make_llm) -> None:
    model_dir = tiny_models["llama"]
    llm = make_llm(model_dir)
    tok = llm.tokenizer
    conversation = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "Tell me a story"},
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    (out,) = llm.chat(conversation, sp)
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert out.prompt == text and out.prompt_token_ids == ids and out.finished
    assert compare_greedy([out.outputs[0].token_ids], _reference(model_dir, [ids])) == 0
    # a list of conversations; OpenAI content parts are joined with newlines, as the router does
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a"}]}
    ]
    both = llm.chat([conversation, parts], sp)
    assert [len(r.outputs) for r in both] == [1, 1] and both[0].outputs[0].token_ids == out.outputs[
        0
    ].token_ids
    joined = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me\na"}], tokenize=False, add_generation_prompt=True
    )
    assert both[1].prompt == joined
    # a template of the caller's, and continue_final_message
    own = llm.chat(conversation, sp, chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert own[0].prompt == "[be brief][Tell me a story]"
    cont = [*conversation, {"role": "assistant", "content": "Once"}]
    (c,) = llm.chat(cont, sp, add_generation_prompt=False, continue_final_message=True)
    assert c.prompt is not None and c.prompt.endswith("Once")


def test_chat_refusals_name_the_field(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["llama"])
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError) as e:
        llm.chat(msgs, continue_final_message=True)
    assert e.value.field == "continue_final_message"
    with pytest.raises(InvalidRequestError) as e:
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert e.value.field == "messages.0.content.0.type" and "image_url" in str(e.value)
    with pytest.raises(InvalidRequestError, match="'role'"):
        llm.chat([{"content": "no role"}])
    with pytest.raises(InvalidRequestError, match="cannot render"):
        llm.chat(msgs, chat_template="{{ raise_exception('no users here') }}")
    tok = llm.tokenizer
    saved = tok.chat_template
    tok.chat_template = None
    try:
        with pytest.raises(InvalidRequestError, match="no chat template"):
            render_chat(tok, msgs)
    finally:
        tok.chat_template = saved
    assert not llm.engine.has_unfinished() and llm.engine.kv.pool.num_used_blocks == 0
