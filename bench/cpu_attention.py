"""The native CPU decode attention (``kernels.cpu_native_attention.attention``) alone, at SmolLM2-135M's shape
(9 query heads, 3 KV heads, head_dim 64, block size 16): the AVX2 kernel (``new``,
``cpu_attention.c``) against the scalar loop (``old``, ``cpu_native.c``) in one process, paired.

    .venv/bin/python bench/cpu_attention.py [--batches 1 16 64] [--keys 150 500] [--reps 7]
        [--heads 9] [--kv-heads 3] [--head-dim 64] [--cache-mib 256] [--out FILE]

- One call = one decode step's attention of one layer: B requests, one query each, ``keys`` cached
  keys each, in blocks placed at random in a layer view of a cache of several layers (as the
  engine lays it out). A repetition calls every layer once per path (the paths alternate, ``old``
  first in odd repetitions); µs per call = the sweep's time / layers. As many layers as fit
  ``--cache-mib`` (at least 2), so that, as in a decode step, a call's K/V are not in the caches.
- Reported: the median µs per call (process CPU time, ``time.thread_time``, which leaves out the
  time other processes held the core; and wall), the median of the per-repetition ratios
  old / new, and the largest difference between the paths' outputs (next to the largest output).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import loadavg, log  # noqa: E402
from pdserve.kernels import cpu_native_attention  # noqa: E402

BLOCK_SIZE = 16


def make_case(batch: int, keys: int, nh: int, nkv: int, d: int, cache_bytes: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-keys // BLOCK_SIZE)
    num_blocks = batch * blocks + 1
    layer_bytes = num_blocks * 2 * BLOCK_SIZE * nkv * d * 2
    layers = max(2, min(64, cache_bytes // layer_bytes))
    cache = torch.randn(num_blocks, layers, 2, BLOCK_SIZE, nkv, d, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * blocks].view(batch, blocks).to(torch.int32)
    return {
        "q": torch.randn(batch, nh, d, generator=gen).to(torch.bfloat16),
        "cache": cache,
        "tables": tables,
        "starts": torch.arange(batch + 1, dtype=torch.int32),
        "lens": torch.full((batch,), keys, dtype=torch.int32),
        "layers": layers,
        "scale": d**-0.5,
        "scores": cpu_native_attention.attention_scores([1] * batch, [keys] * batch, nh),
    }


def call(case: dict, layer: int) -> torch.Tensor:
    c = case
    out = cpu_native_attention.attention(
        c["q"], c["cache"][:, layer], c["tables"], c["starts"], c["lens"], int(c["lens"].max()), c["scale"],
        c["scores"],
    )  # fmt: skip
    assert out is not None, "the native attention refused the case"
    return out


def sweep_us(case: dict, simd: bool) -> tuple[float, float]:
    """(CPU µs, wall µs) per call over one call per layer."""
    cpu_native_attention.attention_simd(simd)
    c0, w0 = time.thread_time(), time.perf_counter()
    for layer in range(case["layers"]):
        call(case, layer)
    n = case["layers"]
    return (time.thread_time() - c0) / n * 1e6, (time.perf_counter() - w0) / n * 1e6


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--keys", type=int, nargs="+", default=[150, 500])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--cache-mib", type=int, default=256, help="KV cache of the layers swept")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_attention.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not cpu_native_attention.attention_simd(True):
        raise SystemExit("no AVX2 + FMA attention here (cpu_native_attention.attention_simd(True) is False)")
    log(f"load {loadavg()}")
    rows = []
    for b in args.batches:
        for k in args.keys:
            case = make_case(
                b, k, args.heads, args.kv_heads, args.head_dim, args.cache_mib << 20, seed=b * 1000 + k
            )
            cpu_native_attention.attention_simd(False)
            old = call(case, 0)
            cpu_native_attention.attention_simd(True)
            diff = max_diff(call(case, 0), old)
            times: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
            sweep_us(case, True)  # warm-up: page the cache in
            for r in range(args.reps):
                order = ("old", "new") if r % 2 == 0 else ("new", "old")
                for name in order:
                    times[name].append(sweep_us(case, name == "new"))
            med = {
                n: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts))
                for n, ts in times.items()
            }
            ratio = statistics.median(o[0] / n[0] for o, n in zip(times["old"], times["new"], strict=True))
            row = {
                "batch": b, "keys": k, "layers": case["layers"], "old_cpu_us": med["old"][0], "new_cpu_us": med["new"][0],
                "old_wall_us": med["old"][1], "new_wall_us": med["new"][1], "speedup_cpu": ratio, "max_abs_diff": diff, "max_abs_old": float(old.float().abs().max()),
            }  # fmt: skip
            rows.append(row)
            log(
                f"B={b:3d} keys={k:4d} ({case['layers']} layers): old {med['old'][0]:9.1f} us  new {med['new'][0]:8.1f} us"
                f"  (wall {med['old'][1]:9.1f} / {med['new'][1]:8.1f})  old/new {ratio:5.2f}x  max |new - old| {diff:.2g} (|old| <= {float(old.float().abs().max()):.2g})"
            )
            del case
    log(f"load {loadavg()}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}}, indent=1)
    )
    cpu_native_attention.attention_simd(True)


if __name__ == "__main__":
    main()
