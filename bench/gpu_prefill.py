"""Prefill throughput on one GPU: pdserve's engine vs transformers' forward pass, per-kernel profile.

    PYTHONPATH=. python3 bench/gpu_prefill.py --out DIR [--budgets 2048 16384 65536]
        [--triton-budgets 16384] [--runs 16384:cudnn 16384:flash] [--profile 16384:auto] [--num-prompts 32] [--prompt-len 2000] [--skip-transformers] [--skip-sweep] [--skip-profile]

Same Llama-1B-shaped random bf16 checkpoint as gpu_decode.py (``--model-dir``). Parts:
  engine     32 fresh prompts of 2,000 random tokens, ``max_tokens=1``, prefix caching off,
             through ``engine.step()`` at each token budget (``max_num_batched_tokens``; prompts
             longer than the budget's share are chunked), after a warm-up with the same shapes;
             attention as the engine picks it by default (mode ``auto``: flash / Triton, cuDNN
             off), at ``--triton-budgets`` again with the Triton kernel alone, and ``--runs
             BUDGET:MODE`` with paths forced (``MODES``; ``cudnn+flash`` was ``auto`` before the
             engine left cuDNN off).
  flops      matmuls (2 * N * K per token) + causal attention (4 * H * D * (ctx + 1) per token,
             summed over positions) + the LM head for the last token of each prompt, over the
             989 TFLOP/s bf16 dense peak (and over a cuBLAS 8192^3 bf16 GEMM measured here).
  profile    torch.profiler over one engine run at the largest budget: GPU time per kernel
             class (GEMM, attention, norms, rotary + KV store, activation, sampling, other) and
             the GPU's idle share of the wall time (host gaps).
  sweep      the prefill attention tile launch (block_q, block_n, warps, stages) for 8 prompts of
             2,000 tokens, against torch SDPA (flash) on the same data: TFLOP/s of each.
  hf         transformers' forward pass (sdpa) over the same prompts, batches of 4, prompt tok/s.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_decode import MODEL_SHAPE, build_model, log, make_prompts, median_ms
from pdserve.config.engine import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

PEAK_TFLOPS = 989.0
# auto: the engine's defaults (flash_prefill.ENABLED, cudnn_prefill.ENABLED as shipped: flash for
# steps of at most 4,096 tokens, else Triton; cuDNN off); cudnn+flash: both on, cuDNN first; cudnn,
# flash: that path alone before Triton; triton: the paged Triton kernel only
MODES = ("auto", "cudnn+flash", "cudnn", "flash", "triton")
BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048


def prefill_flops(prompt_len: int) -> float:
    s = MODEL_SHAPE
    h, hd, heads, kvh = s["hidden_size"], s["head_dim"], s["num_heads"], s["num_kv_heads"]
    per_tok = 2 * (
        h * (heads + 2 * kvh) * hd
        + heads * hd * h
        + 2 * h * s["intermediate_size"]
        + s["intermediate_size"] * h
    )
    attn = 4 * heads * hd * prompt_len * (prompt_len + 1) / 2  # QK^T and PV, causal
    return s["num_layers"] * (per_tok * prompt_len + attn) + 2 * h * s["vocab_size"]


def gemm_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = median_ms(lambda: a @ b)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def make_engine(model_dir: Path, budget: int, num_prompts: int) -> LLMEngine:
    cfg = EngineConfig(
        model=str(model_dir),
        dtype="bfloat16",
        device="cuda",
        max_model_len=MAX_MODEL_LEN,
        cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_bytes=8 << 30, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=num_prompts, max_num_batched_tokens=budget),
    )
    return LLMEngine(cfg, load_tokenizer_=False)


def run_prompts(engine: LLMEngine, prompts: list[list[int]], tag: str) -> tuple[float, int, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, f"{tag}-{i}")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = 0
    first: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = out.token_ids[0]
        steps += 1
    torch.cuda.synchronize()
    return time.perf_counter() - t0, steps, [first.get(f"{tag}-{i}", -1) for i in range(len(prompts))]


_CLASSES = (
    ("attention", ("paged_attention", "attention", "flash", "fmha", "merge_splits")),
    ("rotary+kv_store", ("rotary", "write_kv", "store_kv")),
    ("norm", ("rms", "norm")),
    ("activation", ("silu", "act_and_mul", "gelu")),
    ("sampling", ("argmax", "softmax", "sort", "topk", "sampl")),
    ("gemm", ("gemm", "sm90", "cutlass", "nvjet", "xmma", "matmul", "cublas")),
)


def kernel_class(name: str) -> str:
    n = name.lower()
    for cls, keys in _CLASSES:
        if any(k in n for k in keys):
            return cls
    return "other"


def profile_engine(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall_s, steps, _ = run_prompts(engine, prompts, "prof")
    per_class: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    intervals = []
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        per_class[kernel_class(ev.name)] += us
        per_kernel[ev.name][0] += us
        per_kernel[ev.name][1] += 1
        intervals.append((ev.time_range.start, ev.time_range.end))
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):  # union of kernel intervals: the GPU's busy time
        if e > end:
            busy += e - max(s, end)
            end = e
    gpu_us = sum(per_class.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "wall_ms": wall_s * 1e3,
        "steps": steps,
        "gpu_kernel_ms": gpu_us / 1e3,
        "gpu_busy_ms": busy / 1e3,
        "idle_share": 1 - busy / 1e3 / (wall_s * 1e3),
        "per_class_ms": {k: v / 1e3 for k, v in sorted(per_class.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:120], "ms": v[0] / 1e3, "calls": v[1]} for n, v in top],
    }


def host_profile(engine: LLMEngine, prompts: list[list[int]]) -> None:
    """cProfile of one run (host Python only): where a step's host time goes, by own time and
    by cumulative time (waits for the GPU show as synchronize / wait entries)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    wall_s, steps, _ = run_prompts(engine, prompts, "hostprof")
    prof.disable()
    log(f"host profile: {1e3 * wall_s / steps:.2f} ms a step under cProfile ({steps} steps)")
    for key, n in (("tottime", 30), ("cumulative", 30)):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(n)
        print(buf.getvalue(), flush=True)


