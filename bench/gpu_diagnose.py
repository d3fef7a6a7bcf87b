"""Where a decode step's GPU time goes, on one CUDA device (the diagnostics of bench/gpu_decode.py).

    python bench/gpu_diagnose.py --out DIR [--model-dir DIR] [--batches 1 16 64]
                                 [--prompt-len 512] [--new-tokens 128] [--no-traces]

Same model and workload as gpu_decode.py. Records:
  traces        torch.profiler Chrome traces of 6 decode steps (graphs at batch 1 and 64, the
                torch attention path at batch 1), phases labelled (skipped with --no-traces)
  rotary_store  per layer in a CUDA graph: rotary then the KV write vs the fused rotary + KV store
  gemms         each layer GEMM alone over 16 weight copies, default BLAS vs cuBLASLt
  attention     the decode attention launch sweep (splits, BLOCK_N, warps, stages)
into DIR/attention_sweep.json and DIR/trace_*.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_decode import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MODEL_SHAPE,
    _engine,
    _generate_timed,
    build_model,
    copy_bandwidth_gbps,
    graph_us,
    log,
    make_prompts,
)
from pdserve import kernels
from pdserve.engine.sampling_params import SamplingParams


def attention_sweep(batches: list[int], ctx: int, copy_gbps: float) -> list[dict]:
    """Decode attention (KV write + attention + merge) per layer, timed in a CUDA graph over 16
    layers' caches (no L2 reuse, no launch gaps), across launch configs."""
    rows: list[dict] = []
    for b in batches:
        rows.extend(_sweep_batch(b, ctx, copy_gbps))
        best = min((r for r in rows if r["batch"] == b and "us" in r), key=lambda r: r["us"])
        dflt = [r["us"] for r in rows if r["batch"] == b and r.get("default")]
        log(f"attention sweep batch {b}: best {best}; default {dflt}")
        torch.cuda.empty_cache()
    return rows


