"""Grammars compile off the engine thread under a time limit (pdserve.engine.grammar_compile), and
``json_object`` means a JSON object."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("xgrammar")

from pdserve.engine.request import RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError


def _schema(num_properties: int) -> str:
    props = {f"field_{i}": {"type": "string"} for i in range(num_properties)}
    return json.dumps({"type": "object", "properties": props})


def test_json_object_is_an_object_for_20_seeded_samples(tiny_models, make_llm) -> None:
    """OpenAI's json_object: every answer is a JSON object (xgrammar's builtin JSON grammar also
    took arrays). A random model's strings close late (2 to 663 tokens for these seeds), so
    max_tokens leaves room for all 20 to end by the grammar (finish_reason stop)."""
    llm = make_llm(tiny_models["llama"], max_model_len=1024)
    params = [
        SamplingParams(temperature=1.0, seed=1000 + s, max_tokens=900, structured=("json_object", ""))
        for s in range(20)
    ]
    outs = [r.outputs[0] for r in llm.generate(["The answer is"] * 20, params)]
    assert [o.finish_reason for o in outs] == ["stop"] * 20, [
        (o.finish_reason, len(o.token_ids)) for o in outs
    ]
    for o in outs:
        assert isinstance(json.loads(o.text), dict), o.text
    assert len({o.text for o in outs}) > 5  # sampled, not one forced answer


def test_json_object_grammar_takes_objects_only(tiny_models) -> None:
    import xgrammar as xgr

    from pdserve.engine.grammar_compile import GrammarCompiler
    from pdserve.models.loader import load_tokenizer

    tok = load_tokenizer(str(tiny_models["llama"]))
    compiled = GrammarCompiler(tok, len(tok)).compile("json_object", "")
    for text, ok in [
        ('{"a": [1, {"b": null}], "c": "d"}', True),
        ("{}", True),
        ("[1, 2]", False),
        ('"x"', False),
    ]:
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string(text) == ok and (
            not ok or m.is_terminated() or m.accept_token(tok.eos_token_id)
        ), text


def test_a_slow_compile_is_cancelled_at_its_limit_while_other_requests_keep_stepping(
    tiny_models, make_llm
) -> None:
    """A schema under the size limit whose compile takes ~12 s here (1,000 string properties)
    with grammar_compile_timeout_s=1: its request alone ends with an error naming the limit,
    holding no blocks, while 4 unconstrained requests keep producing tokens (ITL p99 < 1 s);
    the killed worker is replaced for the next grammar, which is cached afterwards."""
    llm = make_llm(tiny_models["llama"], max_model_len=512, grammar_compile_timeout_s=1.0)
    eng = llm.engine
    eng.grammar_service().submit("regex", "[ab]{3}").result(timeout=120)  # worker and tokenizer up
    free = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(4):
        eng.add_request("Say", free, f"free-{i}")
    eng.add_request("Say", SamplingParams(max_tokens=8, structured=("json_schema", _schema(1000))), "slow")
    assert eng.scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_GRAMMAR
    t0 = time.monotonic()
    last: dict[str, float] = {}
    gaps: list[float] = []
    slow_end = None
    while eng.has_unfinished() and slow_end is None:
        for d in eng.step():
            now = time.monotonic()
            if d.request_id == "slow":
                slow_end = (now - t0, d)
                continue
            if d.token_ids and d.request_id in last:
                gaps.append(now - last[d.request_id])
            last[d.request_id] = now
    assert slow_end is not None, "the slow grammar's request never ended"
    waited_s, delta = slow_end
    assert delta.finish_reason == "error" and "grammar_compile_timeout_s=1" in (delta.error or ""), delta
    assert waited_s < 5.0, waited_s  # the 1 s limit, not the ~12 s compile
    assert len(gaps) >= 20, len(gaps)  # the others stepped meanwhile
    gaps.sort()
    assert gaps[int(0.99 * (len(gaps) - 1))] < 1.0, gaps[-5:]
    service = eng.grammar_admission.service
    assert service is not None and service.num_timeouts_total == 1
    eng.abort([f"free-{i}" for i in range(4)])
    # the worker was killed; the next grammar starts a new one and then admits from the cache
    out = llm.generate(
        ["Say"], [SamplingParams(temperature=0.0, max_tokens=6, structured=("regex", "[cd]{4}"))]
    )
    text = out[0].outputs[0].text
    assert text in {a + b + c + d for a in "cd" for b in "cd" for c in "cd" for d in "cd"}, text
    assert service.submit("regex", "[cd]{4}").done()
    assert eng.kv.pool.num_used_blocks == 0


def test_a_spec_over_max_grammar_bytes_is_refused_at_admission(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["llama"], max_model_len=256, max_grammar_bytes=1000)
    with pytest.raises(InvalidRequestError, match="max_grammar_bytes") as e:
        llm.engine.add_request("Say", SamplingParams(structured=("json_schema", _schema(100))))
    assert str(len(_schema(100))) in str(e.value)
    assert not llm.engine.has_unfinished()


def test_a_cached_grammar_admits_at_once_and_the_matchers_use_the_service_cache(
    tiny_models, make_llm, monkeypatch
) -> None:
    """The path a node takes (EngineLoop.admit waits for the compile, then add_request hits the
    cache): the request is queued at once and its matcher's grammar comes from the service's
    cache; nothing compiles on the engine thread."""
    import threading

    from pdserve.engine.grammar_compile import GrammarCompiler

    llm = make_llm(tiny_models["llama"], max_model_len=256)
    eng = llm.engine
    eng.grammar_service().submit("regex", "[xy]{5}").result(timeout=120)
    engine_thread = threading.current_thread()
    compile_ = GrammarCompiler.compile

    def compile_off_thread(self, kind, spec):
        assert threading.current_thread() is not engine_thread or self.cached(kind, spec) is not None
        return compile_(self, kind, spec)

    monkeypatch.setattr(GrammarCompiler, "compile", compile_off_thread)
    eng.add_request(
        "Say", SamplingParams(temperature=0.0, max_tokens=5, structured=("regex", "[xy]{5}")), "r"
    )
    assert eng.scheduler.requests["r"].status == RequestStatus.WAITING
    deltas = []
    while eng.has_unfinished():
        deltas += eng.step()
    text = "".join(d.text for d in deltas)
    assert len(text) == 5 and set(text) <= {"x", "y"}, text
    assert eng.runner.grammar.compiler is eng.grammar_admission.service.compiler
