"""cuda_ipc KV transport bandwidth between two processes on one GPU, against a device copy.

    PYTHONPATH=. python3 bench/gpu_ipc.py --out DIR [--prompt-tokens 2000] [--reps 200]
        [--variant-reps 40] [--budget-s 75]

The receiver is a child process with a Llama-1B-shaped bf16 KV tensor (16 layers, 8 KV heads,
head_dim 64, blocks of 16 tokens); the sender holds the same layout and pushes one prompt's
blocks through ``KVProducer.push`` (regions, merged descriptors, CudaIpcBackend), with the
receiver's blocks consecutive (a fresh pool: one descriptor) and scattered (one per block), the
scattered ones through each copy method (``cuda_runtime``: the default, the Triton kernel of
before, ``cudaMemcpyBatchAsync``, one memcpy each). In the same run: ``write()`` alone,
``torch`` copy of the same bytes in one process (payload bytes / s, the same count as the
transport's), and a 2 GiB copy counting read + write bytes (the number docs/benchmarks.md calls
the copy bandwidth). Then every method and Triton variant on 125 x 512 KiB, 1,000 x 64 KiB and
16 x 4 MiB scattered blocks into the receiver's memory, kernel time and host time apart
(bench/_ipc_variants.py). Prints tables, writes DIR/gpu_ipc.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import _ipc_variants  # noqa: E402
from pdserve.kernels import triton_copy  # noqa: E402
from pdserve.kvtransfer import cuda_runtime  # noqa: E402
from pdserve.kvtransfer.connector import KVProducer  # noqa: E402
from pdserve.kvtransfer.cuda_ipc import CudaIpcBackend  # noqa: E402
from pdserve.kvtransfer.regions import DescriptorPlan, align_regions, regions_for_kv_cache  # noqa: E402

LAYERS = [f"model.layers.{i}.self_attn" for i in range(16)]
GEOM = dict(block_size=16, num_kv_heads=8, head_dim=64, elem_bytes=2)
NUM_BLOCKS = 1024

PEER = """
import sys, torch
from pdserve.kvtransfer.cuda_ipc import CudaIpcBackend
from pdserve.kvtransfer.cuda_runtime import CudaRuntime
kv = torch.zeros((NUM_BLOCKS, 16, 2, 16, 8, 64), dtype=torch.bfloat16, device="cuda")
rt = CudaRuntime()
b = CudaIpcBackend(cuda=rt)
b.register(kv.data_ptr(), kv.numel() * kv.element_size())
base, _ = rt.allocation_of(kv.data_ptr())
print(b.session_id, kv.data_ptr(), rt.ipc_handle(base).hex(), kv.data_ptr() - base, flush=True)
sys.stdin.readline()
torch.cuda.synchronize()
print(float(kv.float().abs().sum()), flush=True)
sys.stdin.readline()  # the sender's own mapping (the variants) is closed
b.close()
""".replace("NUM_BLOCKS", str(NUM_BLOCKS))


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--variant-reps", type=int, default=40, help="repetitions per method and case")
    ap.add_argument(
        "--budget-s", type=float, default=75.0, help="methods past this much run time are skipped"
    )
    args = ap.parse_args()
    t_start = time.monotonic()
    assert torch.cuda.is_available(), "needs CUDA"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen(
        [sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None and child.stdin is not None
    session, addr, peer_handle, peer_offset = child.stdout.readline().split()
    dst_regions = regions_for_kv_cache(int(addr), NUM_BLOCKS, LAYERS, **GEOM)
    kv = torch.randn((NUM_BLOCKS, 16, 2, 16, 8, 64), dtype=torch.bfloat16, device="cuda")
    rt = cuda_runtime.CudaRuntime()
    backend = CudaIpcBackend(cuda=rt)
    backend.register(kv.data_ptr(), kv.numel() * kv.element_size())
    src_regions = regions_for_kv_cache(kv.data_ptr(), NUM_BLOCKS, LAYERS, **GEOM)
    prod = KVProducer(backend, src_regions, 16, lambda tid: None, lease_s=600)
    nblk = -(-args.prompt_tokens // 16)
    src_blocks = list(range(1, nblk + 1))
    gen = torch.Generator().manual_seed(0)
    layouts = {
        "consecutive": list(range(100, 100 + nblk)),
        # disjoint from the consecutive run, so the receiver's sum checks both layouts
        "scattered": [
            b for b in torch.randperm(NUM_BLOCKS, generator=gen).tolist() if not 100 <= b < 100 + nblk
        ][:nblk],
    }
    default = rt.copy_method
    res: dict = {
        "prompt_tokens": args.prompt_tokens,
        "blocks": nblk,
        "copy_method": default,
        "triton_variant": triton_copy.DEFAULT_VARIANT,
        "rows": [],
    }
    runs = [("consecutive", layouts["consecutive"], default), ("scattered", layouts["scattered"], default)]
    # the same scattered blocks through the other methods: the kernel before the chunk table,
    # one cudaMemcpyBatchAsync, one cudaMemcpyAsync each
    runs += [
        ("scattered, Triton grid2d-128k (the kernel before)", layouts["scattered"], "triton:grid2d-128k"),
        ("scattered, cudaMemcpyBatchAsync", layouts["scattered"], "memcpy_batch"),
        ("scattered, memcpy per block", layouts["scattered"], "memcpy"),
    ]
    for name, dst_blocks, method in runs:
        if method == "memcpy_batch" and "memcpy_batch" in rt.unavailable:
            print(f"skipped {name!r}: {rt.unavailable['memcpy_batch']}")
            continue
        rt.copy_method = method
        rt.unavailable.pop("triton", None)  # a kernel that failed to build before says nothing of this one
        counter = [0]
        # The engine holds a finished prompt's blocks before any push: not part of the transfer,
        # so every hold is made before the timed pushes (each push then frees its own hold).
        for i in range(1, args.reps + 4):
            prod.on_hold(f"{name}-{i}", src_blocks, need_send=1)

        def push(dst_blocks: list[int] = dst_blocks, name: str = name, counter: list[int] = counter) -> None:
            counter[0] += 1
            tid = f"{name}-{counter[0]}"
            r = prod.push(tid, dst_blocks, args.prompt_tokens, dst_regions, session)
            assert r.ok, r.error
            push.result = r  # type: ignore[attr-defined]

        ms = median_ms(push, args.reps)
        r = push.result  # type: ignore[attr-defined]
        res["rows"].append(
            {
                "layout": name,
                "method": method,
                "bytes": r.bytes,
                "descriptors": r.num_descriptors,
                "ms": ms,
                "GBps": r.bytes / ms / 1e6,
                # the method could not run: the row is the next one in the fallback order
                "fell_back": rt.unavailable.get(method.partition(":")[0]),
            }
        )
    rt.copy_method = default
    # The backend's write alone (descriptors and their spans built once: the int64 table and
    # the spans a push hands ``write_spanned``): the copy plus the ctypes / directory cost,
    # without KVProducer's validation and descriptor building.
    plan = DescriptorPlan(align_regions(src_regions, dst_regions))
    for layout in ("consecutive", "scattered"):
        descs, spans = plan.descriptors_spans(src_blocks, layouts[layout])
        wn = int(descs[:, 2].sum())
        w_ms = median_ms(
            lambda d=descs, sp=spans: backend.write_spanned(session, d, sp, transfer_id="w"), args.reps
        )
        res["rows"].append(
            {
                "layout": f"{layout}, write() only",
                "method": default,
                "bytes": wn,
                "descriptors": len(descs),
                "ms": w_ms,
                "GBps": wn / w_ms / 1e6,
            }
        )
    res["push_host_us"] = _push_host_sections(prod, src_blocks, layouts["scattered"], dst_regions, plan)
    nbytes = res["rows"][0]["bytes"]
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy_ms = median_ms(lambda a=a, b=b: b.copy_(a), args.reps)
    big = torch.randint(0, 255, (2 << 30,), dtype=torch.uint8, device="cuda")
    big2 = torch.empty_like(big)
    big_ms = median_ms(lambda big=big, big2=big2: big2.copy_(big), 10)
    res["copy_same_bytes_ms"] = copy_ms
    res["copy_same_bytes_GBps"] = nbytes / copy_ms / 1e6
    res["copy_2GiB_rw_GBps"] = 2 * (2 << 30) / big_ms / 1e6
    child.stdin.write("sum\n")
    child.stdin.flush()
    landed = float(child.stdout.readline())
    res["receiver_abs_sum"] = landed
    res["receiver_expected_abs_sum"] = expected = float(kv[src_blocks].float().abs().sum()) * 2
    res["receiver_sum_ok"] = abs(landed - expected) <= 1e-3 * expected
    backend.close()  # closes its mapping of the receiver: the variants below open their own
    del a, b, big, big2
    print(
        f"\ncuda_ipc, {args.prompt_tokens}-token prompt, Llama-1B KV ({nbytes / 2**20:.1f} MiB), two processes, "
        f"one GPU; copy method {default} (Triton variant {triton_copy.DEFAULT_VARIANT})"
    )
    big_payload = res["copy_2GiB_rw_GBps"] / 2  # payload bytes / s of the 2 GiB copy
    print("| layout | descriptors | ms | payload GB/s | of same-size copy | of 2 GiB copy (payload) |")
    print("|---|---|---|---|---|---|")
    for row in res["rows"]:
        row["of_same_size_copy"] = row["GBps"] / res["copy_same_bytes_GBps"]
        row["of_2GiB_copy"] = row["GBps"] / big_payload
        fell = f" (could not run, measured the fallback: {row['fell_back']})" if row.get("fell_back") else ""
        print(
            f"| {row['layout']}{fell} | {row['descriptors']} | {row['ms']:.3f} | {row['GBps']:,.0f} | "
            f"{row['of_same_size_copy']:.2f} | {row['of_2GiB_copy']:.2f} |"
        )
    (out / "gpu_ipc.json").write_text(json.dumps(res, indent=1))
    print(
        f"| torch copy, same bytes, one process | 1 | {copy_ms:.3f} | {res['copy_same_bytes_GBps']:,.0f} | 1.00 | "
        f"{res['copy_same_bytes_GBps'] / big_payload:.2f} |\n"
        f"2 GiB device copy (read + write bytes): {res['copy_2GiB_rw_GBps']:,.0f} GB/s; "
        f"receiver's sum of what landed matches: {res['receiver_sum_ok']}"
    )

    # Part 2: every method and Triton variant, kernel and host time apart, into the receiver's
    # KV through a mapping of our own
    dev = torch.cuda.current_device()
    mapped = rt.open_handle(bytes.fromhex(peer_handle), dev)
    variants: list[dict] = []
    try:
        timer = _ipc_variants.Timer(args.variant_reps)
        for blocks, size in _ipc_variants.CASES:
            variants += _ipc_variants.run_case(
                rt,
                timer,
                kv.view(torch.uint8).view(-1),
                mapped + int(peer_offset),
                kv.numel() * kv.element_size(),
                blocks,
                size,
                t_start + args.budget_s,
            )
    finally:
        torch.cuda.synchronize()
        rt.close_handle(mapped, dev)
        child.stdin.write("exit\n")
        child.stdin.flush()
        child.wait(timeout=30)
    res["variants"] = variants
    res["wall_s"] = time.monotonic() - t_start
    (out / "gpu_ipc.json").write_text(json.dumps(res, indent=1))
    _ipc_variants.print_rows(variants)
    _print_breakdown(res)
    print(f"bench wall time {res['wall_s']:.1f} s")
    assert res["receiver_sum_ok"], (landed, expected)
    bad = [(r["case"], r["variant"]) for r in variants if r.get("ok") is False]
    assert not bad, f"bytes did not land: {bad}"


def _push_host_sections(
    prod: KVProducer, src: list[int], dst: list[int], dst_regions: list, plan: DescriptorPlan
) -> dict[str, float]:
    """Host-only parts of a scattered push, median us over 2,000 calls each: the hold's ids
    (``BlockIds``, made by its first push), the plan cache lookup with the fresh regions a gRPC
    request brings, ``descriptors_spans``, and the table's spans as ``write`` finds them from
    the rows (what ``write_spanned`` skips)."""
    from pdserve.kvtransfer.block_ids import BlockIds
    from pdserve.kvtransfer.cuda_ipc import _spans

    held = BlockIds.of(src)
    ids = tuple(dst)
    fresh = [dataclasses.replace(r) for r in dst_regions]
    table, _ = plan.descriptors_spans(held, ids)

    def us(fn) -> float:
        for _ in range(20):
            fn()
        ts = []
        for _ in range(2000):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    out = {
        "held_ids_us": us(lambda: BlockIds.of(src)),
        "plan_lookup_us": us(lambda: prod._plan(fresh, None)),
        "descriptors_spans_us": us(lambda: plan.descriptors_spans(held, ids)),
        "row_spans_us": us(lambda: _spans(table)),
    }
    print(
        "scattered push, host sections (us, this host): " + ", ".join(f"{k} {v:.1f}" for k, v in out.items())
    )
    return out


def _print_breakdown(res: dict) -> None:
    """Where a scattered push's time goes, from the rows above (default method)."""
    rows = {r["layout"]: r for r in res["rows"]}
    push, write = rows.get("scattered"), rows.get("scattered, write() only")
    method = res["copy_method"]
    if method == "triton":
        method = f"triton:{res['triton_variant']}"
    copy = next(
        (
            r
            for r in res["variants"]
            if r["case"].startswith(f"{res['blocks']} x ") and r["variant"] == method
        ),
        None,
    )
    if not (push and write and copy and "wall_ms" in copy):
        return
    print(
        f"\nscattered push, {method} (holds made before the pushes; write() is write_spanned): "
        f"push {push['ms']:.3f} ms = KVProducer (plan, checks) "
        f"{push['ms'] - write['ms']:.3f} + write() {write['ms']:.3f}; write() = backend (lookups, shift) "
        f"{write['ms'] - copy['wall_ms']:.3f} + CudaRuntime.copy {copy['wall_ms']:.3f} (its own "
        f"{copy['case']} slots); copy = host path and wait {copy['wall_ms'] - copy['kernel_ms']:.3f} "
        f"(enqueue alone {copy['host_ms']:.3f}: table staged {copy.get('stage_host_ms', float('nan')):.3f}, "
        f"launch {copy.get('launch_host_ms', float('nan')):.3f}) + kernel {copy['kernel_ms']:.3f}"
    )


if __name__ == "__main__":
    main()
