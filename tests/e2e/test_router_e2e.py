"""The official openai client against real router, prefill and decode processes."""

from __future__ import annotations

import asyncio
import os
import re
import time

import httpx
import openai
import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(shared_pd_cluster):
    return shared_pd_cluster  # tests/e2e/conftest.py: local_prefill_max_tokens 16


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from pdserve.models.loader import load_tokenizer

    return load_tokenizer(tiny_models["llama"])


@pytest.fixture(scope="module")
def reference(tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    model.generation_config.eos_token_id = None

    def greedy(ids: list[int], n: int) -> list[int]:
        g = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        return g[0, len(ids) :].tolist()

    return greedy


def _client(rc) -> openai.OpenAI:
    return openai.OpenAI(base_url=rc.base_url, api_key="unused", max_retries=0)


def _metric(rc, name: str) -> float:
    text = httpx.get(rc.cluster.router_url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _wait_all_free(rc) -> None:
    deadline = time.monotonic() + 5
    while True:
        reps = [rc.load("prefill-0"), rc.load("decode-0")]
        state = [
            (r.num_blocks_used, r.num_held_requests, r.num_blocks_held_for_transfer, r.stranded_kv_blocks)
            for r in reps
        ]
        if all(s == (0, 0, 0, 0) for s in state):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held: {state}")
        time.sleep(0.1)


@pytest.mark.parametrize("prompt_words", [2, 60])  # local prefill on decode / disaggregated
def test_completions_greedy_equals_transformers(cluster, tokenizer, reference, prompt_words) -> None:
    prompt = " ".join(["disaggregated serving moves the KV cache"] * prompt_words)[: prompt_words * 12]
    ids = tokenizer.encode(prompt)
    resp = _client(cluster).completions.create(
        model=cluster.model_name, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    want = tokenizer.decode(reference(ids, 24), skip_special_tokens=True)
    assert resp.choices[0].text == want
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 24
    _wait_all_free(cluster)


@pytest.mark.parametrize("prompt_words", [2, 60])  # local prefill on decode / disaggregated
@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_token_id_comes_back_as_an_int(cluster, tokenizer, reference, prompt_words, stream) -> None:
    """vLLM's shape: ``stop_reason`` is the stop token's id as an integer (a stop string stays a
    string), through the node's gRPC (Steps batches and PrefillResponse.first) and the router."""
    prompt = " ".join(["disaggregated serving moves the KV cache"] * prompt_words)[: prompt_words * 12]
    ids = tokenizer.encode(prompt)
    out = reference(ids, 12)
    stop_at = next(i for i in range(2, 12) if out[i] not in out[:i])  # first time that token shows
    kwargs = dict(model=cluster.model_name, prompt=prompt, max_tokens=12, temperature=0)
    extra = {"ignore_eos": True, "stop_token_ids": [out[stop_at]]}
    c = _client(cluster)
    if stream:
        chunks = list(c.completions.create(**kwargs, stream=True, extra_body=extra))
        last = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].finish_reason][-1]
    else:
        last = c.completions.create(**kwargs, extra_body=extra).choices[0]
    assert last.finish_reason == "stop"
    assert (last.model_extra or {}).get("stop_reason") == out[stop_at]  # an int, not "123"
    _wait_all_free(cluster)


def test_every_process_froze_its_start_up_heap(cluster) -> None:
    """services/gc_heap.py: the router and each node froze their start-up objects before serving
    (no full collection walks them while requests stream)."""
    for child in cluster.children:
        log = child.log_path.read_text(errors="replace")
        m = re.search(r"(\d+) start-up objects frozen out of garbage collection", log)
        assert m is not None, f"{child.name} logged no frozen start-up heap"
        assert int(m.group(1)) > 50_000, f"{child.name}: only {m.group(1)} objects frozen"


def _samples(url: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _moved(before: dict, after: dict, name: str, **labels: str) -> float:
    """How much the samples called ``name`` carrying ``labels`` moved between two scrapes."""

    def total(snap: dict) -> float:
        return sum(v for (n, ls), v in snap.items() if n == name and set(labels.items()) <= ls)

    return total(after) - total(before)


def test_both_paths_were_taken(cluster) -> None:
    """One local and one P/D request: each path counted, the router's leg histograms take one
    observation per leg, decode's KV pull histogram one per pull, and the nodes' engine step
    counters move (decode's by the P/D request's decode step too)."""
    urls = {
        "router": cluster.cluster.router_url + "/metrics",
        **{n: f"http://127.0.0.1:{cluster.node(n).metrics_port}/metrics" for n in ("prefill-0", "decode-0")},
    }
    before = {k: _samples(u) for k, u in urls.items()}
    c = _client(cluster)
    c.completions.create(model=cluster.model_name, prompt="hi", max_tokens=2, temperature=0)
    c.completions.create(model=cluster.model_name, prompt="word " * 40, max_tokens=2, temperature=0)
    assert _metric(cluster, 'pdserve:router_requests_by_path_total{path="local"}') >= 1
    assert _metric(cluster, 'pdserve:router_requests_by_path_total{path="disaggregated"}') >= 1
    after = {k: _samples(u) for k, u in urls.items()}
    r0, r1 = before["router"], after["router"]
    assert _moved(r0, r1, "pdserve:router_prefill_leg_seconds_count") == 1
    assert _moved(r0, r1, "pdserve:router_prefill_leg_seconds_sum") > 0
    first = "pdserve:router_decode_first_delta_seconds_count"
    assert _moved(r0, r1, first, path="disaggregated") == 1
    assert _moved(r0, r1, first, path="local") == 1
    assert _moved(r0, r1, "pdserve:router_decode_first_delta_seconds_bucket", le="+Inf") == 2
    d0, d1 = before["decode-0"], after["decode-0"]
    assert _moved(d0, d1, "pdserve:kv_pull_seconds_count", node="decode-0") == 1
    # router.pd_decode_leg with_prefill (the default): decode asked for the KV during the prefill
    assert _moved(d0, d1, "pdserve:kv_early_pulls_total") == 1
    assert _moved(d0, d1, "pdserve:kv_pull_seconds_sum") > 0
    # decode: the local prompt (a prefill step and a decode) and the P/D request's one decode
    assert _moved(d0, d1, "pdserve:engine_step_decode_sequences_total") == 2
    assert _moved(d0, d1, "pdserve:engine_steps_total") >= 2
    # prefill: the 40-word prompt, its first token sampled there; no decode
    p0, p1 = before["prefill-0"], after["prefill-0"]
    assert _moved(p0, p1, "pdserve:engine_steps_total") >= 1
    assert _moved(p0, p1, "pdserve:engine_step_tokens_total") >= 40
    assert _moved(p0, p1, "pdserve:engine_step_decode_sequences_total") == 0


def test_chat_stream_usage_is_exact(cluster, tokenizer, reference) -> None:
    messages = [{"role": "user", "content": "Tell me about prefill and decode " * 4}]
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    stream = _client(cluster).chat.completions.create(
        model=cluster.model_name,
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert usage is not None and usage.prompt_tokens == len(ids) and usage.completion_tokens == 20
    assert usage.total_tokens == len(ids) + 20
    assert text == tokenizer.decode(reference(ids, 20), skip_special_tokens=True)


def test_async_client_streaming_and_n(cluster) -> None:
    async def run() -> tuple[list[str], str]:
        c = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)
        streamed = ""
        stream = await c.completions.create(
            model=cluster.model_name,
            prompt="async " * 30,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for ch in stream:
            streamed += ch.choices[0].text
        full = await c.completions.create(
            model=cluster.model_name,
            prompt="async " * 30,
            max_tokens=12,
            temperature=0.8,
            n=3,
            seed=7,
            extra_body={"ignore_eos": True},
        )
        await c.close()
        return [ch.text for ch in full.choices], streamed

    texts, streamed = asyncio.run(run())
    assert len(texts) == 3 and all(texts) and streamed
    _wait_all_free(cluster)


def test_error_classes_leave_nothing_held(cluster) -> None:
    c = _client(cluster)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=cluster.model_name, prompt="x", temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=cluster.model_name, prompt="long " * 3000, max_tokens=10)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=cluster.model_name, prompt=[[10**7]], max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=cluster.model_name, prompt="", max_tokens=4)
    _wait_all_free(cluster)


def test_client_disconnect_aborts_both_legs(cluster) -> None:
    """A client that leaves mid-stream aborts decode's leg. The tiny model makes 1,500 tokens in
    ~1.2 s on a 2-core host, so under a loaded suite decode can finish before the abort reaches
    it (then there is nothing to abort): up to three attempts, each a fresh request; an abort
    that never propagates fails all three."""
    body = {
        "model": cluster.model_name,
        "prompt": "stream me " * 40,
        "max_tokens": 1500,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    aborted = False
    for _attempt in range(3):
        before = cluster.load("decode-0").num_aborted_total
        with (
            httpx.Client(timeout=30) as h,
            h.stream("POST", cluster.base_url + "/completions", json=body) as r,
        ):
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                    if got >= 10:  # the first chunk is prefill's token: decode's leg is surely running
                        break
        deadline = time.monotonic() + 5
        while cluster.load("decode-0").num_aborted_total == before and time.monotonic() < deadline:
            time.sleep(0.05)
        _wait_all_free(cluster)
        if cluster.load("decode-0").num_aborted_total > before:
            aborted = True
            break
    assert aborted, "no disconnect in three reached decode's leg as an abort"


def test_prompt_embeds_through_both_legs(cluster, tiny_models) -> None:
    """Embeddings of token ids give the same tokens as the ids, on the local and the P/D path."""
    import base64

    from safetensors.torch import save

    from pdserve.models.loader import iter_safetensors

    table = dict(iter_safetensors(tiny_models["llama"], lambda n: n == "model.embed_tokens.weight"))
    table = table["model.embed_tokens.weight"].float()
    c = _client(cluster)
    for n in (6, 40):  # under / over local_prefill_max_tokens (16)
        ids = list(range(20, 20 + n))
        by_ids = c.completions.create(
            model=cluster.model_name,
            prompt=ids,
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        b64 = base64.b64encode(save({"embeds": table[ids].contiguous()})).decode()
        r = httpx.post(
            cluster.base_url + "/completions",
            json={
                "model": cluster.model_name,
                "prompt_embeds": b64,
                "max_tokens": 10,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == by_ids.choices[0].text
        assert r.json()["usage"]["prompt_tokens"] == n
    _wait_all_free(cluster)


@pytest.fixture(scope="module")
def ref_logprobs(tiny_models):
    """prompt ids -> [len - 1, vocab] transformers log-softmax (fp32) at positions 0 .. P - 2."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)[:-1]

    return run


def _path_counts(rc) -> tuple[float, float]:
    return (
        _metric(rc, 'pdserve:router_requests_by_path_total{path="local"}'),
        _metric(rc, 'pdserve:router_requests_by_path_total{path="disaggregated"}'),
    )


@pytest.mark.parametrize("n", [10, 40], ids=["local", "pd"])  # under / over local_prefill_max_tokens
def test_echo_prompt_logprobs_equal_transformers(cluster, tokenizer, ref_logprobs, n) -> None:
    ids = [(11 * i + n) % 480 + 5 for i in range(n)]  # its own first block: decode has not seen it
    ref = ref_logprobs(ids)
    c = _client(cluster)
    before = _path_counts(cluster)
    kw = dict(model=cluster.model_name, prompt=ids, echo=True, logprobs=3, temperature=0)
    resp = c.completions.create(max_tokens=4, extra_body={"ignore_eos": True}, **kw)
    after = _path_counts(cluster)
    assert after[n > 16] == before[n > 16] + 1  # the path this prompt length is meant to take
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == n + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    got = torch.tensor(lp.token_logprobs[1:n])
    want = ref.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    from services.router.logprobs import TokenTexts

    texts = TokenTexts(tokenizer)  # the router's token text (bytes:\\xHH for half a character)
    top_v, top_i = ref.topk(3, dim=-1)
    for j in range(1, n):
        best: dict[str, float] = {}
        for tid, v in zip(top_i[j - 1].tolist(), top_v[j - 1].tolist(), strict=True):
            best.setdefault(texts(tid), v)  # the router keys alternatives by text
        assert lp.top_logprobs[j].keys() == best.keys()
        for text, v in best.items():
            assert abs(lp.top_logprobs[j][text] - v) < 1e-4
    assert lp.tokens[:n] == [texts(t) for t in ids]
    # The completion's own logprobs follow, and the text is the prompt's then the completion's.
    assert len(lp.token_logprobs[n:]) == 4 and all(v is not None for v in lp.token_logprobs[n:])
    assert resp.choices[0].text.startswith(tokenizer.decode(ids))
    # max_tokens 0: the prompt alone, the same logprobs; streaming gives the same object.
    only = c.completions.create(max_tokens=0, **kw)
    assert only.usage.completion_tokens == 0 and only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]
    assert only.choices[0].text == tokenizer.decode(ids)
    streamed: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in c.completions.create(max_tokens=4, stream=True, extra_body={"ignore_eos": True}, **kw):
        run = chunk.choices[0].logprobs
        for key in streamed:
            streamed[key] += (getattr(run, key) or []) if run is not None else []
    assert streamed == {
        "tokens": lp.tokens,
        "token_logprobs": lp.token_logprobs,
        "text_offset": lp.text_offset,
    }
    _wait_all_free(cluster)


def test_repeated_prompt_reports_cached_tokens(cluster) -> None:
    """Prefix-cache hits in usage: on prefill (P/D path) and on decode (local path)."""
    bs = cluster.load("decode-0").block_size
    head = [(13 * i + 7) % 470 + 9 for i in range(3 * bs)]  # 3 full blocks of its own
    tail = [(17 * i + 3) % 470 + 9 for i in range(3 * bs)]
    c = _client(cluster)

    def cached(prompt: list[int], stream: bool = False) -> int:
        kw = dict(model=cluster.model_name, prompt=prompt, max_tokens=2, temperature=0)
        if not stream:
            u = c.completions.create(**kw).usage
        else:
            chunks = c.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
            u = [ch.usage for ch in chunks if ch.usage][-1]
        return u.prompt_tokens_details.cached_tokens

    before = _path_counts(cluster)
    assert cached(head) == 0
    # head + tail: decode saw half its blocks, so it prefills on P, whose cache holds head's.
    assert cached(head + tail) == 3 * bs
    assert cached(head + tail, stream=True) >= 3 * bs
    mid = _path_counts(cluster)
    assert mid[1] - before[1] >= 2, (before, mid)
    # head again: decode saw all of it, prefills it locally from its own cache (the pulled KV).
    hit = cached(head)
    assert _path_counts(cluster)[0] == mid[0] + 1
    assert hit == 2 * bs  # whole blocks, at least one token left to compute
    _wait_all_free(cluster)


@pytest.mark.skipif(
    not os.environ.get("PDSERVE_FULL_TESTS"),
    reason="~9 s on 2 cores: PDSERVE_FULL_TESTS=1 runs it (serial legs are the same flow's other order: tests/services/test_pd_flow.py)",
)
def test_a_router_with_serial_legs_gives_the_same_tokens(cluster, tokenizer, reference, tmp_path) -> None:
    """router.pd_decode_leg after_prefill (the decode leg opens once the first token is back):
    a second router on the same nodes gives transformers' greedy tokens on the P/D path, and its
    pull is not an early one; the default router's early pulls are what the test above counts."""
    from pdserve.config.cluster import ClusterConfig, write_cluster_config
    from services.launcher import start_child, wait_ready
    from tests.e2e.cluster import kill_children

    data = cluster.cluster.model_dump(mode="json", exclude_unset=True)
    data["router"] = {
        **data["router"],
        "port": cluster.cluster.router.port + 97,
        "pd_decode_leg": "after_prefill",
    }
    serial = ClusterConfig.from_dict(data)
    router = start_child(write_cluster_config(serial, tmp_path / "serial.yaml"), "router", None, tmp_path)
    try:
        wait_ready(serial, [router], timeout_s=60)
        url = f"http://127.0.0.1:{cluster.node('decode-0').metrics_port}/metrics"
        early0 = _scrape_value(url, "pdserve:kv_early_pulls_total")
        pulls0 = _scrape_value(url, "pdserve:kv_pull_seconds_count")
        ids = tokenizer.encode(" ".join(["serial legs move the KV cache"] * 12))
        client = openai.OpenAI(base_url=serial.router_url + "/v1", api_key="unused", max_retries=0)
        resp = client.completions.create(
            model=cluster.model_name,
            prompt=ids,
            max_tokens=8,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert resp.choices[0].text == tokenizer.decode(reference(ids, 8), skip_special_tokens=True)
        assert _scrape_value(url, "pdserve:kv_pull_seconds_count") == pulls0 + 1  # P/D, one pull
        assert _scrape_value(url, "pdserve:kv_early_pulls_total") == early0  # not an early one
    finally:
        kill_children([router])
    _wait_all_free(cluster)


def _scrape_value(url: str, name: str) -> float:
    text = httpx.get(url).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_prefill_death_falls_back_to_local_prefill(cluster, tokenizer, reference) -> None:
    """Runs last in this module: it kills the prefill node."""
    import os
    import signal

    p = next(c for c in cluster.children if c.name == "prefill-0")
    os.killpg(p.proc.pid, signal.SIGKILL)
    p.proc.wait(timeout=10)
    prompt = "after the prefill node died " * 6
    resp = _client(cluster).completions.create(
        model=cluster.model_name, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    want = tokenizer.decode(reference(tokenizer.encode(prompt), 16), skip_special_tokens=True)
    assert resp.choices[0].text == want
    assert _metric(cluster, 'pdserve:router_requests_by_path_total{path="local_fallback"}') >= 1
    d = cluster.load("decode-0")
    assert d.num_blocks_used == 0 and d.num_held_requests == 0
