"""Prefill and decode nodes with pipeline parallelism, as real processes: the router,
a prefill node of P stages and a decode node of D stage processes, each stage with its own
Mooncake TE endpoint (TCP, loopback), driven by the official ``openai`` client.

Greedy output must equal the colocated single-stage engine's (itself checked against
``transformers`` here too); afterwards nothing is held on any stage of either node.
"""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.rpc import convert
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from tests.e2e.cluster import RunningCluster, make_cluster_config, running_cluster
from tests.engine.test_engine_parity import NEW_TOKENS, _reference, compare_greedy

pytestmark = pytest.mark.slow

LENGTHS = [1, 4, 17, 33, 64, 100, 150, 230]  # 8 concurrent requests, 1 to >= 200 tokens


@pytest.fixture(scope="module")
def llama4(tiny_model_factory) -> Path:
    return tiny_model_factory("llama", num_layers=4)


@pytest.fixture(scope="module")
def expected(llama4):
    """Prompts, and the colocated single-stage engine's greedy tokens and text for them."""
    from pdserve.engine.llm import LLM

    llm = LLM(str(llama4))
    rng = random.Random(13)  # a prompt set without near-ties (checked below)
    prompts = [[rng.randrange(3, llm.engine.arch.vocab_size) for _ in range(n)] for n in LENGTHS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    llm.engine.kv.process_deferred_frees()
    assert llm.engine.kv.pool.num_used_blocks == 0
    llm.engine.close()
    tokens = [o.outputs[0].token_ids for o in outs]
    ref = _reference(llama4, prompts)
    assert compare_greedy(tokens, ref) == 0  # the engine equals transformers
    # Exact equality across nodes is meaningful only away from near-ties: a different batch
    # composition legitimately moves logits by ~1e-6 (seed 11 had a 2e-6 tie at one step).
    gap = min(float(v[0] - v[1]) for _, logits in ref for lg in logits for v in [torch.topk(lg, 2).values])
    assert gap > 1e-4, gap
    return prompts, tokens, [o.outputs[0].text for o in outs]


def _cluster(model: Path, p_pp: int, d_pp: int, **all_nodes) -> object:
    return make_cluster_config(
        model,
        router={"local_prefill_max_tokens": 0},  # every request goes prefill -> decode
        **{"prefill-0": {"pp": p_pp}, "decode-0": {"pp": d_pp}},
        all={"max_num_batched_tokens": 256, **all_nodes},
    )


def _client(rc: RunningCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=rc.base_url, api_key="unused", max_retries=0, timeout=120)


def _complete(rc: RunningCluster, prompt: list[int], max_tokens: int = NEW_TOKENS) -> tuple[str, int]:
    r = _client(rc).completions.create(
        model=rc.model_name,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage is not None
    return r.choices[0].text, r.usage.completion_tokens


def _metric(port: int, name: str, stage: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + "{") and f'stage="{stage}"' in line
    )


def _node_metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def _assert_nothing_held(rc: RunningCluster) -> None:
    deadline = time.monotonic() + 10
    while True:
        state = []
        for name in ("prefill-0", "decode-0"):
            r = rc.load(name)
            state.append((name, r.num_blocks_used, r.num_held_requests, r.num_blocks_held_for_transfer))
            state += [
                (
                    f"{name}/stage{s.stage.pp_rank}",
                    s.blocks_used,
                    s.blocks_held_for_transfer,
                    s.stranded_kv_blocks,
                )
                for s in r.stages
            ]
            state.append((name, "stranded", r.stranded_kv_blocks))
        if all(all(v == 0 for v in st[1:] if isinstance(v, int)) for st in state):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV still held: {state}")
        time.sleep(0.2)


def _check_pair(rc: RunningCluster, p_pp: int, d_pp: int, expected) -> None:
    prompts, want_tokens, want_text = expected
    for name, pp in (("prefill-0", p_pp), ("decode-0", d_pp)):
        stages = rc.load(name).stages
        assert [s.stage.pp_rank for s in stages] == list(range(pp))
        assert all(s.stage.session and s.stage.pp_size == pp for s in stages), stages
        assert stages[-1].stage.layer_end == 4 and stages[0].stage.layer_start == 0
    with ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(lambda p: _complete(rc, p), prompts))
    assert [n for _, n in got] == [len(t) for t in want_tokens]
    for i, ((text, _), want) in enumerate(zip(got, want_text, strict=True)):
        at = next(
            (k for k, (a, b) in enumerate(zip(text, want, strict=False)) if a != b), min(len(text), len(want))
        )
        assert text == want, (
            f"prompt {i} ({len(prompts[i])} tokens) differs at char {at}: {text!r} vs {want!r}\n{rc.logs()}"
        )
    _assert_nothing_held(rc)
    # Every stage of both nodes moved KV (each prefill stage's layers live on some decode stage);
    # none failed.
    for name, pp in (("prefill-0", p_pp), ("decode-0", d_pp)):
        port = rc.node(name).metrics_port
        for s in range(pp):
            assert _metric(port, "pdserve:stage_kv_transfer_bytes_total", s) > 0, (name, s)
            assert _metric(port, "pdserve:stage_kv_transfer_failures_total", s) == 0, (name, s)
            assert _metric(port, "pdserve:stage_stranded_kv_blocks", s) == 0
    # freed by their consumers' reports, not by the lease
    assert _node_metric(rc.node("prefill-0").metrics_port, "pdserve:kv_leases_expired_total") == 0
    p_rep = rc.load("prefill-0")
    # each prefill stage was asked by every decode stage when the sizes differ (the pulls that
    # share no layer moved nothing and still counted: the requests were freed, not expired), by
    # the same-index decode stage when they are equal
    asks = d_pp if p_pp != d_pp else 1
    assert all(s.transfers == asks * len(prompts) for s in p_rep.stages), p_rep.stages


