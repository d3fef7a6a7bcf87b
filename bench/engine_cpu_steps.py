"""pdserve's CPU engine on a real checkpoint, in-process: decode steps at fixed batch sizes, a
long prefill, an operator profile of each, and this CPU's roofline, in one run.

    .venv/bin/python bench/engine_cpu_steps.py --model-dir DIR [--dtype bfloat16]
        [--batches 1 4 16 64] [--context-len 128] [--steps 16] [--reps 3] [--prefill-len 512]
        [--threads 1] [--profile] [--ab | --ab-attention] [--out bench/results/engine_cpu_steps.json]

- Decode: ``B`` requests of ``--context-len`` random prompt tokens are prefilled, then
  ``--steps`` engine steps of ``B`` decode tokens each are timed (``LLMEngine.step``: schedule,
  forward, logits, greedy sampling, detokenizer). tok/s = B / median step time. Wall time, and
  the process's CPU time per step (``time.thread_time``: on a shared host it leaves out the time
  other processes held the core; with one torch thread it is the step's cost).
- Prefill: one request of ``--prefill-len`` tokens, ``max_tokens=1``, one step.
- ``--ab``: the same engine and requests on the routes before the packed GEMM (``old``: the
  ``Linear`` layers' packed bf16 weights detached, the native decode attention's cap as before)
  and on the current ones (``new``), alternating per repetition (the decode cases' prefills run
  ``new``); the table gives the median of the per-repetition ratios. ``--ab-attention``: the
  same pairing with ``old`` = the current routes but the native attention's scalar loop
  (``cpu_native_attention.attention_simd(False)``) instead of its AVX2 kernel.
- ``--profile``: ``torch.profiler`` over a few steps of each case; the top operators by self
  CPU time go to the JSON and the log, first the share outside torch operators (the native
  kernels, which the profiler does not see, and Python).
- Roofline: copy bandwidth (a 256 MiB tensor copied: read + write bytes / time), fp32 and bf16
  ``torch.mm`` of 2048^3 and ``kernels.cpu_gemm`` at 512 x 576 x 3072, all on the torch threads.

Model weights: the decode step of a model of P weight bytes reads at least P bytes (bound by
bandwidth) and does 2 x params x B FLOPs (bound by the GEMM rate); the log prints both bounds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import loadavg, log  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "results" / "engine_cpu_steps.json"


def make_engine(model_dir: Path, dtype: str, threads: int, kv_bytes: int, max_seqs: int, max_tokens: int):
    from pdserve.config.engine import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        model=str(model_dir),
        dtype=dtype,
        device="cpu",
        cpu_threads=threads,
        max_model_len=max_tokens,
        cache=CacheConfig(kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max(2048, max_tokens)),
    )
    return LLMEngine(cfg)


class Routes:
    """Switches an engine between its CPU bf16 routes (``new``) and the ones before the packed
    GEMM (``old``: the Linear layers' packed copies detached, the native attention's decode cap
    back at MAX_ATTENTION_SCORES) between steps; with ``attention_only``, ``old`` is the current
    routes with the native attention's scalar loop instead of its AVX2 kernel."""

    def __init__(self, engine, attention_only: bool = False) -> None:
        self.attention_only = attention_only
        from pdserve.models.linear import Linear

        self.layers = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
        self.packed = [m.weight_packed for m in self.layers]
        from pdserve.kernels import cpu_native_attention

        self.decode_cap = cpu_native_attention.MAX_DECODE_SCORES_NO_BF16_HW

    def set(self, name: str) -> None:
        from pdserve.kernels import cpu_native_attention

        if self.attention_only:
            cpu_native_attention.attention_simd(name == "new")
            return
        for m, p in zip(self.layers, self.packed, strict=True):
            m.weight_packed = p if name == "new" else None
        # the native decode attention's cap on such a host (score_cap): the old one for "old"
        cpu_native_attention.MAX_DECODE_SCORES_NO_BF16_HW = (
            self.decode_cap if name == "new" else cpu_native_attention.MAX_ATTENTION_SCORES
        )


def prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