def _sweep_batch(b: int, ctx: int, copy_gbps: float) -> list[dict]:
    from pdserve.kernels import triton_attention as ta
    from pdserve.kernels import triton_kv_splits, triton_kv_write

    layers = MODEL_SHAPE["num_layers"]
    heads, kv_heads, dim = MODEL_SHAPE["num_heads"], MODEL_SHAPE["num_kv_heads"], MODEL_SHAPE["head_dim"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = b * per_seq + 1
    stage = torch.randn(
        (num_blocks, layers, 2, BLOCK_SIZE, kv_heads, dim), dtype=torch.bfloat16, device="cuda"
    )
    table = (
        (torch.randperm(num_blocks - 1, device="cuda")[: b * per_seq] + 1).view(b, per_seq).to(torch.int32)
    )
    pos = ctx - 1
    slots = (table[:, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE).contiguous()
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    q = torch.randn((b, heads, dim), dtype=torch.bfloat16, device="cuda")
    k = torch.randn((b, kv_heads, dim), dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    kv_bytes = b * ctx * 2 * kv_heads * dim * 2
    default = triton_kv_splits.num_kv_splits(b, kv_heads, sms)
    rows = []
    splits_pair = sorted({default, min(16, default * 2)})
    # (splits, block_n, warps, stages)
    if b >= 32:  # the big batch: the wide sweep
        grid = [(sp, n, w, st) for sp in splits_pair for n in (32, 64) for w in (2, 4) for st in (2, 3, 4)]
    else:
        grid = [(sp, 64, 4, 3) for sp in splits_pair]
    for splits, block_n, warps, stages in grid:
        cfg = {
            "batch": b,
            "ctx": ctx,
            "splits": splits,
            "block_n": block_n,
            "warps": warps,
            "stages": stages,
        }

        def call(
            i: int = 0,
            splits: int = splits,
            block_n: int = block_n,
            warps: int = warps,
            stages: int = stages,
        ) -> None:
            cache = stage[:, i % layers]
            triton_kv_write.write_kv_cache(k, v, cache, slots)
            ta.paged_attention(
                q, cache, table, seq_lens, qsl, 1, dim**-0.5, splits,
                block_n=block_n, num_warps=warps, num_stages=stages,
            )  # fmt: skip

        try:
            us = graph_us(call, layers)
        except Exception as e:  # a config that does not compile or fit: record, go on
            rows.append({**cfg, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        of_copy = kv_bytes / (us * 1e-6) / 1e9 / copy_gbps
        is_default = (splits, block_n, warps, stages) == (default, 64, 4, 3)
        rows.append({**cfg, "us": us, "of_copy": of_copy, "default": is_default})
    return rows


def rotary_store_timing(batches: list[int], ctx: int) -> list[dict]:
    """Per layer, in a CUDA graph over 16 layers' caches: rotary then the KV write (two launches)
    vs the fused rotary + KV store (one launch)."""
    from pdserve.kernels import rotary_cos_sin_cache

    dim = MODEL_SHAPE["head_dim"]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    cos_sin = rotary_cos_sin_cache(inv_freq, MAX_MODEL_LEN)
    rows = []
    for b in batches:
        row = _rotary_store_at(b, ctx, cos_sin)
        log(
            f"rotary + KV store batch {b}: two launches {row['rotary_then_write_us']:.2f} us, fused {row['fused_us']:.2f} us"
        )
        rows.append(row)
    return rows


def _rotary_store_at(b: int, ctx: int, cos_sin: torch.Tensor) -> dict:
    from pdserve.kernels import triton_kv_write
    from pdserve.kernels import triton_rotary as tr

    layers = MODEL_SHAPE["num_layers"]
    heads, kv_heads, dim = MODEL_SHAPE["num_heads"], MODEL_SHAPE["num_kv_heads"], MODEL_SHAPE["head_dim"]
    per_seq = -(-ctx // BLOCK_SIZE)
    stage = torch.zeros(
        (b * per_seq + 1, layers, 2, BLOCK_SIZE, kv_heads, dim), dtype=torch.bfloat16, device="cuda"
    )
    slots = torch.arange(b, device="cuda", dtype=torch.int64) * per_seq * BLOCK_SIZE + ctx - 1
    qkv = torch.randn((b, (heads + 2 * kv_heads) * dim), dtype=torch.bfloat16, device="cuda")
    q = qkv[:, : heads * dim].view(b, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(b, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(b, kv_heads, dim)
    pos = torch.full((b,), ctx - 1, dtype=torch.int64, device="cuda")

    def two(i: int = 0) -> None:
        _, k_rot = tr.rotary_fwd(q, k, pos, cos_sin)
        triton_kv_write.write_kv_cache(k_rot, v, stage[:, i % layers], slots)

    def one(i: int = 0) -> None:
        tr.rotary_store_kv_fwd(q, k, v, pos, cos_sin, stage[:, i % layers], slots)

    return {"batch": b, "rotary_then_write_us": graph_us(two, layers), "fused_us": graph_us(one, layers)}


def gemm_timing(batches: list[int], copy_gbps: float) -> list[dict]:
    """The layer's GEMMs alone, 16 weight copies per shape (no L2 reuse), in a CUDA graph: per
    call us and fraction of copy bandwidth, with torch's default BLAS and with cuBLASLt preferred."""
    hidden, inter, vocab = (
        MODEL_SHAPE["hidden_size"],
        MODEL_SHAPE["intermediate_size"],
        MODEL_SHAPE["vocab_size"],
    )
    q_kv = (MODEL_SHAPE["num_heads"] + 2 * MODEL_SHAPE["num_kv_heads"]) * MODEL_SHAPE["head_dim"]
    shapes = {
        "qkv": (hidden, q_kv),
        "o_proj": (hidden, hidden),
        "gate_up": (hidden, 2 * inter),
        "down": (inter, hidden),
        "lm_head": (hidden, vocab),
    }
    rows = []
    default_lib = torch.backends.cuda.preferred_blas_library()
    for name, (k_in, n_out) in shapes.items():
        copies = 16 if n_out * k_in < 1 << 26 else 4
        weights = [torch.randn(n_out, k_in, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        for b in batches:
            x = torch.randn(b, k_in, dtype=torch.bfloat16, device="cuda")
            row: dict[str, Any] = {"gemm": name, "batch": b}
            for lib in ("default", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(default_lib if lib == "default" else "cublaslt")
                try:
                    us = graph_us(
                        lambda i=0, x=x, w=weights: torch.nn.functional.linear(x, w[i % len(w)]), 16
                    )
                except Exception as e:  # report and go on
                    row[lib] = f"{type(e).__name__}: {e}"[:120]
                    continue
                row[f"{lib}_us"] = us
                row[f"{lib}_of_copy"] = weights[0].numel() * 2 / (us * 1e-6) / 1e9 / copy_gbps
            torch.backends.cuda.preferred_blas_library(default_lib)
            log(
                f"gemm {name} batch {b}: "
                + ", ".join(
                    f"{lib} {row[f'{lib}_us']:.2f} us ({row[f'{lib}_of_copy']:.2f})"
                    for lib in ("default", "cublaslt")
                    if f"{lib}_us" in row
                )
            )
            rows.append(row)
        del weights
        torch.cuda.empty_cache()
    return rows


def profile_engine(model_dir: Path, out: Path, mode: str, batches: list[int], prompt_len: int) -> None:
    """Chrome traces of 6 decode steps per batch size, phases labelled with record_function."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def labelled(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            with record_function(name):
                return fn(*a, **kw)

        return wrapper

    with kernels.use_backend("torch" if mode == "torch-attn" else "auto"):
        engine = _engine(model_dir, mode, max(batches), prompt_len)
        runner = engine.runner
        runner.launch = labelled("runner.launch", runner.launch)  # type: ignore[method-assign]
        engine.scheduler.schedule = labelled("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
        runner.model.compute_logits = labelled("compute_logits", runner.model.compute_logits)  # type: ignore[method-assign]
        runner.sampler = labelled("sampler", runner.sampler)  # type: ignore[assignment]
        if runner.cuda_graphs is not None:
            runner.cuda_graphs.run = labelled("graphs.run", runner.cuda_graphs.run)  # type: ignore[method-assign]
        for b in batches:
            _generate_timed(engine, make_prompts(b, 32, seed=99), 8, f"warm{b}")
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            for i, p in enumerate(make_prompts(b, prompt_len, seed=b)):
                engine.add_request(p, params, f"p{b}-{i}")
            for _ in range(8):
                engine.step()
            steps = 6 if mode != "torch-attn" else 2
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    with record_function("step"):
                        engine.step()
            prof.export_chrome_trace(str(out / f"trace_{mode}_b{b}.json"))
            print(f"--- {mode} batch {b}: top CPU (self) ---")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
            print(f"--- {mode} batch {b}: top CUDA ---")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
            while engine.has_unfinished():
                engine.step()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def diagnose(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    copy_gbps = copy_bandwidth_gbps()
    log(f"copy bandwidth {copy_gbps:,.0f} GB/s")
    build_model(args.model_dir)
    if not args.no_traces:
        for mode, batches in (("graphs", [1, 64]), ("torch-attn", [1])):
            profile_engine(args.model_dir, args.out, mode, batches, args.prompt_len)
    ctx = args.prompt_len + args.new_tokens // 2
    fused: list[dict] = []
    gemms: list[dict] = []
    try:
        fused = rotary_store_timing(args.batches, ctx)
        gemms = gemm_timing(args.batches, copy_gbps)
    except Exception as e:  # keep the attention sweep
        log(f"fused rotary / GEMM timing failed: {type(e).__name__}: {e}")
    rows = attention_sweep(args.batches, ctx, copy_gbps)
    (args.out / "attention_sweep.json").write_text(
        json.dumps({"copy_gbps": copy_gbps, "rows": rows, "rotary_store": fused, "gemms": gemms}, indent=1)
    )
    for b in args.batches:
        ok = sorted((r for r in rows if r["batch"] == b and "us" in r), key=lambda r: r["us"])
        print(f"batch {b}: " + "; ".join(
            f"s{r['splits']} n{r['block_n']} w{r['warps']} st{r['stages']}: {r['us']:.1f} us ({r['of_copy']:.2f})"
            for r in ok[:8]
        ) + f" | default {[round(r['us'], 1) for r in ok if r.get('default')]}")  # fmt: skip
        errs = [r for r in rows if r["batch"] == b and "error" in r]
        if errs:
            print(f"  batch {b}: {len(errs)} configs failed, first: {errs[0]['error']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for the traces and attention_sweep.json"
    )
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/pdserve-llama1b-random"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--no-traces", action="store_true", help="skip the profiler traces")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_diagnose.py needs a CUDA device; nothing run.")
        return 2
    return diagnose(args)


if __name__ == "__main__":
    sys.exit(main())
