"""EngineWatchdog with a real EngineLoop and engine (the node's health servicer recorded), and
EngineLoop.admit's grammar gate: limits checked before the compile, a slow compile refused."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
from grpc_health.v1 import health_pb2

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import EngineWedgedError, InvalidRequestError
from services.engine_watchdog import EngineWatchdog

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class RecordedHealth:
    def __init__(self) -> None:
        self.statuses: list[Any] = []

    async def set(self, service: str, status: Any) -> None:
        assert service == ""
        self.statuses.append(status)


def test_a_step_past_step_timeout_takes_the_node_out_and_back(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["llama"], step_timeout_s=0.4)

    async def main() -> None:
        el = EngineLoop(llm.engine, asyncio.get_running_loop())
        el.start()
        health = RecordedHealth()
        dog = EngineWatchdog("n", el, 0.4, health)
        watch = asyncio.create_task(dog.run())
        try:
            deltas: list[Any] = []
            await el.admit([1, 2, 3], SamplingParams(max_tokens=2000, ignore_eos=True), "r", deltas.append)
            while not deltas:
                await asyncio.sleep(0.01)
            release = threading.Event()
            el.post(lambda e: release.wait(10))  # the engine thread is stuck in one command
            t0 = time.monotonic()
            while not dog.wedged:
                assert time.monotonic() - t0 < 2.0, "not noticed"
                await asyncio.sleep(0.02)
            assert 0.4 < time.monotonic() - t0 < 1.5 and health.statuses == [NOT_SERVING]
            last = deltas[-1]
            assert last.finish_reason == "error" and "step_timeout_s=0.4" in (last.error or ""), last
            with pytest.raises(EngineWedgedError):
                el.check_alive()
            release.set()
            while dog.wedged:
                assert time.monotonic() - t0 < 5.0, "not back"
                await asyncio.sleep(0.02)
            assert health.statuses == [NOT_SERVING, SERVING] and dog.num_wedged_total == 1
            el.check_alive()
            for _ in range(100):  # the failed stream's request was aborted once the engine ran
                if not llm.engine.has_unfinished() and llm.engine.num_used_blocks() == 0:
                    break
                await asyncio.sleep(0.02)
            assert not llm.engine.has_unfinished() and llm.engine.num_used_blocks() == 0
        finally:
            watch.cancel()
            el.stop()

    asyncio.run(main())


def test_admit_checks_the_grammar_size_first_and_refuses_a_slow_compile(tiny_models, make_llm) -> None:
    pytest.importorskip("xgrammar")
    llm = make_llm(tiny_models["llama"], max_grammar_bytes=40_000, grammar_compile_timeout_s=0.5)
    props = {f"field_{i}": {"type": "string"} for i in range(1000)}
    slow = json.dumps({"type": "object", "properties": props})  # ~33 KB, ~12 s to compile here
    big = json.dumps({"type": "object", "properties": {**props, "x" * 10_000: {"type": "string"}}})

    async def main() -> None:
        el = EngineLoop(llm.engine, asyncio.get_running_loop())
        el.start()
        try:
            with pytest.raises(InvalidRequestError, match="max_grammar_bytes"):
                await el.admit([1, 2], SamplingParams(structured=("json_schema", big)), "big", print)
            assert llm.engine.grammar_admission.service is None  # refused before any compile started
            with pytest.raises(InvalidRequestError, match=r"grammar_compile_timeout_s=0\.5"):
                await el.admit([1, 2], SamplingParams(structured=("json_schema", slow)), "slow", print)
            assert not llm.engine.has_unfinished() and not el._streams
        finally:
            el.stop()

    asyncio.run(main())
