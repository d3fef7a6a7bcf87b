"""The engine thread's own writes of a Steps stream (services/steps_direct.py): frames in order
whatever the socket takes, never a blocked caller, a failed peer reported once; and EngineLoop
handing a direct stream its deltas from the engine thread (the finishing one also to the loop)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.outputs import GenerationDelta
from pdserve.engine.sampling_params import SamplingParams
from pdserve.rpc import node_pb2 as pb
from services.steps_direct import MAX_PENDING_BYTES, DirectSteps, SocketFrames


def _read_frames(sock: socket.socket, n: int, timeout_s: float = 10.0) -> list[bytes]:
    sock.settimeout(timeout_s)
    buf = bytearray()
    out: list[bytes] = []
    while len(out) < n:
        chunk = sock.recv(1 << 16)
        assert chunk, f"socket closed after {len(out)} of {n} frames"
        buf += chunk
        while len(buf) >= 4 and len(buf) >= 4 + int.from_bytes(buf[:4], "big"):
            size = int.from_bytes(buf[:4], "big")
            out.append(bytes(buf[4 : 4 + size]))
            del buf[: 4 + size]
    return out


@contextlib.contextmanager
def _frames(
    on_fail: Callable[[], None] | None = None,
    *,
    sndbuf: int | None = None,
    max_pending: int = MAX_PENDING_BYTES,
) -> Iterator[tuple[SocketFrames, socket.socket]]:
    """SocketFrames on one end of a Unix socket pair (inside a running event loop), and the peer."""
    ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if sndbuf is not None:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    frames = SocketFrames(ours.fileno(), asyncio.get_running_loop(), on_fail, max_pending)
    try:
        yield frames, peer
    finally:
        frames.close()
        ours.close()
        peer.close()


def test_frames_keep_their_order_when_the_socket_is_full_and_the_writer_never_blocks() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        payloads = [bytes([i % 251]) * (3000 + 37 * i) for i in range(200)]  # ~1 MB: far past the buffer
        took: list[float] = []
        with _frames(sndbuf=4096) as (frames, peer):

            def engine_thread() -> None:
                for p in payloads:
                    t0 = loop.time()
                    frames.write(p)
                    took.append(loop.time() - t0)

            t = threading.Thread(target=engine_thread)
            t.start()
            await asyncio.to_thread(t.join, 5.0)
            blocked = t.is_alive()  # a blocking write would wait here for the reader below
            # Nobody has read yet: the socket took what fits, the rest waits, and no write blocked.
            waiting = frames.pending_bytes
            got = await asyncio.to_thread(_read_frames, peer, len(payloads))
            assert not blocked and waiting > 0 and max(took) < 0.5
            assert got == payloads
            assert frames.pending_bytes == 0 and not frames.closed

    asyncio.run(main())


def test_a_gone_peer_closes_the_frames_and_calls_on_fail_once() -> None:
    async def main() -> None:
        failed = asyncio.Event()
        calls: list[int] = []

        def on_fail() -> None:
            calls.append(1)
            failed.set()

        with _frames(on_fail) as (frames, peer):
            peer.close()
            for _ in range(3):
                frames.write(b"x" * 100)
            await asyncio.wait_for(failed.wait(), 5)
            await asyncio.sleep(0.05)
            assert frames.closed and calls == [1] and frames.pending_bytes == 0
            frames.write(b"after")  # a no-op, not an error

    asyncio.run(main())


def test_a_peer_that_reads_nothing_fails_the_frames_past_the_limit() -> None:
    async def main() -> None:
        failed = asyncio.Event()
        with _frames(failed.set, max_pending=1 << 20) as (frames, _peer):
            for _ in range(64):
                frames.write(b"y" * 65536)  # 4 MiB to a peer that never reads
            await asyncio.wait_for(failed.wait(), 5)
            assert frames.closed and frames.pending_bytes == 0

    asyncio.run(main())


def test_direct_steps_writes_one_batch_per_call_and_leaves_errors_to_the_loop() -> None:
    async def main() -> None:
        with _frames() as (frames, peer):
            sink = DirectSteps(frames)
            a = GenerationDelta(request_id="a", token_ids=[5, 6], text="xy")
            b = GenerationDelta(request_id="b", token_ids=[7], text="z", finish_reason="stop", stop_reason=7)
            err = GenerationDelta(request_id="c", token_ids=[], text="", finish_reason="error", error="full")
            assert sink.takes(a) and sink.takes(b) and not sink.takes(err)
            # the loop still gets the finishing delta (bookkeeping) and the error (not written)
            assert sink.write([a, b, err]) == [b, err]
            (raw,) = await asyncio.to_thread(_read_frames, peer, 1)
            batch = pb.StepBatch.FromString(raw)
            assert [(d.request_id, list(d.token_ids), d.text) for d in batch.deltas] == [
                ("a", [5, 6], "xy"),
                ("b", [7], "z"),
            ]
            assert batch.deltas[1].finish_reason == "stop" and batch.deltas[1].stop_token_id == 7

    asyncio.run(main())


def test_a_held_request_is_merged_per_interval_and_flushed_before_its_end() -> None:
    def delta(rid: str, tok: int, finish: str | None = None) -> GenerationDelta:
        return GenerationDelta(request_id=rid, token_ids=[tok], text=str(tok), finish_reason=finish)

    async def main() -> None:
        with _frames() as (frames, peer):
            sink = DirectSteps(frames)
            sink.hold("n", 3600.0)  # non-streaming: first delta at once, then only with the finish
            assert sink.write([delta("n", 1), delta("s", 10)]) == []
            assert sink.write([delta("n", 2), delta("s", 11)]) == []
            assert sink.write([delta("n", 3)]) == []  # nothing due: no frame
            (done,) = sink.write([delta("n", 4, "length")])  # the merged finishing delta, for the loop
            assert (done.request_id, done.token_ids, done.finish_reason) == ("n", [2, 3, 4], "length")
            sink.hold("e", 3600.0)
            sink.write([delta("e", 7)])
            sink.write([delta("e", 8)])
            err = GenerationDelta(request_id="e", token_ids=[], text="", finish_reason="error", error="x")
            assert sink.write([err]) == [err]  # the held token 8 goes out first, the error to the loop
            raws = await asyncio.to_thread(_read_frames, peer, 5)
            got = [
                [
                    (d.request_id, list(d.token_ids), d.finish_reason)
                    for d in pb.StepBatch.FromString(r).deltas
                ]
                for r in raws
            ]
            assert got == [
                [("n", [1], ""), ("s", [10], "")],
                [("s", [11], "")],
                [("n", [2, 3, 4], "length")],
                [("e", [7], "")],
                [("e", [8], "")],
            ]
            sink.forget("n")
            sink.forget("e")
            sink.write([delta("s", 12)])  # the engine thread drops forgotten requests' state
            assert sink._intervals == {} and sink._held == {} and sink._sent_at == {}

    asyncio.run(main())


class _Recorder:
    """A DirectSink that records which thread wrote what."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, list[GenerationDelta]]] = []

    def takes(self, d: GenerationDelta) -> bool:
        return d.finish_reason != "error"

    def write(self, deltas: list[GenerationDelta]) -> list[GenerationDelta]:
        self.writes.append((threading.current_thread().name, list(deltas)))
        return [d for d in deltas if d.finish_reason is not None]


