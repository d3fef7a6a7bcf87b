"""A blocking client of a node's Steps socket (services/steps_socket.py) for the e2e tests, and
a /metrics reader: the router's side is services/router/step_mux.py."""

from __future__ import annotations

import re
import socket

import httpx

from pdserve.engine.sampling_params import SamplingParams
from pdserve.rpc import convert
from pdserve.rpc import node_pb2 as pb


def metric(url: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", httpx.get(url).text, re.M)
    assert m, f"{name} not in {url}"
    return float(m.group(1))


class RawSteps:
    """One Steps stream: the hello on connect (``welcome`` is the node's answer), then frames."""

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

    def batch(self) -> pb.StepBatch:
        data = self.recv()
        assert data is not None, "the node closed the Steps stream"
        return pb.StepBatch.FromString(data)

    def close(self) -> None:
        self.sock.close()


def decode_req(
    rid: str, max_tokens: int, flush_ms: int = 0, temperature: float = 0.0, prompt: list[int] | None = None
) -> pb.DecodeRequest:
    s = convert.sampling_to_pb(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    s.temperature = temperature  # unchecked here: the node validates (-1 is refused)
    return pb.DecodeRequest(
        request_id=rid, prompt_token_ids=prompt or [9, 8, 7], sampling=s, flush_interval_ms=flush_ms
    )


def run_to_end(raw: RawSteps, reqs: list[pb.DecodeRequest]) -> dict[str, list[list[int]]]:
    """Start ``reqs`` on the stream; per request, the token ids of each batch that had some."""
    raw.send(pb.StepCommand(start=reqs).SerializeToString())
    out: dict[str, list[list[int]]] = {r.request_id: [] for r in reqs}
    left = set(out)
    while left:
        batch = raw.batch()
        assert not batch.ends and not batch.HasField("stream_end"), str(batch)
        for d in batch.deltas:
            if d.token_ids:
                out[d.request_id].append(list(d.token_ids))
            if d.finish_reason:
                left.discard(d.request_id)
    return out
