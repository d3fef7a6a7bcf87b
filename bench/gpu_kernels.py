"""Benchmark the Triton RMSNorm kernels against torch eager (their twins) on one CUDA device.

    python bench/kernels.py --out bench_kernels.json [--rows 4096 16384 32768] [--hidden 2048 4096 8192]

For each shape it times gated RMSNorm (x, z -> y) and fused add-RMSNorm (x, residual -> normed,
residual') with ``triton.testing.do_bench`` (median, L2 flushed between runs) and reports
effective bandwidth = bytes read + written by an ideal single pass / time. The roof is a large
device-to-device ``copy_`` measured in the same run (also read + write), so ``of_copy`` is the
fraction of achievable bandwidth and ``speedup`` is eager time / Triton time.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

# Run as a script from a checkout (`python bench/kernels.py`) without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdserve.kernels import fused_add_rms_norm_torch, gated_rms_norm_torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = 1e-6


def _median_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _gbps(num_bytes: int, ms: float) -> float:
    return num_bytes / (ms * 1e-3) / 1e9


def copy_bandwidth_gbps(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy of ``num_bytes``; counts read + write like the kernels do."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return _gbps(2 * num_bytes, ms)


def bench_shape(kernel: str, rows: int, hidden: int, dtype: torch.dtype, copy_gbps: float) -> dict:
    from pdserve.kernels import triton_rmsnorm

    x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    other = torch.randn(rows, hidden, device="cuda", dtype=dtype)  # z or residual
    w = (1.0 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    act_bytes = rows * hidden * x.element_size()
    if kernel == "gated_rms_norm":
        # read x, z; write y; read w once
        num_bytes = 3 * act_bytes + w.numel() * w.element_size()

        def run_triton():
            return triton_rmsnorm.gated_rms_norm_fwd(x, other, w, EPS, "silu", True)

        def run_eager():
            return gated_rms_norm_torch(x, other, w, EPS, "silu", True)

        torch.testing.assert_close(run_triton().float(), run_eager().float(), atol=2e-2, rtol=2e-2)
    elif kernel == "fused_add_rms_norm":
        # read x, residual; write normed, residual'; read w once
        num_bytes = 4 * act_bytes + w.numel() * w.element_size()

        def run_triton():
            return triton_rmsnorm.fused_add_rms_norm_fwd(x, other, w, EPS)

        def run_eager():
            return fused_add_rms_norm_torch(x, other, w, EPS)

        (tn, tr), (en, er) = run_triton(), run_eager()
        assert torch.equal(tr, er), "residual' differs from the twin"
        torch.testing.assert_close(tn.float(), en.float(), atol=2e-2, rtol=2e-2)
    else:
        raise ValueError(kernel)

    triton_ms, eager_ms = _median_ms(run_triton), _median_ms(run_eager)
    triton_gbps = _gbps(num_bytes, triton_ms)
    return {
        "kernel": kernel,
        "rows": rows,
        "hidden": hidden,
        "dtype": str(dtype).removeprefix("torch."),
        "bytes": num_bytes,
        "triton_us": triton_ms * 1e3,
        "eager_us": eager_ms * 1e3,
        "triton_gbps": triton_gbps,
        "eager_gbps": _gbps(num_bytes, eager_ms),
        "copy_gbps": copy_gbps,
        "of_copy": triton_gbps / copy_gbps,
        "speedup": eager_ms / triton_ms,
    }


def _print_table(results: list[dict], copy_gbps: float) -> None:
    print(f"device-to-device copy: {copy_gbps:,.0f} GB/s (read + write)")
    header = (
        f"{'kernel':<20} {'rows':>6} {'hidden':>6} {'dtype':>8} {'triton us':>10} {'eager us':>10} "
        f"{'triton GB/s':>11} {'eager GB/s':>10} {'of copy':>7} {'speedup':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['kernel']:<20} {r['rows']:>6} {r['hidden']:>6} {r['dtype']:>8} {r['triton_us']:>10.1f} "
            f"{r['eager_us']:>10.1f} {r['triton_gbps']:>11,.0f} {r['eager_gbps']:>10,.0f} "
            f"{r['of_copy']:>7.2f} {r['speedup']:>6.2f}x"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    parser.add_argument("--rows", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA device (torch.cuda.is_available() is False); nothing run.")
        return 2

    dtype = DTYPES[args.dtype]
    copy_gbps = copy_bandwidth_gbps()
    results = [
        bench_shape(kernel, rows, hidden, dtype, copy_gbps)
        for kernel in ("gated_rms_norm", "fused_add_rms_norm")
        for rows in args.rows
        for hidden in args.hidden
    ]
    _print_table(results, copy_gbps)
    import triton

    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "timer": "triton.testing.do_bench median, L2 flushed",
        "copy_gbps": copy_gbps,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
