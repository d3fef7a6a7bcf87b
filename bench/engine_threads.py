"""What the node's process shape costs the engine, in-process on CPU: one table, variants interleaved.

    .venv/bin/python bench/engine_threads.py [--reps 5] [--concurrency 16] [--requests 128]
        [--busy-us 0 100 300] [--attention both|sdpa|eager]

The same requests (tiny Llama of bench/served.py, bf16, 48-token prompts, 64 tokens, greedy,
``ignore_eos``, one torch thread) run

  plain         a step loop on the main thread (bench/served.py's in-process baseline);
  engine-loop   ``EngineLoop``: the engine on its own thread, deltas to asyncio consumers on the
                main thread (a node without gRPC);
  +busy N us    the same, with the event loop also running N us of Python every millisecond
                (stand-in for the gRPC front end's work on the node's one GIL).

With ``--attention both`` the plain variant also runs with the CPU bf16 decode attention forced
to SDPA (``EAGER_BF16_MIN_ROWS`` huge) against the default (transformers' eager form), at
concurrency 1, 16 and 64. Output tok/s, median of the repetitions; the host's noise shows as
the spread (min-max) column. See docs/benchmarks.md, "CPU threads".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import served  # noqa: E402
from bench._common import loadavg, log  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--busy-us", nargs="+", type=int, default=[0, 100, 300])
    ap.add_argument("--attention", choices=["both", "sdpa", "eager"], default="both")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from pdserve.engine.engine_loop import EngineLoop
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.models import attention_torch

    eargs = argparse.Namespace(
        prompt_tokens=48,
        max_tokens=64,
        ignore_eos=True,
        kv_bytes=256 << 20,
        max_num_seqs=256,
        max_batched=4096,
        dtype="bfloat16",
        device="cpu",
    )
    model = served.build_model("tiny", "bfloat16")
    engine = LLMEngine(served.engine_config(eargs, model))
    prompts = served.make_prompts(args.requests, 48, served.model_vocab(model), seed=16)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    default_rows = attention_torch.EAGER_BF16_MIN_ROWS

    def plain(level: int, n: int) -> float:
        return float(served.inprocess_level(engine, prompts[:n], eargs, level)["output_tok_s"])

    async def looped(level: int, busy_us: int) -> float:
        el = EngineLoop(engine, asyncio.get_running_loop())
        el.start()
        stop = False

        async def busy() -> None:
            while not stop:
                t = time.perf_counter()
                while time.perf_counter() - t < busy_us * 1e-6:
                    pass
                await asyncio.sleep(0.001)

        bt = asyncio.create_task(busy()) if busy_us else None
        sem = asyncio.Semaphore(level)
        toks = 0

        async def one(i: int) -> None:
            nonlocal toks
            async with sem:
                async for d in el.generate(prompts[i], params, f"t{i}-{time.monotonic_ns()}"):
                    toks += len(d.token_ids)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        dt = time.perf_counter() - t0
        stop = True
        if bt is not None:
            await bt
        el.stop()
        return toks / dt

    variants: dict[str, object] = {}
    c = args.concurrency
    variants[f"plain c={c}"] = lambda: plain(c, len(prompts))
    for b in args.busy_us:
        name = f"engine-loop c={c}" + (f" +busy {b} us/ms" if b else "")
        variants[name] = lambda b=b: asyncio.run(looped(c, b))
    if args.attention != "eager":
        for lv in (1, 16, 64):
            n = max(8, min(len(prompts), 3 * lv))
            for mode, rows in (("sdpa", 10**9), ("eager", default_rows)):
                if args.attention == "sdpa" and mode == "eager":
                    continue

                def run(lv: int = lv, n: int = n, rows: int = rows) -> float:
                    attention_torch.EAGER_BF16_MIN_ROWS = rows
                    try:
                        return plain(lv, n)
                    finally:
                        attention_torch.EAGER_BF16_MIN_ROWS = default_rows

                variants[f"plain c={lv} attention {mode}"] = run
    plain(c, min(len(prompts), 2 * c))  # warm-up
    log(f"load average before: {loadavg()}")
    res: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(args.reps):
        for name, fn in variants.items():
            res[name].append(fn())  # type: ignore[operator]
        log(f"rep {rep} done")
    print(f"\n{'variant':<40} {'tok/s':>8} {'min-max':>15}")
    for name, xs in res.items():
        print(f"{name:<40} {statistics.median(xs):>8.0f} {min(xs):>7.0f}-{max(xs):<7.0f}")
    log(f"load average after: {loadavg()}")


if __name__ == "__main__":
    main()