class DecodeCase:
    """B requests in steady decode on one engine; ``time(steps)`` -> per-step wall / CPU s."""

    def __init__(self, engine, batch: int, context_len: int, max_tokens: int, vocab: int, tag: str) -> None:
        from pdserve.engine.sampling_params import SamplingParams

        self.engine = engine
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        rng = random.Random(batch)
        self.ids = [f"{tag}-b{batch}-{i}" for i in range(batch)]
        for rid, p in zip(self.ids, prompts(batch, context_len, vocab, rng), strict=True):
            engine.add_request(p, params, rid)
        started: set[str] = set()
        while len(started) < batch:  # prefill (chunked) until every request has its first token
            started.update(d.request_id for d in engine.step() if d.token_ids)

    def time(self, steps: int) -> tuple[list[float], list[float]]:
        wall, cpu = [], []
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            self.engine.step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        return wall, cpu

    def finish(self) -> None:
        self.engine.abort(self.ids)
        while self.engine.has_unfinished():
            self.engine.step()


def prefill_once(engine, length: int, vocab: int, seed: int) -> tuple[float, float]:
    from pdserve.engine.sampling_params import SamplingParams

    (p,) = prompts(1, length, vocab, random.Random(seed))
    engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), f"prefill-{seed}")
    t0, c0 = time.perf_counter(), time.thread_time()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0, time.thread_time() - c0


def profile_ops(fn, top: int = 12) -> list[dict]:
    """Top operators by self CPU time while ``fn`` runs."""
    from torch.profiler import ProfilerActivity, profile

    c0 = time.thread_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    cpu_us = 1e6 * (time.thread_time() - c0)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    in_ops = sum(e.self_cpu_time_total for e in events)
    total = max(cpu_us, in_ops, 1.0)
    outside = {
        "op": "(outside torch ops: native kernels, Python, profiler)",
        "calls": 1,
        "self_ms": round((total - in_ops) / 1000, 2),
        "self_pct": round(100 * (total - in_ops) / total, 1),
        "us_per_call": round(total - in_ops, 1),
    }
    return [outside] + [
        {
            "op": e.key,
            "calls": e.count,
            "self_ms": round(e.self_cpu_time_total / 1000, 2),
            "self_pct": round(100 * e.self_cpu_time_total / total, 1),
            "us_per_call": round(e.self_cpu_time_total / max(e.count, 1), 1),
        }
        for e in events[:top]
    ]


