"""Decode tok/s of greedy, sampled and seeded rows on a GPU, paired in one run.

    PYTHONPATH=. python3 bench/gpu_sampling.py --out DIR [--batch 64] [--reps 3]

Llama-1B shape in bf16 (bench/gpu_decode.py's model), CUDA graphs, asynchronous scheduling;
``--batch`` requests of 512 prompt tokens each decode ``--new-tokens`` tokens. Modes:

    greedy          temperature 0
    sampled         temperature 1, no seed (one Exp(1) draw over the batch)
    seeded          temperature 1, a seed per request: the counter-based draws, one launch
                    for all seeded rows (kernels/triton_seeded_draw.py)
    seeded-gen      the same requests with a torch.Generator per request (one draw call per
                    seeded row): the path CPU engines take
    sampled-unfused, seeded-unfused
                    sampled / seeded with the one-pass race off (``Sampler.fused = False``, what
                    PDSERVE_FUSED_SAMPLING=0 sets): gather, divide, draw, clamp, log, subtract,
                    argmax and scatter as separate full-vocabulary passes; sampled and seeded
                    run the one-pass race (kernels/triton_sample.py)

Before the engine runs, the sampler alone on [batch, 128,256] bf16 logits (``sampler_us``: median
device time per call, unstaged copies): greedy's argmax, each sampled mode fused and not
after the runner's fp32 upcast, and fused on the bf16 logits themselves.

Each repetition runs the modes in order, then the next in reverse (ABC / CBA), on one engine;
the decode window is timed from the step that brought every request its first token to the
last token. Prints each mode's median tok/s and its per-repetition ratio to greedy; writes
DIR/gpu_sampling.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_decode import MAX_MODEL_LEN, build_model, make_prompts, median_ms  # noqa: E402

from pdserve import kernels  # noqa: E402
from pdserve.config.engine import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.sampler import Sampler, SamplerInput  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402

MODES = ("greedy", "sampled", "seeded", "sampled-unfused", "seeded-unfused", "seeded-gen")
VOCAB = 128_256


def _params(mode: str, i: int, new_tokens: int) -> SamplingParams:
    if mode == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    seed = None if mode.startswith("sampled") else 1000 + i
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=new_tokens, ignore_eos=True)


def decode_tok_s(engine: LLMEngine, mode: str, prompts: list[list[int]], new_tokens: int, tag: str) -> float:
    engine.runner.seeds.counter_draws = mode != "seeded-gen" and engine.runner.device.type == "cuda"  # type: ignore[union-attr]
    engine.runner.sampler.fused = not mode.endswith("-unfused")  # type: ignore[union-attr]
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    for i, (rid, p) in enumerate(zip(rids, prompts, strict=True)):
        engine.add_request(p, _params(mode, i, new_tokens), rid)
    started: set[str] = set()
    t_open = None
    count = 0
    while engine.has_unfinished():
        deltas = engine.step()
        now = time.perf_counter()
        if t_open is not None:
            count += sum(len(d.token_ids) for d in deltas)
        started.update(d.request_id for d in deltas if d.token_ids)
        if t_open is None and len(started) == len(rids):
            t_open = now
    assert t_open is not None
    return count / (time.perf_counter() - t_open)


def sampler_us(batch: int) -> dict[str, float]:
    """Median microseconds per call (``triton.testing.do_bench``: device time from events, L2
    flushed between calls) on [batch, VOCAB] bf16 logits as the model gives
    them: greedy is ``argmax_rows`` of the bf16 logits; sampled / seeded widen them to fp32 (the
    runner's upcast) and call ``Sampler.sample`` fused or unfused; ``-bf16`` hands the fused
    sampler the bf16 logits (rows ``one_pass_only`` serves: no widened copy)."""
    logits = (torch.randn(batch, VOCAB, device="cuda") * 4).to(torch.bfloat16)
    calls: dict[str, Callable[[], object]] = {"greedy": lambda: kernels.argmax_rows(logits)}
    for mode in ("sampled", "seeded"):
        inputs = [
            SamplerInput(
                _params(mode, i, 1), [], [], None, frozenset(), (1000 + i, 5) if mode == "seeded" else None
            )
            for i in range(batch)
        ]
        fused, unfused = Sampler(fused=True), Sampler(fused=False)
        calls[mode] = functools.partial(lambda s, inp: s.sample(logits.float(), inp), fused, inputs)
        calls[f"{mode}-unfused"] = functools.partial(
            lambda s, inp: s.sample(logits.float(), inp), unfused, inputs
        )
        calls[f"{mode}-bf16"] = functools.partial(lambda s, inp: s.sample(logits, inp), fused, inputs)
    return {name: 1e3 * median_ms(call) for name, call in calls.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/pdserve-llama1b-random"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sampler_times = sampler_us(args.batch)
    print(
        f"sampler alone, [{args.batch}, {VOCAB}] bf16 logits: "
        + ", ".join(f"{m} {us:,.0f} us" for m, us in sampler_times.items()),
        flush=True,
    )
    build_model(args.model_dir)
    engine = LLMEngine(
        EngineConfig(
            model=str(args.model_dir),
            dtype="bfloat16",
            device="cuda",
            max_model_len=MAX_MODEL_LEN,
            cache=CacheConfig(block_size=16, kv_cache_memory_bytes=4 << 30, enable_prefix_caching=False),
            scheduler=SchedulerConfig(
                max_num_seqs=args.batch, max_num_batched_tokens=args.batch * args.prompt_len
            ),
        ),
        load_tokenizer_=False,
    )
    # warm-up at the measured shapes: graphs captured, kernels compiled for these prompt lengths
    # (a warm-up with short prompts left the first repetition's sampled modes at ~0.7 of greedy)
    for mode in MODES:
        decode_tok_s(engine, mode, make_prompts(args.batch, args.prompt_len, seed=99), 16, f"warm-{mode}")
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        order = MODES if rep % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            prompts = make_prompts(args.batch, args.prompt_len, seed=rep)
            runs[mode].append(decode_tok_s(engine, mode, prompts, args.new_tokens, f"r{rep}-{mode}"))
        print(f"rep {rep}: " + ", ".join(f"{m} {runs[m][-1]:,.0f}" for m in MODES), flush=True)
    print(f"\nbatch {args.batch}, {args.new_tokens} new tokens, {torch.cuda.get_device_name()}")
    print("| mode | tok/s (median) | ÷ greedy per repetition |")
    print("|---|---|---|")
    table = {}
    for mode in MODES:
        ratios = [a / g for a, g in zip(runs[mode], runs["greedy"], strict=True)]
        table[mode] = {"tok_s": runs[mode], "ratio_to_greedy": ratios}
        print(f"| {mode} | {statistics.median(runs[mode]):,.0f} | {' / '.join(f'{r:.2f}' for r in ratios)} |")
    (args.out / "gpu_sampling.json").write_text(
        json.dumps({"batch": args.batch, "modes": table, "sampler_us": sampler_times}, indent=1)
    )


if __name__ == "__main__":
    main()
