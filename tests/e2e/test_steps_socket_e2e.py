"""The router's Steps streams on the node's Steps socket (``frontend: socket``, the default).

Real processes: the router streams to decode-0 over its TCP Steps port (no gRPC, no front-end
process on the token path) and the tokens equal the in-process engine's; non-streaming flush
intervals hold; a malformed command ends the stream with INVALID_ARGUMENT and holds nothing; a
router connection cut mid-generation aborts its requests; with a shared token, a connection
without it is refused (UNAUTHENTICATED) on the socket and on gRPC, and the router still serves.
"""

from __future__ import annotations

import socket
import struct
import time

import grpc
import httpx
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.rpc import convert
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from tests.e2e.cluster import make_cluster_config, running_cluster
from tests.e2e.test_served_e2e import _wait_free, assert_streams_equal_in_process
from tests.e2e.test_steps_frontend_e2e import _metric

pytestmark = pytest.mark.slow
TOKEN = "s3cret-steps"


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    cfg = make_cluster_config(tiny_models["llama"], router={"local_prefill_max_tokens": 16})
    with running_cluster(cfg, tmp_path_factory.mktemp("steps-socket")) as rc:
        yield rc


class _Raw:
    """A blocking Steps socket client: frames in, frames out."""

    def __init__(self, address: str, token: str = "") -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.send(pb.StepsHello(token=token).SerializeToString())
        self.welcome = pb.StepsWelcome.FromString(self.recv() or b"")

    def send(self, payload: bytes) -> None:
        self.sock.sendall(len(payload).to_bytes(4, "big") + payload)

    def _exact(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def recv(self) -> bytes | None:
        head = self._exact(4)
        return None if head is None else self._exact(int.from_bytes(head, "big"))

    def close(self) -> None:
        self.sock.close()


def _req(rid: str, max_tokens: int, flush_ms: int = 0) -> pb.DecodeRequest:
    s = convert.sampling_to_pb(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return pb.DecodeRequest(
        request_id=rid, prompt_token_ids=[9, 8, 7], sampling=s, flush_interval_ms=flush_ms
    )


def _run(raw: _Raw, reqs: list[pb.DecodeRequest]) -> dict[str, list[list[int]]]:
    """Start ``reqs`` on the stream; per request, the token ids of each batch that had some."""
    raw.send(pb.StepCommand(start=reqs).SerializeToString())
    out: dict[str, list[list[int]]] = {r.request_id: [] for r in reqs}
    left = set(out)
    while left:
        data = raw.recv()
        assert data is not None, f"the stream ended with {left} open"
        batch = pb.StepBatch.FromString(data)
        assert not batch.ends and not batch.HasField("stream_end"), str(batch)
        for d in batch.deltas:
            if d.token_ids:
                out[d.request_id].append(list(d.token_ids))
            if d.finish_reason:
                left.discard(d.request_id)
    return out


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_streams_through_the_steps_socket_equal_the_in_process_engine(cluster, tiny_models, seeded) -> None:
    d0 = cluster.node("decode-0")
    rep = cluster.load("decode-0")
    assert rep.steps_address == ""  # no gRPC front end
    port = int(rep.steps_socket.rsplit(":", 1)[1])
    assert rep.steps_socket.startswith("127.0.0.1:") and port not in (d0.grpc_port, d0.metrics_port)
    metrics = f"http://127.0.0.1:{d0.metrics_port}/metrics"
    before = _metric(metrics, "pdserve:frontend_steps_sessions_total")
    assert_streams_equal_in_process(cluster, tiny_models["llama"], seeded)
    # the router's stream is one long-lived connection: opened at most once by these requests
    assert _metric(metrics, "pdserve:frontend_steps_sessions_total") - before <= 1
    assert _metric(metrics, "pdserve:frontend_steps_sessions_total") >= 1
    log = next(c for c in cluster.children if c.name == "decode-0").log_path.read_text()
    assert "Steps socket (TCP frames" in log and "Steps front end (pid" not in log
    router = cluster.cluster.router_url + "/metrics"
    assert _metric(router, 'pdserve:router_steps_streams_opened_total{node="decode-0"}') >= 1
    _wait_free(cluster)


def test_a_flush_interval_holds_tokens_on_the_socket_and_changes_none(cluster) -> None:
    raw = _Raw(cluster.load("decode-0").steps_socket)
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
    raw = _Raw(addr)
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
    raw = _Raw(addr)  # the port still serves a well-formed stream
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
    raw = _Raw(cluster.load("decode-0").steps_socket)
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


def test_the_shared_token_guards_the_socket_and_grpc(tiny_models, tmp_path_factory) -> None:
    cfg = make_cluster_config(tiny_models["llama"])
    cfg = cfg.model_copy(update={"shared_token": TOKEN})
    with running_cluster(cfg, tmp_path_factory.mktemp("steps-token")) as rc:
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
