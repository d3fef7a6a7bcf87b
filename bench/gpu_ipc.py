"""cuda_ipc KV transport bandwidth between two processes on one GPU, against a device copy.

    PYTHONPATH=. python3 bench/gpu_ipc.py --out DIR [--prompt-tokens 2000] [--reps 50]

The receiver is a child process with a Llama-1B-shaped bf16 KV tensor (16 layers, 8 KV heads,
head_dim 64, blocks of 16 tokens); the sender holds the same layout and pushes one prompt's
blocks through ``KVProducer.push`` (regions, merged descriptors, CudaIpcBackend), with the
receiver's blocks consecutive (a fresh pool: one descriptor) and scattered (one per block). In
the same run: ``torch`` copy of the same bytes in one process (payload bytes / s, the same
count as the transport's), and a 2 GiB copy counting read + write bytes (the number
docs/benchmarks.md calls the copy bandwidth). Prints a table, writes DIR/gpu_ipc.json.
"""

from __future__ import annotations

import argparse
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

from pdserve.kvtransfer.connector import KVProducer  # noqa: E402
from pdserve.kvtransfer.cuda_ipc import CudaIpcBackend  # noqa: E402
from pdserve.kvtransfer.regions import align_regions, build_descriptors, regions_for_kv_cache  # noqa: E402

LAYERS = [f"model.layers.{i}.self_attn" for i in range(16)]
GEOM = dict(block_size=16, num_kv_heads=8, head_dim=64, elem_bytes=2)
NUM_BLOCKS = 1024

PEER = """
import sys, torch
from pdserve.kvtransfer.cuda_ipc import CudaIpcBackend
kv = torch.zeros((NUM_BLOCKS, 16, 2, 16, 8, 64), dtype=torch.bfloat16, device="cuda")
b = CudaIpcBackend()
b.register(kv.data_ptr(), kv.numel() * kv.element_size())
print(b.session_id, kv.data_ptr(), flush=True)
sys.stdin.readline()
torch.cuda.synchronize()
print(float(kv.float().abs().sum()), flush=True)
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
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen(
        [sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None and child.stdin is not None
    session, addr = child.stdout.readline().split()
    dst_regions = regions_for_kv_cache(int(addr), NUM_BLOCKS, LAYERS, **GEOM)
    kv = torch.randn((NUM_BLOCKS, 16, 2, 16, 8, 64), dtype=torch.bfloat16, device="cuda")
    backend = CudaIpcBackend()
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
    res: dict = {"prompt_tokens": args.prompt_tokens, "blocks": nblk, "rows": []}
    from pdserve.kvtransfer import cuda_ipc

    runs = [(name, dst, cuda_ipc.BATCHED_COPY_MIN) for name, dst in layouts.items()]
    # the same scattered blocks as one cudaMemcpyAsync each (the path before the batched kernel)
    runs.append(("scattered, memcpy per block", layouts["scattered"], 1 << 30))
    batched_min = cuda_ipc.BATCHED_COPY_MIN
    for name, dst_blocks, copy_min in runs:
        cuda_ipc.BATCHED_COPY_MIN = copy_min
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
                "bytes": r.bytes,
                "descriptors": r.num_descriptors,
                "ms": ms,
                "GBps": r.bytes / ms / 1e6,
            }
        )
    cuda_ipc.BATCHED_COPY_MIN = batched_min
    # The backend's write alone (descriptors built once): the copy plus the ctypes / directory
    # cost, without KVProducer's validation and descriptor building.
    descs = build_descriptors(align_regions(src_regions, dst_regions), src_blocks, layouts["consecutive"])
    wn = sum(d[2] for d in descs)
    w_ms = median_ms(lambda: backend.write(session, descs, transfer_id="w"), args.reps)
    res["rows"].append(
        {
            "layout": "consecutive, write() only",
            "bytes": wn,
            "descriptors": len(descs),
            "ms": w_ms,
            "GBps": wn / w_ms / 1e6,
        }
    )
    nbytes = res["rows"][0]["bytes"]
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy_ms = median_ms(lambda: b.copy_(a), args.reps)
    big = torch.randint(0, 255, (2 << 30,), dtype=torch.uint8, device="cuda")
    big2 = torch.empty_like(big)
    big_ms = median_ms(lambda: big2.copy_(big), 10)
    res["copy_same_bytes_ms"] = copy_ms
    res["copy_same_bytes_GBps"] = nbytes / copy_ms / 1e6
    res["copy_2GiB_rw_GBps"] = 2 * (2 << 30) / big_ms / 1e6
    child.stdin.write("sum\n")
    child.stdin.flush()
    landed = float(child.stdout.readline())
    res["receiver_abs_sum"] = landed
    res["receiver_expected_abs_sum"] = expected = float(kv[src_blocks].float().abs().sum()) * 2
    res["receiver_sum_ok"] = abs(landed - expected) <= 1e-3 * expected
    child.wait(timeout=30)
    backend.close()
    (out / "gpu_ipc.json").write_text(json.dumps(res, indent=1))
    print(
        f"\ncuda_ipc, {args.prompt_tokens}-token prompt, Llama-1B KV ({nbytes / 2**20:.1f} MiB), two processes, one GPU"
    )
    big_payload = res["copy_2GiB_rw_GBps"] / 2  # payload bytes / s of the 2 GiB copy
    print("| layout | descriptors | ms | payload GB/s | of same-size copy | of 2 GiB copy (payload) |")
    print("|---|---|---|---|---|---|")
    for row in res["rows"]:
        row["of_same_size_copy"] = row["GBps"] / res["copy_same_bytes_GBps"]
        row["of_2GiB_copy"] = row["GBps"] / big_payload
        print(
            f"| {row['layout']} | {row['descriptors']} | {row['ms']:.3f} | {row['GBps']:,.0f} | "
            f"{row['of_same_size_copy']:.2f} | {row['of_2GiB_copy']:.2f} |"
        )
    (out / "gpu_ipc.json").write_text(json.dumps(res, indent=1))
    print(
        f"| torch copy, same bytes, one process | 1 | {copy_ms:.3f} | {res['copy_same_bytes_GBps']:,.0f} | 1.00 | "
        f"{res['copy_same_bytes_GBps'] / big_payload:.2f} |\n"
        f"2 GiB device copy (read + write bytes): {res['copy_2GiB_rw_GBps']:,.0f} GB/s; "
        f"receiver's sum of what landed matches: {res['receiver_sum_ok']}"
    )
    assert res["receiver_sum_ok"], (landed, expected)


if __name__ == "__main__":
    main()