def roofline() -> dict[str, float]:
    """Copy bandwidth and GEMM rates (best of a few, CPU time of this thread: one torch thread)."""
    import torch

    from pdserve.kernels import cpu_gemm

    def best(fn, reps: int = 5) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.thread_time()
            fn()
            ts.append(time.thread_time() - t0)
        return min(ts)

    src = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB
    dst = torch.empty_like(src)
    t = best(lambda: dst.copy_(src))
    out = {"copy_gb_s": round(2 * src.numel() * 4 / t / 1e9, 2)}
    # torch's bf16 mm on a CPU without bf16 hardware is a generic loop (~1 GFLOP/s): a smaller
    # product keeps it to seconds.
    for dt, name, n in ((torch.float32, "mm_fp32_gflop_s", 2048), (torch.bfloat16, "mm_bf16_gflop_s", 512)):
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        out[name] = round(2 * n**3 / best(lambda a=a, b=b: torch.mm(a, b), 2) / 1e9, 1)
    w = torch.randn(3072, 576).bfloat16()
    packed = cpu_gemm.pack(w)
    if packed is not None:
        x = torch.randn(512, 576).bfloat16()
        out["cpu_gemm_bf16w_gflop_s"] = round(
            2 * 512 * 576 * 3072 / best(lambda: cpu_gemm.linear(x, packed, None)) / 1e9, 1
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--context-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-mib", type=int, default=512, help="KV cache")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ab", action="store_true", help="also the route before the packed weights, interleaved")
    ap.add_argument(
        "--ab-attention", action="store_true", help="--ab with old = the native attention's scalar loop"
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    if args.ab and args.ab_attention:
        ap.error("--ab and --ab-attention are two different pairings: give one")

    import torch

    from pdserve.models.config import ModelArchConfig

    torch.set_num_threads(args.threads)
    vocab = ModelArchConfig.from_model_dir(args.model_dir).vocab_size
    max_len = max(args.context_len + (args.steps + 3) * args.reps * 2 + 64, args.prefill_len + 8)
    t0 = time.monotonic()
    engine = make_engine(
        args.model_dir, args.dtype, args.threads, args.kv_mib << 20, max(args.batches), max_len
    )
    startup_s = time.monotonic() - t0
    routes = Routes(engine, attention_only=args.ab_attention)
    args.ab = args.ab or args.ab_attention
    names = ["new", "old"] if args.ab else ["new"]
    model = engine.runner.model
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log(
        f"model {args.model_dir}: {params / 1e6:.1f} M parameters, {weight_bytes / 1e6:.0f} MB, "
        f"{sum(p is not None for p in routes.packed)}/{len(routes.layers)} Linear layers packed, "
        f"start-up {startup_s:.1f} s, threads {torch.get_num_threads()}, load {loadavg()}"
    )
    result: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "params": params,
        "weight_bytes": weight_bytes,
        "startup_s": round(startup_s, 1),
        "loadavg_start": loadavg(),
        "roofline": roofline(),
    }
    roof = result["roofline"]
    log(f"roofline: {roof}")
    gemm_rate = roof.get("cpu_gemm_bf16w_gflop_s", roof["mm_bf16_gflop_s"])

    decode: dict[int, dict] = {}
    for b in args.batches:
        routes.set("new")
        case = DecodeCase(engine, b, args.context_len, max_len - args.context_len - 8, vocab, "d")
        log(f"decode B={b}: prefilled, load {loadavg()}")
        per: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in names}
        ratios: dict[str, list[float]] = {"wall": [], "cpu": []}
        for rep in range(args.reps):
            med: dict[str, tuple[float, float]] = {}
            for name in names if rep % 2 == 0 else names[::-1]:
                routes.set(name)
                wall, cpu = case.time(args.steps)
                per[name]["wall"] += wall
                per[name]["cpu"] += cpu
                med[name] = (statistics.median(wall), statistics.median(cpu))
            if args.ab:
                ratios["wall"].append(med["old"][0] / med["new"][0])
                ratios["cpu"].append(med["old"][1] / med["new"][1])
        row: dict[str, Any] = {}
        for name in names:
            w, c = statistics.median(per[name]["wall"]), statistics.median(per[name]["cpu"])
            row[name] = {
                "step_wall_ms": round(1000 * w, 2),
                "step_cpu_ms": round(1000 * c, 2),
                "tok_s_wall": round(b / w, 1),
                "tok_s_cpu": round(b / c, 1),
            }
        if args.ab:
            row["speedup_wall_median"] = round(statistics.median(ratios["wall"]), 2)
            row["speedup_cpu_median"] = round(statistics.median(ratios["cpu"]), 2)
        row["gemm_bound_ms"] = round(1000 * 2 * params * b / (gemm_rate * 1e9), 2)
        row["bandwidth_bound_ms"] = round(1000 * weight_bytes / (roof["copy_gb_s"] * 1e9), 2)
        bound_ms = max(row["gemm_bound_ms"], row["bandwidth_bound_ms"])
        row["fraction_of_roofline"] = round(bound_ms / row["new"]["step_cpu_ms"], 2)
        if args.profile:
            row["profile"] = {}
            for name in names:
                routes.set(name)
                row["profile"][name] = profile_ops(lambda c=case: c.time(3))
        routes.set("new")
        case.finish()
        decode[b] = row
        log(f"decode B={b}: " + json.dumps({k: v for k, v in row.items() if k != "profile"}))
        for name, ops in row.get("profile", {}).items():
            log(f"  profile {name} B={b} (3 steps): " + _ops_line(ops))
    result["decode"] = decode

    pre: dict[str, Any] = {}
    for name in names:
        routes.set(name)
        runs = [prefill_once(engine, args.prefill_len, vocab, seed=100 + i) for i in range(2)]
        w, c = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        pre[name] = {
            "wall_ms": round(1000 * w, 1),
            "cpu_ms": round(1000 * c, 1),
            "tok_s_cpu": round(args.prefill_len / c, 1),
        }
        if args.profile:
            pre[name]["profile"] = profile_ops(
                lambda: prefill_once(engine, args.prefill_len, vocab, seed=999)
            )
        log(
            f"prefill {args.prefill_len} {name}: "
            + json.dumps({k: v for k, v in pre[name].items() if k != "profile"})
        )
        if args.profile:
            log("  profile: " + _ops_line(pre[name]["profile"]))
    routes.set("new")
    result["prefill"] = pre
    result["loadavg_end"] = loadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {args.out}")


def _ops_line(ops: list[dict]) -> str:
    return "; ".join(f"{o['op']} {o['self_pct']}% {o['calls']}x {o['us_per_call']}us" for o in ops[:8])


if __name__ == "__main__":
    main()
