"""What an L2-resident weight would save a decode GEMM (the "per-GEMM fixed cost").

    PYTHONPATH=. python3 bench/gpu_gemv_l2.py --out DIR

Each Llama-1B layer GEMM at batch 1 and 64, timed in a CUDA graph (bench/gpu_decode.graph_us)
two ways: over 16 weight copies in turn (every call reads its weight from HBM: what a decode
step does) and over one weight again and again (from L2 after the first call, when it fits in
the H200's 50 MB L2). The gap bounds what prefetching the next GEMM's weight into L2 during the
small kernels before it (norm, rotary, attention) could win; the L2 time left is the fixed cost
no prefetch removes. Writes DIR/gemv_l2.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_decode import copy_bandwidth_gbps, graph_us, log

SHAPES = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    copy = copy_bandwidth_gbps() / 2  # payload bytes / s
    rows = []
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn((n, k), dtype=torch.bfloat16, device="cuda") for _ in range(16)]
        for batch in (1, 64):
            x = torch.randn((batch, k), dtype=torch.bfloat16, device="cuda")
            hbm = graph_us(lambda i=0, x=x, ws=ws: F.linear(x, ws[i % 16]), 16)
            l2 = graph_us(lambda i=0, x=x, w=ws[0]: F.linear(x, w), 16)
            ideal = n * k * 2 / (copy * 1e3)  # us at the copy's payload rate
            rows.append({"gemm": name, "batch": batch, "hbm_us": hbm, "l2_us": l2, "copy_rate_us": ideal})
            log(
                f"{name:8s} batch {batch:3d}: HBM {hbm:6.2f} us, L2 {l2:6.2f} us, bytes at copy rate {ideal:6.2f} us"
            )
        ws.clear()
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv_l2.json").write_text(json.dumps({"copy_payload_GBps": copy, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
