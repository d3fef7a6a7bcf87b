"""The served path: router -> the node's Steps socket -> node -> engine thread.

Token streams through the router equal the in-process engine's for a batch of concurrent
requests (greedy and seeded, streamed and not), whatever number of tokens each message
carries; the Steps stream itself (merged deltas, abort, refusal, end); and overload: past the
node's queue limit or queue wait a request gets 503 with OpenAI's error body and nothing is held.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import grpc
import httpx
import pytest

from pdserve.rpc import node_pb2 as pb
from tests.e2e import cluster as e2e_cluster
from tests.e2e.cluster import make_cluster_config, running_cluster
from tests.e2e.steps_client import RawSteps, decode_req

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
# Token-id prompts: 6 tokens (< local_prefill_max_tokens: prefilled on the decode node, the
# colocated path) and 40 tokens (prefill-0 -> KV over Mooncake -> decode-0).
PROMPTS = [[5 + (7 * i + j) % 400 for j in range(6 if i % 2 == 0 else 40)] for i in range(8)]


@pytest.fixture(scope="module", autouse=True)
def _own_ports():
    # gRPC servers bind with SO_REUSEPORT: a cluster of another test run on this host that picked
    # the same default base port would silently share our nodes' ports. Start elsewhere.
    e2e_cluster._next_base[0] = random.randrange(20000, 30000, 10)


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory, _own_ports):
    # Two router workers on one port: every request below crosses one of them.
    cfg = make_cluster_config(tiny_models["llama"], router={"local_prefill_max_tokens": 16, "workers": 2})
    with running_cluster(cfg, tmp_path_factory.mktemp("served-e2e")) as rc:
        yield rc


def _bodies(rc, seeded: bool) -> list[dict]:
    out = []
    for i, p in enumerate(PROMPTS):
        b = {"model": rc.model_name, "prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        b.update({"temperature": 0.9, "top_p": 0.9, "seed": 1000 + i} if seeded else {"temperature": 0.0})
        out.append(b)
    return out


def _in_process(model_dir, bodies: list[dict]) -> list[tuple[str, int]]:
    """The same requests on an in-process engine, all admitted at once (text, token count)."""
    from pdserve.config.engine import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=str(model_dir), device="cpu"))
    texts = {i: "" for i in range(len(bodies))}
    counts = dict.fromkeys(range(len(bodies)), 0)
    for i, b in enumerate(bodies):
        keys = ("temperature", "top_p", "seed", "max_tokens", "ignore_eos")
        eng.add_request(b["prompt"], SamplingParams(**{k: b[k] for k in keys if k in b}), str(i))
    while eng.has_unfinished():
        for d in eng.step():
            texts[int(d.request_id)] += d.text
            counts[int(d.request_id)] += len(d.token_ids)
    return [(texts[i], counts[i]) for i in range(len(bodies))]


async def _served(rc, bodies: list[dict], stream: bool) -> list[tuple[str, int, int]]:
    """(text, completion tokens, SSE chunks with text) per request, all sent concurrently."""
    async with httpx.AsyncClient(timeout=120) as h:

        async def one(b: dict) -> tuple[str, int, int]:
            if not stream:
                r = await h.post(rc.base_url + "/completions", json=b)
                assert r.status_code == 200, r.text
                j = r.json()
                return j["choices"][0]["text"], j["usage"]["completion_tokens"], 1
            body = {**b, "stream": True, "stream_options": {"include_usage": True}}
            text, n, chunks = "", 0, 0
            async with h.stream("POST", rc.base_url + "/completions", json=body) as r:
                assert r.status_code == 200
                import json

                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    c = json.loads(line[6:])
                    assert "error" not in c, c
                    if c.get("usage"):
                        n = c["usage"]["completion_tokens"]
                    for ch in c["choices"]:
                        if ch["text"]:
                            text += ch["text"]
                            chunks += 1
            return text, n, chunks

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def _wait_free(rc) -> None:
    deadline = time.monotonic() + 10
    while True:
        reps = {n: rc.load(n) for n in ("prefill-0", "decode-0")}
        state = {
            n: (r.num_running, r.num_waiting, r.num_blocks_used, r.num_held_requests) for n, r in reps.items()
        }
        if all(s == (0, 0, 0, 0) for s in state.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"still held: {state}")
        time.sleep(0.1)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_router_streams_equal_the_in_process_engine(cluster, tiny_models, seeded) -> None:
    assert_streams_equal_in_process(cluster, tiny_models["llama"], seeded)
    _wait_free(cluster)


def assert_streams_equal_in_process(rc, model_dir, seeded: bool) -> None:
    """PROMPTS through the router, streamed and not, against the in-process engine."""
    bodies = _bodies(rc, seeded)
    want = _in_process(model_dir, bodies)
    assert all(n == MAX_TOKENS for _, n in want)
    for stream in (True, False):
        got = asyncio.run(_served(rc, bodies, stream))
        assert [(t, n) for t, n, _ in got] == want, f"stream={stream}"
        if stream:
            # however the node batched them: never more text chunks than tokens
            assert all(1 <= chunks <= n for _, n, chunks in got)


def test_steps_stream_merges_aborts_refuses_and_ends(cluster) -> None:
    raw = RawSteps(cluster.load("decode-0").steps_socket)
    try:
        assert raw.welcome.code == 0
        start = [
            decode_req("a", 40, prompt=[3, 4, 5, 6]),
            decode_req("b", 1500, prompt=[3, 4, 5, 6]),
            decode_req("bad", 4, temperature=-1.0),
        ]
        raw.send(pb.StepCommand(start=start).SerializeToString())
        toks: dict[str, list[int]] = {"a": [], "b": []}
        finished: dict[str, str] = {}
        ends: dict[str, pb.StepEnd] = {}
        aborted = False
        while not ("a" in finished and "bad" in ends):
            batch = raw.batch()
            ids = [d.request_id for d in batch.deltas]
            assert len(ids) == len(set(ids)), "one merged delta per request per batch"
            for d in batch.deltas:
                toks[d.request_id].extend(d.token_ids)
                if d.finish_reason:
                    finished[d.request_id] = d.finish_reason
            for e in batch.ends:
                ends[e.request_id] = e
            if toks["b"] and not aborted:
                raw.send(pb.StepCommand(abort=["b"]).SerializeToString())
                aborted = True
        assert finished["a"] == "length" and len(toks["a"]) == 40
        assert (
            ends["bad"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            and "temperature" in ends["bad"].details
        )
        assert "b" not in finished and 0 < len(toks["b"]) < 1500  # aborted mid-way, never finished
    finally:
        raw.close()  # the router's side closes: the stream ends
    _wait_free(cluster)


def test_router_workers_add_up_their_metrics_and_die_together(cluster) -> None:
    """Last on ``cluster``: it kills a worker of the cluster's router."""
    import os
    import re
    import signal
    import subprocess

    def tokens() -> float:
        m = re.search(
            r"^pdserve:generation_tokens_total ([0-9.e+]+)$",
            httpx.get(cluster.cluster.router_url + "/metrics").text,
            re.M,
        )
        assert m, "no generation_tokens in /metrics"
        return float(m.group(1))

    before = tokens()
    bodies = [
        {"model": cluster.model_name, "prompt": [4, 5, 6 + i], "max_tokens": 8, "ignore_eos": True}
        for i in range(6)
    ]
    for b in bodies:  # a new connection each: the kernel hands them to either worker
        assert httpx.post(cluster.base_url + "/completions", json=b, timeout=60).status_code == 200
    # any worker's /metrics is the sum over both (each scrape may land on either)
    for _ in range(4):
        assert tokens() - before == 6 * 8

    # Kill one worker: the router stops as a whole. The module's own router (the last test on
    # this cluster: it ends its router; a second router cost ~20 s of start-up on 2 cores).
    proc = next(c for c in cluster.children if c.name == "router").proc
    kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    workers = [int(k) for k in kids if "spawn_main" in open(f"/proc/{k}/cmdline").read().replace("\0", " ")]
    assert len(workers) == 2, kids
    os.kill(workers[0], signal.SIGKILL)
    assert proc.wait(timeout=30) != 0  # the router exits non-zero for its supervisor
    assert (
        not os.path.exists(f"/proc/{workers[1]}") or open(f"/proc/{workers[1]}/stat").read().split()[2] == "Z"
    )