def test_engine_loop_writes_direct_streams_from_the_engine_thread(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["llama"])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3, 4], [9, 8, 7]], params)]

    async def main() -> None:
        el = EngineLoop(llm.engine, asyncio.get_running_loop())
        el.start()
        sink = _Recorder()
        seen: dict[str, list[GenerationDelta]] = {"r0": [], "r1": []}
        done = {rid: asyncio.get_running_loop().create_future() for rid in seen}

        def on_delta(d: GenerationDelta) -> None:
            seen[d.request_id].append(d)
            if d.finish_reason is not None:
                done[d.request_id].set_result(None)

        try:
            for rid, prompt in (("r0", [1, 2, 3, 4]), ("r1", [9, 8, 7])):
                await el.admit(prompt, params, rid, on_delta, direct=sink)
            await asyncio.wait_for(asyncio.gather(*done.values()), 30)
            for rid in seen:
                el.release(rid, abort=False)
        finally:
            el.stop()
        assert sink.writes and {name for name, _ in sink.writes} == {"pdserve-engine"}
        # One write per step holds every stream's delta of that step; tokens in order.
        for i, rid in enumerate(seen):
            toks = [t for _, ds in sink.writes for d in ds if d.request_id == rid for t in d.token_ids]
            assert toks == want[i]
        # The loop's consumer got only the finishing deltas (bookkeeping), not the tokens again.
        assert all(len(v) == 1 and v[0].finish_reason == "length" for v in seen.values())

    asyncio.run(main())
