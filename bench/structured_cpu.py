"""Grammar masking cost: decode tok/s at batch N, constrained vs unconstrained, same run.

    PYTHONPATH=$PWD .venv/bin/python bench/structured_cpu.py [--batch 16] [--tokens 64] [--reps 3]
    python3 bench/structured_cpu.py --device cuda --batch 64 [--model DIR]   # the H200 row

The name is historical: ``--device`` (default cpu) also runs it on a GPU.

One tiny random Llama (``--vocab``: the mask is a vocabulary-wide bitmask, so its cost grows
with it). Every mode samples (temperature 1, seeded, ignore_eos) so all go through the same
sampler path; modes alternate within each rep so machine load hits them alike. Prints medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.models.make_model import make_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "integer"}}},
    "required": ["items"],
}
MODES: dict[str, tuple[str, str] | None] = {
    "unconstrained": None,
    "regex [a-z ]+": ("regex", "[a-z ]+"),
    "json_schema int array": ("json_schema", json.dumps(SCHEMA)),
}


def run(
    llm: LLM,
    batch: int,
    tokens: int,
    structured: tuple[str, str] | None,
    temperature: float = 1.0,
    seeded: bool = True,
) -> tuple[float, int]:
    params = [
        SamplingParams(
            temperature=temperature,
            seed=i if seeded else None,
            max_tokens=tokens,
            ignore_eos=True,
            structured=structured,
        )
        for i in range(batch)
    ]
    t0 = time.perf_counter()
    outs = llm.generate([[5, 6, 7, 8 + i] for i in range(batch)], params)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n / dt, n


# (owner, attribute, label): the engine's functions --phases times, in the order it prints them.
# "fill" runs on the filler thread when there is one (not on the step's critical path then).
def _phase_targets() -> list[tuple[Any, str, str]]:
    from pdserve import kernels
    from pdserve.engine import bitmask_filler, grammar_masks, llm_engine, model_runner, scheduler, structured
    from pdserve.engine.output_processor import OutputProcessor

    return [
        (llm_engine.LLMEngine, "step", "whole step"),
        (scheduler.Scheduler, "schedule", "schedule"),
        (model_runner.ModelRunner, "launch", "launch (inputs, forward, logits)"),
        (model_runner.PendingStep, "result", "wait for the device (result)"),
        (scheduler.Scheduler, "update_from_output", "update_from_output"),
        (grammar_masks.GrammarMasker, "start", "grammar: advance + submit"),
        (grammar_masks, "advance", "  of it: advance (accept)"),
        (structured.SteadyRows, "take", "  of it: steady rows (bookkeeping)"),
        (grammar_masks, "_batch_accept", "  of it: accept inline (steady rows, no filler)"),
        (grammar_masks.GrammarMasker, "_host", "  of it: bitmask buffer"),
        (bitmask_filler.BitmaskFiller, "submit", "  of it: submit to the filler"),
        (OutputProcessor, "process", "detokenize, deltas (OutputProcessor.process)"),
        (grammar_masks.GrammarMasker, "wait", "grammar: wait for the fill (+accept)"),
        (grammar_masks.GrammarMasker, "_on_device", "grammar: bitmask to the kernel (in place / copy)"),
        (kernels, "apply_token_bitmask_", "grammar: mask kernel (sampled rows)"),
        (kernels, "masked_argmax_rows", "grammar: masked argmax kernel (greedy)"),
        (kernels, "argmax_rows", "argmax kernel (unconstrained greedy)"),
        (model_runner.ModelRunner, "sample_deferred", "sampler launch (sample_deferred)"),
        (structured, "_batch_accept", "accept (filler thread if on)"),
        (bitmask_filler, "_batch_accept", "accept (filler thread if on)"),  # its own import
        (structured, "fill_bitmask", "fill (xgrammar; filler thread if on)"),
        (bitmask_filler, "fill_bitmask", "fill (xgrammar; filler thread if on)"),  # its own import
        (grammar_masks, "fill_bitmask", "fill (xgrammar; filler thread if on)"),  # its own import
    ]


def _labels() -> list[str]:
    return list(dict.fromkeys(label for _, _, label in _phase_targets()))


class PhaseTimers:
    """Wraps the engine's functions with wall-clock accumulators (--phases): host time per step of
    each phase. The timers cost every mode alike (a few hundred ns per call)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def install(self) -> None:
        for owner, attr, label in _phase_targets():
            setattr(owner, attr, self._wrap(getattr(owner, attr), label))

    def _wrap(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        clock = time.perf_counter

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = clock()
            try:
                return fn(*a, **kw)
            finally:
                dt = clock() - t0
                with self._lock:
                    self.total[label] += dt
                    self.calls[label] += 1

        return timed

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, float]:
        """µs per engine step of each phase since reset()."""
        steps = max(1, self.calls.get("whole step", 0))
        return {label: self.total.get(label, 0.0) * 1e6 / steps for label in _labels()}


def print_phases(per_mode: dict[str, list[dict[str, float]]], steps: dict[str, int]) -> None:
    names = list(per_mode)
    print("\nhost µs per engine step (median over reps; --phases timers on)")
    print(f"{'phase':<40}" + "".join(f"{n.split()[0][:12]:>14}" for n in names))
    for label in _labels():
        row = [statistics.median(r[label] for r in per_mode[n]) for n in names]
        print(f"{label:<40}" + "".join(f"{v:>14.1f}" for v in row))
    print(f"{'steps per rep':<40}" + "".join(f"{steps[n]:>14}" for n in names))