@pytest.fixture(scope="module")
def small_cluster(tiny_models, tmp_path_factory, _own_ports):
    """One sequence at a time on decode-0, at most 2 queued, at most 0.25 s in the queue."""
    cfg = make_cluster_config(
        tiny_models["llama"],
        router={"local_prefill_max_tokens": 10_000},
        **{"decode-0": {"max_num_seqs": 1, "max_queue_len": 2, "max_queue_wait_s": 0.25}},
    )
    with running_cluster(cfg, tmp_path_factory.mktemp("served-overload")) as rc:
        yield rc


@pytest.mark.skipif(
    not os.environ.get("PDSERVE_FULL_TESTS"),
    reason="~12 s on 2 cores (a cluster of its own): PDSERVE_FULL_TESTS=1 runs it (the 503 with an OpenAI body is tested at the router in tests/services/test_router_api.py::test_capacity_error_is_503, the queue limits in tests/engine)",
)
def test_overload_is_a_503_with_an_openai_body_and_holds_nothing(small_cluster) -> None:
    rc = small_cluster
    # 1,200 tokens keep the one running sequence busy well past the 0.25 s queue wait, also on a
    # quiet machine (400 tokens once finished first, and the queued requests ran instead of expiring).
    body = {"model": rc.model_name, "max_tokens": 1200, "ignore_eos": True, "temperature": 0.0}

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as h:

            async def one(i: int) -> httpx.Response:
                b = {**body, "prompt": [10 + i, 11, 12], "stream": i % 2 == 1}
                return await h.post(rc.base_url + "/completions", json=b)

            return list(await asyncio.gather(*(one(i) for i in range(10))))

    rs = asyncio.run(main())
    statuses = [r.status_code for r in rs]
    assert set(statuses) <= {200, 503}, statuses
    refused = [r.json()["error"] for r in rs if r.status_code == 503]
    assert 1 <= statuses.count(200) <= 3 and refused, statuses
    for e in refused:
        assert e["type"] and e["code"] and e["message"], e
    messages = " | ".join(e["message"] for e in refused)
    assert "queue is full" in messages, messages  # max_queue_len
    assert "waited" in messages, messages  # max_queue_wait_s
    deadline = time.monotonic() + 10
    while True:
        r = rc.load("decode-0")
        if (r.num_running, r.num_waiting, r.num_blocks_used, r.num_held_requests) == (0, 0, 0, 0):
            break
        assert time.monotonic() < deadline, r
        time.sleep(0.1)