@pytest.fixture(scope="module")
def cluster_12(llama4, tmp_path_factory):
    """P pp=1 -> D pp=2 behind the router; the kill test below ends it (it runs last)."""
    cfg = _cluster(llama4, 1, 2, kv_lease_s=LEASE_S)
    with running_cluster(cfg, tmp_path_factory.mktemp("pp12")) as rc:
        yield rc


LEASE_S = 6.0


def test_pp1_to_pp2_greedy_equals_colocated(cluster_12, expected) -> None:
    _check_pair(cluster_12, 1, 2, expected)


# The rest of the matrix, {(1,1), (2,1), (4,2), (2,4), (2,2)} (equal sizes > 1: decode stage i
# asks prefill stage i only), takes ~20-60 s per pair on a 2-core machine: it runs with
# ``PDSERVE_PP_MATRIX=1`` (all pairs, each its own cluster). CI runs the unequal 1 -> 2 pair
# above (three stage processes; 4 -> 2 starts six); the stage pairing of every (p_pp, d_pp) is
# unit-tested in tests/kvtransfer.
PAIRS: list[tuple[int, int]] = []
if os.environ.get("PDSERVE_PP_MATRIX"):
    PAIRS = [(1, 1), (2, 1), (4, 2), (2, 4), (2, 2)]


@pytest.mark.parametrize(("p_pp", "d_pp"), PAIRS)
def test_pp_greedy_equals_colocated(p_pp, d_pp, llama4, expected, tmp_path) -> None:
    with running_cluster(_cluster(llama4, p_pp, d_pp), tmp_path / "run") as rc:
        _check_pair(rc, p_pp, d_pp, expected)


def _stage_pids(pid: int) -> list[int]:
    """The pipeline stage processes a node process spawned (its children, by parent pid)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(x) for x in f.read().split()]
    cmdlines = {}
    for c in out:
        try:
            cmdlines[c] = Path(f"/proc/{c}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
    return sorted(
        c for c, cmd in cmdlines.items() if b"multiprocessing" in cmd and b"resource_tracker" not in cmd
    )


def test_killing_a_decode_stage_fails_in_flight_and_frees_the_peer(cluster_12) -> None:
    """Runs after the greedy test on the same cluster (it takes decode-0 down for good)."""
    kill_decode_worker_and_check_peer(cluster_12, "pipeline stage 1", LEASE_S)


def kill_decode_worker_and_check_peer(rc: RunningCluster, label: str, lease: float) -> None:
    """SIGKILL decode-0's one worker process (``label``: how errors name it) with streams in
    flight: each ends with an error naming it (no hang), the node exits 1, and the prefill
    peer's hold for a decode leg that never comes is freed by its lease."""
    decode = next(c for c in rc.children if c.name == "decode-0")
    stages = _stage_pids(decode.proc.pid)
    assert len(stages) == 1, stages  # worker 0 in the node process, worker 1 spawned

    # A prefill whose decode leg never comes (decode dies first): held on the peer until the lease.
    p = rc.node("prefill-0")
    with grpc.insecure_channel(p.grpc_address) as ch:
        sp = SamplingParams(temperature=0.0, max_tokens=8)
        r = pb_grpc.PrefillServiceStub(ch).Prefill(
            pb.PrefillRequest(
                transfer_id=uuid.uuid4().hex,
                prompt_token_ids=list(range(3, 43)),
                sampling=convert.sampling_to_pb(sp),
                need_send=2,
            ),
            timeout=60,
        )
    assert r.kv_held
    assert rc.load("prefill-0").num_blocks_held_for_transfer == 3

    def long_request(i: int) -> str:
        got = 0
        try:
            stream = _client(rc).completions.create(
                model=rc.model_name,
                prompt=[5 + i] * (20 + 30 * i),
                max_tokens=1500,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                got += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    return f"finished ({chunk.choices[0].finish_reason}) after {got} chunks"
        except openai.APIError as e:
            return f"error after {got} chunks: {type(e).__name__}: {e}"
        return f"ended after {got} chunks"

    with ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(long_request, i) for i in range(4)]
        deadline = time.monotonic() + 60
        while rc.load("decode-0").num_running < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(stages[0], signal.SIGKILL)
        results = [f.result(timeout=60) for f in futs]  # no hang
    # a clear reason, and no hang (the futures' timeout above)
    assert all(r.startswith("error") and label in r for r in results), results
    assert decode.proc.wait(timeout=30) == 1  # the node took itself out of service
    log = decode.log_path.read_text(errors="replace")
    assert "out of service" in log and label in log, log[-2000:]
    # The prefill peer still serves, and holds nothing once the lease has passed.
    deadline = time.monotonic() + lease + 10
    while time.monotonic() < deadline:
        r = rc.load("prefill-0")
        if r.num_blocks_held_for_transfer == 0 and r.num_blocks_used == 0:
            break
        time.sleep(0.2)
    r = rc.load("prefill-0")
    assert (r.num_blocks_held_for_transfer, r.num_blocks_used, r.stranded_kv_blocks) == (0, 0, 0)
    assert _node_metric(p.metrics_port, "pdserve:kv_leases_expired_total") >= 1  # the lease freed it
    assert all(s.stranded_kv_blocks == 0 and s.blocks_held_for_transfer == 0 for s in r.stages)