def model_vocab(model_dir: str) -> int:
    with open(f"{model_dir}/config.json") as f:
        return int(json.load(f)["vocab_size"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        default="auto",
        help="the engine's asynchronous scheduling (auto: on for CUDA, off on CPU)",
    )
    ap.add_argument(
        "--model", default=None, help="a checkpoint folder instead of the tiny model (--vocab ignored)"
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="every mode's temperature (0: greedy, the argmax path; default 1: the sampler)",
    )
    ap.add_argument(
        "--no-seed",
        action="store_true",
        help="sampled rows draw from the shared generator, not one per request",
    )
    ap.add_argument(
        "--modes",
        nargs="+",
        choices=("unconstrained", "regex", "json"),
        default=("unconstrained", "regex", "json"),
        help="which modes to run (e.g. one at a time under a profiler)",
    )
    ap.add_argument(
        "--grammar-thread",
        choices=("auto", "on", "off"),
        default="auto",
        help="bitmask fills on the runner's filler thread (auto: on CUDA hosts of 4+ cores)",
    )
    ap.add_argument(
        "--xgrammar-threads",
        type=int,
        default=None,
        help="threads of xgrammar's batched fill (default: the engine's choice, a quarter of the cores, at most 4)",
    )
    ap.add_argument(
        "--switch-interval-us",
        type=float,
        default=None,
        help="the interpreter's switch interval while the filler thread fills a bitmask (default: "
        "the engine's, 50 us); each hand-off with the filler waits up to this long for the GIL",
    )
    ap.add_argument(
        "--phases",
        action="store_true",
        help="also time the engine's phases (host µs per step, per mode); slows every mode a little",
    )
    args = ap.parse_args()
    if args.xgrammar_threads is not None:
        import functools

        import xgrammar as xgr

        from pdserve.engine import structured

        n = args.xgrammar_threads
        structured._batch_matcher = functools.lru_cache(maxsize=1)(
            lambda: xgr.BatchGrammarMatcher(max_threads=n)
        )
    picked = {k: v for k, v in MODES.items() if k.split()[0].replace("json_schema", "json") in args.modes}
    with tempfile.TemporaryDirectory() as d:
        if args.model:
            path = args.model
            args.vocab = model_vocab(path)
        else:
            path = make_tiny_model("llama", d, hidden_size=128, head_dim=32, vocab_size=args.vocab)
        asy = {"auto": None, "on": True, "off": False}[args.async_scheduling]
        llm = LLM(str(path), max_model_len=512, device=args.device, async_scheduling=asy)
        if args.grammar_thread != "auto":
            llm.engine.runner.grammar.use_filler = args.grammar_thread == "on"
        if args.switch_interval_us is not None:
            llm.engine.runner.grammar.filler_switch_interval_s = args.switch_interval_us * 1e-6
        kw = {"temperature": args.temperature, "seeded": not args.no_seed}
        for mode in picked.values():  # warm-up: grammar compile, first allocations
            run(llm, 2, 4, mode, **kw)
        results: dict[str, list[float]] = {m: [] for m in picked}
        counts: dict[str, int] = {}
        timers = PhaseTimers() if args.phases else None
        if timers is not None:
            timers.install()
        phases: dict[str, list[dict[str, float]]] = {m: [] for m in picked}
        steps: dict[str, int] = {}
        for rep in range(args.reps):
            # ABC then CBA: a drift of the host's speed inside a repetition hits every mode alike
            order = list(picked.items()) if rep % 2 == 0 else list(reversed(picked.items()))
            for name, mode in order:
                if timers is not None:
                    timers.reset()
                tps, n = run(llm, args.batch, args.tokens, mode, **kw)
                results[name].append(tps)
                counts[name] = n
                if timers is not None:
                    phases[name].append(timers.snapshot())
                    steps[name] = timers.calls.get("whole step", 0)
    base = statistics.median(next(iter(results.values())))
    where = str(llm.engine.runner.device)
    if llm.engine.runner.device.type == "cuda":
        import torch

        where += f" ({torch.cuda.get_device_name()}, {llm.engine.runner.dtype})"
    print(
        f"\nbatch {args.batch}, {args.tokens} tokens each, vocab {args.vocab}, {args.reps} reps (median), {where}, "
        f"async scheduling {'on' if llm.engine.async_scheduling else 'off'}, "
        f"grammar thread {'on' if llm.engine.runner.grammar.use_filler else 'off'}, temperature {args.temperature}"
        f"{'' if args.xgrammar_threads is None else f', xgrammar threads {args.xgrammar_threads}'}"
        f"{'' if args.switch_interval_us is None else f', switch interval {args.switch_interval_us:g} us'}"
        f"{'' if args.temperature == 0 else ', unseeded' if args.no_seed else ', seeded per request'}"
    )
    # Paired: each repetition's rate against the first mode's in the same repetition (seconds
    # apart), median and range over the repetitions. On a host whose speed moves between runs
    # (the GPU machines' hosts: docs/benchmarks.md) the ratio of the medians moves with it.
    first = next(iter(results.values()))
    print(
        f"{'mode':<24} {'tok/s':>9} {'vs ' + next(iter(results)):>17} {'paired':>8} "
        f"{'paired range':>17} {'tokens':>7}"
    )
    for name, xs in results.items():
        m = statistics.median(xs)
        paired = [x / b - 1 for x, b in zip(xs, first, strict=True)]
        print(
            f"{name:<24} {m:>9.1f} {m / base - 1:>+16.1%} {statistics.median(paired):>+8.1%} "
            f"{min(paired):>+8.1%}..{max(paired):>+6.1%} {counts[name]:>7}"
        )
    if args.phases:
        print_phases(phases, steps)


if __name__ == "__main__":
    main()
