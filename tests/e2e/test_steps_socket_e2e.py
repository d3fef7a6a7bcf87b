"""The router's Steps streams on the node's Steps socket (services/steps_socket.py).

Real processes: the router streams to decode-0 over its TCP Steps port, one long-lived
connection (tests/e2e/test_served_e2e.py compares the tokens with the in-process engine's);
router.stream_flush_ms groups streamed tokens and changes none; non-streaming flush intervals
hold; a malformed command ends the stream with INVALID_ARGUMENT and holds nothing; a router
connection cut mid-generation aborts its requests; with a shared token, a connection without it
is refused (UNAUTHENTICATED) on the socket and on gRPC, and the router still serves. One cluster,
with a shared token, serves every test (each connection here carries it).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import grpc
import httpx
import pytest

from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from tests.e2e.cluster import make_cluster_config, running_cluster
from tests.e2e.steps_client import RawSteps as _Raw
from tests.e2e.steps_client import decode_req as _req
from tests.e2e.steps_client import metric as _metric
from tests.e2e.steps_client import run_to_end as _run
from tests.e2e.test_served_e2e import _served, _wait_free

pytestmark = pytest.mark.slow
TOKEN = "s3cret-steps"
STREAM_FLUSH_MS = 40


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    cfg = make_cluster_config(
        tiny_models["llama"],
        # stream_flush_ms: streamed tokens are held and merged too (test_stream_flush_*)
        router={"local_prefill_max_tokens": 16, "stream_flush_ms": STREAM_FLUSH_MS},
    )
    # the shared token guards the Steps socket and gRPC (test_the_shared_token_guards_*)
    cfg = cfg.model_copy(update={"shared_token": TOKEN})
    with running_cluster(cfg, tmp_path_factory.mktemp("steps-socket")) as rc:
        yield rc


def test_the_router_streams_on_one_socket_connection(cluster) -> None:
    d0 = cluster.node("decode-0")
    rep = cluster.load("decode-0")
    port = int(rep.steps_socket.rsplit(":", 1)[1])
    assert rep.steps_socket.startswith("127.0.0.1:") and port not in (d0.grpc_port, d0.metrics_port)
    metrics = f"http://127.0.0.1:{d0.metrics_port}/metrics"
    before = _metric(metrics, "pdserve:frontend_steps_sessions_total")
    bodies = [
        {"model": cluster.model_name, "prompt": p, "max_tokens": 6, "ignore_eos": True, "temperature": 0.0}
        for p in ([11, 12, 13], list(range(30, 70)))  # a local prompt and a P/D one
    ]
    for stream in (True, False):
        assert [n for _, n, _ in asyncio.run(_served(cluster, bodies, stream))] == [6, 6]
    # the router's stream is one long-lived connection: opened at most once by these requests
    assert _metric(metrics, "pdserve:frontend_steps_sessions_total") - before <= 1
    assert _metric(metrics, "pdserve:frontend_steps_sessions_total") >= 1
    log = next(c for c in cluster.children if c.name == "decode-0").log_path.read_text()
    assert f"Steps socket on {rep.steps_socket}" in log
    router = cluster.cluster.router_url + "/metrics"
    assert _metric(router, 'pdserve:router_steps_streams_opened_total{node="decode-0"}') >= 1
    _wait_free(cluster)


def test_stream_flush_groups_streamed_tokens_and_changes_none(cluster) -> None:
    """router.stream_flush_ms: a streamed answer (local prompt and P/D prompt) has the same text
    and token count as the non-streamed one, in far fewer SSE chunks than tokens."""
    n = 200
    bodies = [
        {"model": cluster.model_name, "prompt": p, "max_tokens": n, "ignore_eos": True, "temperature": 0.0}
        for p in ([11, 12, 13], list(range(30, 70)))  # under / over local_prefill_max_tokens
    ]
    streamed = asyncio.run(_served(cluster, bodies, True))
    whole = asyncio.run(_served(cluster, bodies, False))
    for (text, count, chunks), (want_text, want_count, _) in zip(streamed, whole, strict=True):
        assert (text, count) == (want_text, want_count) and count == n
        # ~n steps of a few ms each, merged per 40 ms window: a handful of chunks, not n
        assert 2 <= chunks <= n // 4, chunks
    _wait_free(cluster)


def test_a_flush_interval_holds_tokens_on_the_socket_and_changes_none(cluster) -> None:
    raw = _Raw(cluster.load("decode-0").steps_socket, TOKEN)
    try:
        assert raw.welcome.code == 0
        got = _run(raw, [_req("every-step", 200), _req("held", 200, flush_ms=150)])
    finally:
        raw.close()
    every, held = got["every-step"], got["held"]
    flat = [t for b in every for t in b]
    assert len(flat) == 200 and [t for b in held for t in b] == flat
    assert len(held[0]) == 1  # the first token is not held
    # one batch per step without a flush interval; a few per 150 ms with it (bounded against
    # the other request's batch count, not a count of its own: a slow host has more windows)
    assert len(held) <= len(every) // 2, (len(held), len(every))
    _wait_free(cluster)


def test_a_malformed_command_ends_the_stream_invalid_argument_and_holds_nothing(cluster) -> None:
    d0 = cluster.node("decode-0")
    metrics = f"http://127.0.0.1:{d0.metrics_port}/metrics"
    aborted = _metric(metrics, "pdserve:requests_aborted_total")
    addr = cluster.load("decode-0").steps_socket
    raw = _Raw(addr, TOKEN)
    try:
        raw.send(pb.StepCommand(start=[_req("long", 2000)]).SerializeToString())
        first = pb.StepBatch.FromString(raw.recv() or b"")
        assert [d.request_id for d in first.deltas] == ["long"]
        raw.send(b"\xff\xff\xff")  # not a StepCommand
        end = None
        while (data := raw.recv()) is not None:
            batch = pb.StepBatch.FromString(data)
            if batch.HasField("stream_end"):
                end = batch.stream_end
        assert end is not None and end.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "malformed StepCommand" in end.details
    finally:
        raw.close()
    _wait_free(cluster)
    assert _metric(metrics, "pdserve:requests_aborted_total") - aborted == 1  # aborted, not finished
    raw = _Raw(addr, TOKEN)  # the port still serves a well-formed stream
    try:
        assert sum(len(b) for b in _run(raw, [_req("after", 3)])["after"]) == 3
    finally:
        raw.close()
    _wait_free(cluster)


@pytest.mark.parametrize("how", ["reset", "clean close"])
def test_a_closed_connection_aborts_its_requests(cluster, how) -> None:
    """The router's connection ends (a crash resets it; a restart closes it cleanly): the node
    aborts the stream's requests at once, running or still waiting, and frees their blocks."""
    d0 = cluster.node("decode-0")
    metrics = f"http://127.0.0.1:{d0.metrics_port}/metrics"
    aborted = _metric(metrics, "pdserve:requests_aborted_total")
    raw = _Raw(cluster.load("decode-0").steps_socket, TOKEN)
    raw.send(pb.StepCommand(start=[_req("cut-1", 2000), _req("cut-2", 2000)]).SerializeToString())
    seen: set[str] = set()
    while seen != {"cut-1", "cut-2"}:
        seen.update(d.request_id for d in pb.StepBatch.FromString(raw.recv() or b"").deltas)
    assert cluster.load("decode-0").num_running == 2
    if how == "reset":  # SO_LINGER on with a zero timeout: close() sends RST
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    raw.close()
    deadline = time.monotonic() + 10
    while _metric(metrics, "pdserve:requests_aborted_total") - aborted < 2:
        assert time.monotonic() < deadline, "the closed stream's requests were not aborted"
        time.sleep(0.1)
    _wait_free(cluster)


def test_the_shared_token_guards_the_socket_and_grpc(cluster) -> None:
    rc = cluster
    d0 = rc.cluster.node("decode-0")
    with grpc.insecure_channel(d0.grpc_address) as ch:  # no token: refused
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.DecodeServiceStub(ch).GetLoad(pb.LoadRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        rep = pb_grpc.DecodeServiceStub(ch).GetLoad(
            pb.LoadRequest(), timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
    assert rep.steps_socket
    for wrong in ("", "not-it"):  # no token, a wrong one
        raw = _Raw(rep.steps_socket, wrong)
        try:
            assert raw.welcome.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
            assert "shared token" in raw.welcome.details
            assert raw.recv() is None  # and the node closed the connection
        finally:
            raw.close()
    raw = _Raw(rep.steps_socket, TOKEN)
    try:
        assert raw.welcome.code == 0
        assert sum(len(b) for b in _run(raw, [_req("tok", 4)])["tok"]) == 4
    finally:
        raw.close()
    # the router carries the token on both: an answer through it streams from decode-0
    body = {"model": rc.model_name, "prompt": [5, 6, 7], "max_tokens": 5, "ignore_eos": True}
    r = httpx.post(rc.cluster.router_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    _wait_free(rc)