def attention_sweep(num_prompts: int, prompt_len: int) -> list[dict]:
    """Prefill tiles of the Triton kernel over a fresh paged cache vs torch SDPA (flash)."""
    from pdserve.kernels.triton_attention import paged_attention

    s = MODEL_SHAPE
    heads, kvh, d = s["num_heads"], s["num_kv_heads"], s["head_dim"]
    per_seq = -(-prompt_len // BLOCK_SIZE)
    nblocks = num_prompts * per_seq + 1
    cache = torch.randn((nblocks, 2, BLOCK_SIZE, kvh, d), dtype=torch.bfloat16, device="cuda")
    table = (torch.randperm(nblocks - 1, device="cuda")[: num_prompts * per_seq] + 1).view(
        num_prompts, per_seq
    )
    table = table.to(torch.int32).contiguous()
    q = torch.randn((num_prompts * prompt_len, heads, d), dtype=torch.bfloat16, device="cuda")
    seq_lens = torch.full((num_prompts,), prompt_len, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, num_prompts + 1, dtype=torch.int32, device="cuda") * prompt_len
    flops = num_prompts * 4 * heads * d * prompt_len * (prompt_len + 1) / 2
    rows = []

    def rec(tag: str, fn: Any, **cfg: Any) -> None:
        try:
            ms = median_ms(fn, rep_ms=100)
        except Exception as e:  # a tiling that fails to compile (shared memory) is reported, not fatal
            rows.append({"impl": tag, **cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            return
        rows.append({"impl": tag, **cfg, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12})

    ref = paged_attention(q, cache, table, seq_lens, qsl, prompt_len, d**-0.5, 1).float()
    rec("triton-default", lambda: paged_attention(q, cache, table, seq_lens, qsl, prompt_len, d**-0.5, 1))
    for bq, bn, w, st in itertools.product((16, 32), (32, 64, 128), (4, 8), (2, 3)):
        if bq * 4 * bn > 32 * 128 * 2:
            continue

        def fn(bq: int = bq, bn: int = bn, w: int = w, st: int = st) -> torch.Tensor:
            return paged_attention(
                q,
                cache,
                table,
                seq_lens,
                qsl,
                prompt_len,
                d**-0.5,
                1,
                block_q=bq,
                block_n=bn,
                num_warps=w,
                num_stages=st,
            )

        try:
            err = float((fn().float() - ref).norm() / ref.norm())
        except Exception as e:  # out of shared memory / registers for this tiling
            rows.append(
                {
                    "impl": "triton",
                    "block_q": bq,
                    "block_n": bn,
                    "warps": w,
                    "stages": st,
                    "error": str(e)[:120],
                }
            )
            continue
        rec("triton", fn, block_q=bq, block_n=bn, warps=w, stages=st, rel_err=err)
    # torch SDPA on contiguous K/V (what a dense prefill kernel gets): the attention ceiling here.
    qs = q.view(num_prompts, prompt_len, heads, d).transpose(1, 2)
    ks = torch.randn((num_prompts, kvh, prompt_len, d), dtype=torch.bfloat16, device="cuda")
    vs = torch.randn_like(ks)
    rec(
        "sdpa",
        lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True),
    )
    return rows


def run_transformers(model_dir: Path, prompts: list[list[int]], batch: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.cuda().eval()
    ids = torch.tensor(prompts, device="cuda")

    def fwd() -> None:
        with torch.no_grad():
            for i in range(0, len(prompts), batch):
                model(ids[i : i + batch], logits_to_keep=1, use_cache=False)

    fwd()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fwd()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"batch": batch, "seconds": dt, "tok_s": len(prompts) * len(prompts[0]) / dt}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--model-dir", default="/tmp/pdserve-gpu-decode-model")
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048, 16384, 65536])
    ap.add_argument("--triton-budgets", type=int, nargs="*", default=[16384], help="again, flash prefill off")
    ap.add_argument(
        "--runs", nargs="*", default=[], help="more runs, BUDGET:MODE (mode: " + " ".join(MODES) + ")"
    )
    ap.add_argument(
        "--profile", nargs="*", default=[], help="BUDGET:MODE runs to profile (default: last --budgets)"
    )
    ap.add_argument("--cudnn-gqa", type=int, default=1, help="1: KV heads as they are, 0: expanded")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--hf-batch", type=int, default=4)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--skip-profile", action="store_true")
    ap.add_argument("--host-profile", action="store_true", help="cProfile one run at each profiled budget")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir)
    log(f"model built in {build_model(model_dir):.1f} s")
    prompts = make_prompts(args.num_prompts, args.prompt_len, seed=1)
    flops = prefill_flops(args.prompt_len) * args.num_prompts
    res: dict[str, Any] = {
        "gemm_tflops": gemm_tflops(),
        "flops": flops,
        "engine": [],
        "peak_tflops": PEAK_TFLOPS,
    }
    log(f"cuBLAS 8192^3 bf16: {res['gemm_tflops']:.0f} TFLOP/s")
    tokens_ref = None
    profile_at = {(int(x.partition(":")[0]), x.partition(":")[2] or "auto") for x in args.profile}
    if not args.profile and args.budgets:
        profile_at = {(args.budgets[-1], "auto")}
    from pdserve.models import cudnn_prefill, flash_prefill

    defaults = {"flash": flash_prefill.ENABLED, "cudnn": cudnn_prefill.ENABLED}
    runs = [(b, "auto") for b in args.budgets] + [(b, "triton") for b in args.triton_budgets]
    for spec in args.runs:
        b, _, mode = spec.partition(":")
        assert mode in MODES, f"--runs {spec!r}: mode must be one of {MODES}"
        runs.append((int(b), mode))
    for budget, mode in runs:
        p: dict[str, Any] | None = None
        if mode == "auto":
            flash, cudnn_prefill.ENABLED = defaults["flash"], defaults["cudnn"]
        else:
            flash, cudnn_prefill.ENABLED = mode in ("cudnn+flash", "flash"), mode in ("cudnn+flash", "cudnn")
        flash_prefill.ENABLED = flash
        cudnn_prefill.GQA = args.cudnn_gqa
        engine = make_engine(model_dir, budget, args.num_prompts)
        run_prompts(engine, prompts[: max(2, budget // args.prompt_len + 1)], "warm")
        run_prompts(engine, prompts, "warm2")
        times = []
        for rep in range(2):
            dt, steps, toks = run_prompts(engine, prompts, f"b{budget}-{rep}")
            times.append(dt)
        dt = min(times)
        tokens_ref = tokens_ref or toks
        cudnn_ran = cudnn_prefill.ENABLED and cudnn_prefill._broken is None
        flash_ran = flash and flash_prefill._broken is None and budget <= flash_prefill.MAX_FLASH_TOKENS
        row = {
            "budget": budget,
            "mode": mode,
            # what ran: cuDNN takes steps with >= MIN_FRESH_TOKENS fresh tokens (others fall
            # through), flash only steps of at most MAX_FLASH_TOKENS tokens
            "attention": "+".join(
                [n for n, ran in (("cudnn", cudnn_ran), ("flash", flash_ran)) if ran] or ["triton"]
            ),
            "flash_error": flash_prefill._broken,
            "cudnn_error": cudnn_prefill._broken,
            "seconds": dt,
            "steps": steps,
            "tok_s": args.num_prompts * args.prompt_len / dt,
            "tflops": flops / dt / 1e12,
            "of_peak": flops / dt / 1e12 / PEAK_TFLOPS,
            "first_tokens_equal_first_budget": toks == tokens_ref,
        }
        res["engine"].append(row)
        log(
            f"budget {budget} {mode} ({row['attention']} attention): {row['tok_s']:,.0f} prompt tok/s, {row['tflops']:.0f} TFLOP/s = "
            f"{row['of_peak']:.3f} of peak ({steps} steps, first tokens same as budget {args.budgets[0]}: "
            f"{row['first_tokens_equal_first_budget']})"
        )
        if (budget, mode) in profile_at and not args.skip_profile:
            try:
                res["profile"] = p = profile_engine(engine, prompts)
            except (RuntimeError, AttributeError) as e:  # a profiler API difference must not sink the run
                log(f"profile failed: {type(e).__name__}: {e}")
                p = None
            if args.host_profile:
                host_profile(engine, prompts)
        if p is not None:
            log(
                f"profile: wall {p['wall_ms']:.1f} ms, GPU busy {p['gpu_busy_ms']:.1f} ms (idle {p['idle_share']:.3f})"
            )
            for k, v in p["per_class_ms"].items():
                log(f"   {k:16s} {v:8.2f} ms  {v / p['gpu_kernel_ms']:.3f}")
            for k in p["top_kernels"][:12]:
                log(f"   {k['ms']:8.2f} ms x{k['calls']:5d}  {k['name']}")
        del engine
        torch.cuda.empty_cache()
        (out / "gpu_prefill.json").write_text(json.dumps(res, indent=1))  # partial results survive a timeout
    flash_prefill.ENABLED, cudnn_prefill.ENABLED = True, False
    if not args.skip_sweep:
        res["sweep"] = attention_sweep(8, args.prompt_len)
        ok = sorted((r for r in res["sweep"] if "ms" in r), key=lambda r: r["ms"])
        for r in ok[:8] + [r for r in ok if r["impl"] != "triton"]:
            log(f"attention {r}")
    if not args.skip_transformers:
        res["transformers"] = run_transformers(model_dir, prompts, args.hf_batch)
        best = max(r["tok_s"] for r in res["engine"])
        log(
            f"transformers forward (batch {args.hf_batch}): {res['transformers']['tok_s']:,.0f} tok/s; "
            f"pdserve best {best:,.0f} = {best / res['transformers']['tok_s']:.2f}x"
        )
    (out / "gpu_prefill.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
