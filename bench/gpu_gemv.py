"""Decode GEMMs of a few rows: cuBLAS (plus the separate norm / SiLU * up kernel before it)
against pdserve's Triton GEMV with that prologue fused (``pdserve.kernels.triton_gemv``).

    PYTHONPATH=. python3 bench/gpu_gemv.py --out DIR [--rows 1 4 8] [--quick]

Each Llama-1B layer GEMM, timed per call in a CUDA graph over 16 weight copies in turn (every call
reads its weight from HBM, as a decode step does; ``bench/gpu_decode.graph_us``):
    qkv, gate_up   fused add + RMSNorm, then the GEMM
    o_proj         the GEMM alone
    down           SiLU * up, then the GEMM
For the Triton kernel a sweep of (BLOCK_N, BLOCK_K, warps, stages); the table gives cuBLAS, cuBLAS
with its prologue kernel, the best Triton config, and the bytes at the copy's payload rate.
Writes DIR/gemv.json (every row, for choosing ``triton_gemv.default_tiles``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_decode import copy_bandwidth_gbps, graph_us, log
from pdserve.kernels import fused_add_rms_norm, silu_and_mul
from pdserve.kernels.triton_gemv import gemv

# name: (N, K, prologue)
SHAPES = {
    "qkv": (3072, 2048, "norm"),
    "o_proj": (2048, 2048, "none"),
    "gate_up": (16384, 2048, "norm"),
    "down": (2048, 8192, "silu"),
}
COPIES = 16


def _configs(rows: int, quick: bool) -> list[tuple[int, int, int, int]]:
    pad = 1 << (rows - 1).bit_length()
    ns, ks, ws, ss = (
        ((4, 8), (256, 512), (4,), (3,)) if quick else ((4, 8, 16), (256, 512, 1024), (4, 8), (3,))
    )
    return [(n, k, w, s) for n, k, w, s in itertools.product(ns, ks, ws, ss) if pad * n * k <= 32768]


def bench_shape(name: str, rows: int, copy_payload_gbps: float, quick: bool) -> list[dict[str, Any]]:
    n, k, prologue = SHAPES[name]
    ws = [torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(COPIES)]
    xk = 2 * k if prologue == "silu" else k
    x = torch.randn((rows, xk), dtype=torch.bfloat16, device="cuda")
    res = torch.randn((rows, k), dtype=torch.bfloat16, device="cuda")
    g = torch.ones(k, dtype=torch.bfloat16, device="cuda")
    ideal_us = n * k * 2 / (copy_payload_gbps * 1e3)
    base = {"gemm": name, "rows": rows, "bytes_at_copy_rate_us": ideal_us}
    out: list[dict[str, Any]] = []
    cublas = graph_us(lambda i=0: F.linear(x[:, :k], ws[i % COPIES]), COPIES)
    if prologue == "norm":

        def with_prologue(i: int = 0) -> Any:
            h, _ = fused_add_rms_norm(x, res, g, 1e-5)
            return F.linear(h, ws[i % COPIES])

        def ref() -> torch.Tensor:
            return F.linear(fused_add_rms_norm(x, res, g, 1e-5)[0], ws[0])

        kw: dict[str, Any] = {"residual": res, "norm_weight": g, "eps": 1e-5}
    elif prologue == "silu":

        def with_prologue(i: int = 0) -> Any:
            return F.linear(silu_and_mul(x), ws[i % COPIES])

        def ref() -> torch.Tensor:
            return F.linear(silu_and_mul(x), ws[0])

        kw = {"silu_mul": True}
    else:
        with_prologue = None

        def ref() -> torch.Tensor:
            return F.linear(x, ws[0])

        kw = {}
    chain = graph_us(with_prologue, COPIES) if with_prologue is not None else cublas
    out.append({**base, "impl": "cublas", "us": cublas})
    out.append({**base, "impl": "cublas+prologue", "us": chain})
    expect = ref().float()
    for bn, bk, nw, st in _configs(rows, quick):
        cfg = {"block_n": bn, "block_k": bk, "warps": nw, "stages": st}

        def call(i: int = 0, bn: int = bn, bk: int = bk, nw: int = nw, st: int = st) -> Any:
            return gemv(x, ws[i % COPIES], block_n=bn, block_k=bk, num_warps=nw, num_stages=st, **kw)

        try:
            err = (call()[0].float() - expect).abs().max().item()
            us = graph_us(call, COPIES)
        except Exception as e:  # a tiling that does not compile or fit: recorded, the sweep goes on
            out.append({**base, "impl": "triton", **cfg, "error": f"{type(e).__name__}: {e}"[:160]})
            continue
        out.append({**base, "impl": "triton", **cfg, "us": us, "max_abs_err": err})
    ws.clear()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--quick", action="store_true", help="a 4-config sweep")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = copy_bandwidth_gbps() / 2
    log(f"copy payload rate {payload:,.0f} GB/s; {torch.cuda.get_device_name()}")
    rows: list[dict[str, Any]] = []
    summary = []
    for name in args.shapes:
        for m in args.rows:
            t0 = time.perf_counter()
            got = bench_shape(name, m, payload, args.quick)
            rows.extend(got)
            tri = [r for r in got if r["impl"] == "triton" and "us" in r]
            best = min(tri, key=lambda r: r["us"]) if tri else None
            cub, chain = got[0]["us"], got[1]["us"]
            line = (
                f"{name:8s} rows {m}: cuBLAS {cub:6.2f} us, with prologue {chain:6.2f}, "
                f"bytes {got[0]['bytes_at_copy_rate_us']:5.2f}"
            )
            if best:
                line += (
                    f"; Triton fused best {best['us']:6.2f} us ({best['block_n']}x{best['block_k']} w{best['warps']} "
                    f"s{best['stages']}, err {best['max_abs_err']:.2g}) = {chain / best['us']:.2f}x"
                )
            log(line + f"  [{time.perf_counter() - t0:.0f} s]")
            summary.append(line)
            (out / "gemv.json").write_text(json.dumps({"copy_payload_GBps": payload, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
