"""Host time of a KV push's descriptor planning: ``DescriptorPlan.descriptors`` (block id checks,
runs, merging) and the int64 table a cuda_ipc write copies from (``cuda_runtime.copy_table``).

    .venv/bin/python bench/kv_plan.py [--blocks 125 1000] [--reps 2000] [--cell-s 0.2]
        [--rounds 3] [--push] [--out bench/results/kv_plan.json]

Llama-1B geometry as bench/gpu_ipc.py (bf16, 16 layers, 8 KV heads, head_dim 64, blocks of 16
tokens: 32 KiB per layer and block), the plan built once as a producer keeps it. Layouts:

    fused      the engine's tensor [num_blocks, 16, 2, 16, 8, 64] on both ends: the 16 layers
               fuse into one range per block, runs of blocks into one descriptor
    half       the receiver holds layers 0-7 only (a pipeline stage): one range per block,
               blocks never chain (the strides differ)
    kv-split   a K and a V tensor per layer on both ends, [num_blocks, 16, 8, 64] each: 32
               regions that fuse with nothing (one descriptor per region and run of blocks)

``--push`` also times ``KVProducer.push`` whole (fused layout) over a ``CudaIpcBackend`` whose
CUDA calls are a no-op fake: the host part of a cuda_ipc push (checks, descriptors, the
directory lookup, the table shift to the mapping of a peer in "another process"), without the
copy; the gRPC layer's fresh ``Region`` objects and tuple of block ids each push. ``on_hold``
(the engine thread's hold before any push) is timed apart; each push is its hold's first (it
makes the held ids' ``BlockIds``).

Sender blocks are 1..n; receiver blocks are consecutive (a fresh pool) or a random sample
(scattered: every block its own run). Each cell is the median over ``--reps`` calls (fewer where
they would take over ``--cell-s``) per round; the table shows the median of the rounds' medians
and their spread (a shared host: noisy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.kvtransfer.connector import KVProducer
from pdserve.kvtransfer.cuda_ipc import CudaIpcBackend
from pdserve.kvtransfer.cuda_runtime import copy_table
from pdserve.kvtransfer.regions import (
    DescriptorPlan,
    Region,
    align_regions,
    regions_for_kv_cache,
)

LAYERS = [f"model.layers.{i}.self_attn" for i in range(16)]
GEOM = dict(block_size=16, num_kv_heads=8, head_dim=64, elem_bytes=2)
NUM_BLOCKS = 4096
HALF_BYTES = 16 * 8 * 64 * 2  # K (or V) of one layer and block
BLOCK_BYTES = 2 * HALF_BYTES * len(LAYERS)  # one block of the fused tensor
SRC_BASE, DST_BASE = 0x7F00_0000_0000, 0x7E00_0000_0000
MAPPED_SHIFT = 0x1000_0000_0000  # where the fake maps a peer's allocation, from its own address


def kv_split_regions(base: int) -> list[Region]:
    """One K and one V tensor per layer, each ``[NUM_BLOCKS, block_size, Hkv, D]``."""
    size = NUM_BLOCKS * HALF_BYTES
    return [
        Region(name, occ, base + (2 * i + occ) * size, HALF_BYTES, HALF_BYTES, NUM_BLOCKS)
        for i, name in enumerate(LAYERS)
        for occ in (0, 1)
    ]


def layouts() -> dict[str, list[tuple[Region, Region]]]:
    src = regions_for_kv_cache(SRC_BASE, NUM_BLOCKS, LAYERS, **GEOM)
    return {
        "fused": align_regions(src, regions_for_kv_cache(DST_BASE, NUM_BLOCKS, LAYERS, **GEOM)),
        "half": align_regions(src, regions_for_kv_cache(DST_BASE, NUM_BLOCKS, LAYERS[:8], **GEOM)),
        "kv-split": align_regions(kv_split_regions(SRC_BASE), kv_split_regions(DST_BASE)),
    }


def median_us(fn, reps: int, cell_s: float) -> float:
    t0 = time.perf_counter()
    fn()
    reps = max(20, min(reps, int(cell_s / max(time.perf_counter() - t0, 1e-7))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


class _NoCopyCuda:
    """``cuda_runtime.CudaApi`` over two fake allocations: no device, the copy does nothing."""

    def current_device(self) -> int:
        return 0

    def allocation_of(self, addr: int) -> tuple[int, int]:
        for base in (SRC_BASE, DST_BASE):
            if base <= addr < base + NUM_BLOCKS * BLOCK_BYTES:
                return base, NUM_BLOCKS * BLOCK_BYTES
        raise ValueError(f"{addr:#x} is host memory")

    def ipc_handle(self, base: int) -> bytes:
        return base.to_bytes(64, "little")

    def open_handle(self, handle: bytes, device: int) -> int:
        return int.from_bytes(handle, "little") + MAPPED_SHIFT  # a mapping elsewhere: a real shift

    def close_handle(self, addr: int, device: int) -> None:
        pass

    def copy(self, copies: object, device: int) -> None:
        pass


def time_pushes(blocks: list[int], rounds: int, reps: int) -> list[dict]:
    """Median us of ``KVProducer.push`` (its host part, module docstring) per round, and of the
    ``on_hold`` before it."""
    cuda = _NoCopyCuda()
    sender, receiver = CudaIpcBackend(cuda=cuda), CudaIpcBackend(cuda=cuda)
    sender.register(SRC_BASE, NUM_BLOCKS * BLOCK_BYTES)
    receiver.register(DST_BASE, NUM_BLOCKS * BLOCK_BYTES)
    receiver._process = "another"  # the directory says "another process": the IPC path, shifted
    dst_regions = regions_for_kv_cache(DST_BASE, NUM_BLOCKS, LAYERS, **GEOM)
    prod = KVProducer(sender, regions_for_kv_cache(SRC_BASE, NUM_BLOCKS, LAYERS, **GEOM), 16, lambda t: None)
    rng, rows = random.Random(1), []
    try:
        for n in blocks:
            src = list(range(1, n + 1))  # the engine's block table: a list
            for kind, dst in (
                ("consecutive", list(range(2000, 2000 + n))),
                ("scattered", rng.sample(range(NUM_BLOCKS), n)),
            ):
                us, hold_us = [], []
                for r in range(rounds):
                    times, holds = [], []
                    for i in range(reps):
                        tid = f"{kind}-{n}-{r}-{i}"
                        # what the gRPC layer hands a push: fresh regions, the ids as a tuple
                        regions = [dataclasses.replace(x) for x in dst_regions]
                        ids = tuple(dst)
                        t0 = time.perf_counter()
                        prod.on_hold(tid, src, need_send=1)
                        t1 = time.perf_counter()
                        res = prod.push(tid, ids, n * 16, regions, receiver.session_id)
                        times.append(time.perf_counter() - t1)
                        holds.append(t1 - t0)
                        assert res.ok, res.error
                    us.append(statistics.median(times) * 1e6)
                    hold_us.append(statistics.median(holds) * 1e6)
                rows.append(
                    {
                        "blocks": n,
                        "receiver": kind,
                        "push_us": statistics.median(us),
                        "push_us_rounds": us,
                        "on_hold_us": statistics.median(hold_us),
                    }
                )
                print(
                    f"| push | {n} | {kind} | {res.num_descriptors} | {statistics.median(us):.1f} | "
                    f"on_hold {statistics.median(hold_us):.1f} | {min(us):.1f}-{max(us):.1f} |",
                    flush=True,
                )
    finally:
        sender.close()
        receiver.close()
    return rows


def time_cell(
    plan: DescriptorPlan, src: list[int], dst: list[int], args: argparse.Namespace
) -> tuple[list[float], list[float]]:
    """Per round: the median us of ``descriptors()`` alone, then with the table built from it."""
    plan_us, table_us = [], []
    for _ in range(args.rounds):
        plan_us.append(median_us(lambda: plan.descriptors(src, dst), args.reps, args.cell_s))
        table_us.append(median_us(lambda: copy_table(plan.descriptors(src, dst)), args.reps, args.cell_s))
    return plan_us, table_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="+", default=[125, 1000])
    ap.add_argument("--reps", type=int, default=2000, help="calls per round and cell, at most")
    ap.add_argument("--cell-s", type=float, default=0.2, help="seconds per round and cell, about")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--push", action="store_true", help="also time KVProducer.push (a no-op copy)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/kv_plan.json"))
    args = ap.parse_args()
    rng = random.Random(0)
    rows = []
    print("| layout | blocks | receiver | descriptors | plan us | plan + table us | spread (plan) |")
    print("|---|---|---|---|---|---|---|")
    for name, pairs in layouts().items():
        plan = DescriptorPlan(pairs)
        for n in args.blocks:
            src = list(range(1, n + 1))
            for kind, dst in (
                ("consecutive", list(range(2000, 2000 + n))),
                ("scattered", rng.sample(range(NUM_BLOCKS), n)),
            ):
                plan_us, table_us = time_cell(plan, src, dst, args)
                row = {
                    "layout": name,
                    "blocks": n,
                    "receiver": kind,
                    "descriptors": len(plan.descriptors(src, dst)),
                    "plan_us": statistics.median(plan_us),
                    "plan_table_us": statistics.median(table_us),
                    "plan_us_rounds": plan_us,
                    "plan_table_us_rounds": table_us,
                }
                rows.append(row)
                print(
                    f"| {name} | {n} | {kind} | {row['descriptors']} | {row['plan_us']:.1f} | "
                    f"{row['plan_table_us']:.1f} | {min(plan_us):.1f}-{max(plan_us):.1f} |",
                    flush=True,
                )
    pushes = time_pushes(args.blocks, args.rounds, 200) if args.push else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"reps": args.reps, "cell_s": args.cell_s, "rounds": args.rounds}
    args.out.write_text(json.dumps({**meta, "rows": rows, "pushes": pushes}, indent=1))


if __name__ == "__main__":
    main()
