"""The engine thread cannot die silently: cancelled callers, failing commands, death."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import EngineDeadError

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


async def _collect(loop: EngineLoop, ids: list[int], rid: str) -> list[int]:
    out: list[int] = []
    async for d in loop.generate(ids, GREEDY, rid):
        assert d.finish_reason != "error", d.error
        out += d.token_ids
    return out


def _block_engine_thread(loop: EngineLoop) -> threading.Event:
    """Park the engine thread inside a command until the returned event is set."""
    release = threading.Event()
    loop.post(lambda e: release.wait(10))
    return release


def test_cancelled_callers_are_no_ops_and_the_thread_lives(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["llama"])

    async def main() -> None:
        el = EngineLoop(llm.engine, asyncio.get_running_loop())
        el.start()
        try:
            release = _block_engine_thread(el)
            # Callers cancelled while their command waits in the queue (the clients that closed
            # their connection ~10 ms after sending): their futures are cancelled before the
            # engine thread runs the commands. This raised InvalidStateError and killed the thread.
            calls = [el.call(lambda e: e.num_used_blocks()) for _ in range(5)]
            gens = [asyncio.ensure_future(_collect(el, [1, 2, 3, 4, 5], f"g{i}")) for i in range(5)]
            await asyncio.sleep(0.01)
            for c in calls:
                c.cancel()
            for g in gens:
                g.cancel()
            release.set()
            await asyncio.gather(*gens, return_exceptions=True)
            # A failing fire-and-forget command is logged, not fatal.
            el.post(lambda e: 1 / 0)
            assert await _collect(el, [7, 8, 9], "after") and el.alive
            assert el._thread.is_alive()
            for _ in range(100):
                if llm.engine.num_used_blocks() == 0 and not llm.engine.has_unfinished():
                    break
                await asyncio.sleep(0.02)
            assert llm.engine.num_used_blocks() == 0 and not llm.engine.has_unfinished()
        finally:
            el.stop()

    asyncio.run(main())


def test_cancel_after_admission_aborts_the_request(tiny_models, make_llm) -> None:
    """A caller cancelled while its add_request runs must not leave the request running."""
    llm = make_llm(tiny_models["llama"])

    async def main() -> None:
        el = EngineLoop(llm.engine, asyncio.get_running_loop())
        el.start()
        try:
            entered, release = threading.Event(), threading.Event()
            real_add = llm.engine.add_request

            def slow_add(*a, **k):  # type: ignore[no-untyped-def]
                entered.set()
                release.wait(10)
                return real_add(*a, **k)

            llm.engine.add_request = slow_add  # type: ignore[method-assign]
            long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

            async def one() -> None:
                async for _ in el.generate(list(range(1, 30)), long, "cancelled"):
                    pass

            task = asyncio.ensure_future(one())
            await asyncio.to_thread(entered.wait, 10)
            task.cancel()
            release.set()
            await asyncio.gather(task, return_exceptions=True)
            llm.engine.add_request = real_add  # type: ignore[method-assign]
            await el.call(lambda e: None)  # a barrier: the add and the posted abort ran before it
            for _ in range(200):
                if not llm.engine.has_unfinished():
                    break
                await asyncio.sleep(0.02)
            assert not llm.engine.has_unfinished(), "the cancelled request kept running"
            assert llm.engine.num_aborted_total == 1
        finally:
            el.stop()

    asyncio.run(main())


def test_engine_thread_death_fails_streams_and_later_calls(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["llama"])
    deaths: list[BaseException] = []

    async def main() -> None:
        el = EngineLoop(llm.engine, asyncio.get_running_loop(), on_death=deaths.append)
        el.start()
        try:
            assert await _collect(el, [1, 2, 3], "warm")

            def broken_step() -> list:  # type: ignore[type-arg]
                raise RuntimeError("device lost")

            def broken_fail_all(message: str) -> list:  # type: ignore[type-arg]
                raise RuntimeError("cannot even clean up")

            real_step, real_fail_all = llm.engine.step, llm.engine.fail_all
            llm.engine.step = broken_step  # type: ignore[method-assign]
            llm.engine.fail_all = broken_fail_all  # type: ignore[method-assign]
            deltas = []
            async with asyncio.timeout(5):  # a dead engine thread must not hang its callers
                async for d in el.generate([1, 2, 3, 4], GREEDY, "victim"):
                    deltas.append(d)
            assert deltas[-1].finish_reason == "error" and "engine thread" in (deltas[-1].error or "")
            assert not el.alive and len(deaths) == 1
            with pytest.raises(EngineDeadError):
                await el.call(lambda e: 0)
            with pytest.raises(EngineDeadError):
                async for _ in el.generate([1], GREEDY, "late"):
                    pass
            # Clean up for the fixture's leak check (the engine itself still works).
            llm.engine.step, llm.engine.fail_all = real_step, real_fail_all  # type: ignore[method-assign]
            llm.engine.abort(["victim"])
        finally:
            el.stop()

    asyncio.run(main())
