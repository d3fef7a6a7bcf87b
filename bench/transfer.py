"""KV transfer throughput on loopback: pdserve's write path vs raw Mooncake TransferEngine calls.

Two processes (prefill writer here, decode target spawned), TCP, P2PHANDSHAKE, 127.0.0.1. The KV
cache is Llama-3.2-1B shaped: [num_blocks, 16 layers, 2, 16 tokens, 8 kv heads, 64] bf16, so one
block of all layers is 512 KiB. For each size it times:

    pdserve          build_descriptors + MooncakeBackend.write, consecutive blocks on both sides
    pdserve-scatter  same, decode blocks in shuffled order (one descriptor per block)
    raw-1desc        TransferEngine.batch_transfer_sync_write with one descriptor (the ceiling)
    raw-per-layer    raw calls, one descriptor per (block, layer), chunked at 2,048 (no merging)

Usage: python bench/transfer.py [--sizes-mib 1,16,256] [--out bench/results/transfer.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from pdserve.kvtransfer.backend import MooncakeBackend, TransferError
from pdserve.kvtransfer.regions import (
    MAX_DESCRIPTORS_PER_BATCH,
    align_regions,
    build_descriptors,
    regions_for_kv_cache,
    split_batches,
)

# Llama-3.2-1B: 16 layers, 8 KV heads, head_dim 64, bf16; block_size 16
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, ELEM_BYTES = 16, 8, 64, 16, 2
LAYERS = [f"model.layers.{i}.self_attn" for i in range(NUM_LAYERS)]
LAYER_BYTES = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * ELEM_BYTES  # 32 KiB
BLOCK_BYTES = NUM_LAYERS * LAYER_BYTES  # 512 KiB
HOST = "127.0.0.1"


def kv_shape(num_blocks: int) -> tuple[int, ...]:
    return (num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)


def _sha_blocks(cache: torch.Tensor, block_ids: list[int]) -> str:
    return hashlib.sha256(cache[block_ids].contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def decode_peer(conn, num_blocks: int) -> None:
    """Target process: registers a zeroed KV cache, answers hash requests until told to quit."""
    backend = MooncakeBackend(host=HOST)
    cache = torch.zeros(kv_shape(num_blocks), dtype=torch.bfloat16)
    backend.register(cache.data_ptr(), cache.numel() * ELEM_BYTES)
    conn.send((backend.session_id, cache.data_ptr()))
    while True:
        cmd, arg = conn.recv()
        if cmd == "quit":
            break
        if cmd == "zero":
            cache.zero_()
            conn.send(None)
            continue
        conn.send(_sha_blocks(cache, arg))
    backend.close()


def pd_write(backend, peer, pairs, src_ids, dst_ids) -> None:
    """pdserve's write path: descriptors from regions and block ids, then one batched write."""
    backend.write(peer, build_descriptors(pairs, src_ids, dst_ids), transfer_id="bench")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", default="1,16,256")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions (0: by size)")
    ap.add_argument("--out", default="bench/results/transfer.json")
    args = ap.parse_args()

    cases = [(f"{s} MiB", int(s) * 1024 * 1024 // BLOCK_BYTES) for s in args.sizes_mib.split(",")]
    n_prompt = -(-args.prompt_tokens // BLOCK_SIZE)
    cases.append((f"Llama-1B KV, {args.prompt_tokens} tok", n_prompt))
    num_blocks = max(n for _, n in cases)

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=decode_peer, args=(child, num_blocks), daemon=True)
    proc.start()
    peer, dst_base = conn.recv()

    backend = MooncakeBackend(host=HOST)
    src = torch.empty(kv_shape(num_blocks), dtype=torch.bfloat16)
    src.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(0))
    src_base, cache_bytes = src.data_ptr(), src.numel() * ELEM_BYTES
    backend.register(src_base, cache_bytes)

    from mooncake.engine import TransferEngine

    raw = TransferEngine()
    assert raw.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    assert raw.register_memory(src_base, cache_bytes) == 0

    def raw_write(descs):
        for batch in split_batches(descs, MAX_DESCRIPTORS_PER_BATCH):
            s, d, n = (list(c) for c in zip(*batch, strict=True))
            rc = raw.batch_transfer_sync_write(peer, s, d, n)
            if rc < 0:
                raise TransferError(peer, "bench", "raw write", rc)

    pairs = align_regions(
        regions_for_kv_cache(src_base, num_blocks, LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, ELEM_BYTES),
        regions_for_kv_cache(dst_base, num_blocks, LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, ELEM_BYTES),
    )
    rng = random.Random(0)
    rows = []
    for name, n in cases:
        nbytes = n * BLOCK_BYTES
        reps = args.reps or (20 if nbytes <= 16 << 20 else 5)
        ids = list(range(n))
        shuffled = rng.sample(range(num_blocks), n)
        offsets = [b * BLOCK_BYTES + i * LAYER_BYTES for b in ids for i in range(NUM_LAYERS)]
        per_layer_descs = [(src_base + off, dst_base + off, LAYER_BYTES) for off in offsets]

        one_run = [(src_base, dst_base, nbytes)]
        chunk_1m = [(src_base + o, dst_base + o, min(1 << 20, nbytes - o)) for o in range(0, nbytes, 1 << 20)]
        variants = [  # (method, timed call, descriptors it moves, decode block ids it fills)
            (
                "pdserve",
                partial(pd_write, backend, peer, pairs, ids, ids),
                build_descriptors(pairs, ids, ids),
                ids,
            ),
            (
                "pdserve-scatter",
                partial(pd_write, backend, peer, pairs, ids, shuffled),
                build_descriptors(pairs, ids, shuffled),
                shuffled,
            ),
            ("raw-1desc", partial(raw_write, one_run), one_run, ids),
            ("raw-per-layer", partial(raw_write, per_layer_descs), per_layer_descs, ids),
            ("raw-1MiB-chunks", partial(raw_write, chunk_1m), chunk_1m, ids),
        ]
        exact: dict[str, bool] = {}
        for method, fn, _descs, dst_ids in variants:  # correctness, one variant at a time
            conn.send(("zero", None))
            conn.recv()
            fn()
            conn.send(("sha", dst_ids))
            exact[method] = conn.recv() == _sha_blocks(src, ids)
        # Timing round-robin over the variants, so load from other processes hits all alike.
        times: dict[str, list[float]] = {m: [] for m, *_ in variants}
        for fn in (v[1] for v in variants):
            fn()  # warm-up: connection set-up and first-touch page faults stay out of the numbers
        for _ in range(reps):
            for method, fn, _descs, _ids in variants:
                t0 = time.perf_counter()
                fn()
                times[method].append(time.perf_counter() - t0)
        base_gbps = nbytes / statistics.median(times["raw-1desc"]) / 1e9
        for method, _fn, descs, _ids in variants:
            med = statistics.median(times[method])
            rows.append(
                dict(
                    case=name,
                    method=method,
                    bytes=nbytes,
                    blocks=n,
                    descriptors=len(descs),
                    reps=reps,
                    median_s=med,
                    min_s=min(times[method]),
                    gb_per_s=nbytes / med / 1e9,
                    ratio_vs_raw_1desc=nbytes / med / 1e9 / base_gbps,
                    byte_exact=exact[method],
                )
            )

    print(f"{'case':<24}{'method':<17}{'MiB':>7}{'descs':>7}{'median ms':>11}{'GB/s':>8}{'vs raw':>8}  exact")
    for r in rows:
        print(
            f"{r['case']:<24}{r['method']:<17}{r['bytes'] / 2**20:>7.0f}{r['descriptors']:>7}"
            f"{r['median_s'] * 1e3:>11.2f}{r['gb_per_s']:>8.2f}{r['ratio_vs_raw_1desc']:>8.2f}  {r['byte_exact']}"
        )

    conn.send(("quit", None))
    proc.join(30)
    backend.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        host=platform.node(),
        cpus=os.cpu_count(),
        torch=torch.__version__,
        transport="tcp loopback",
        layout="[num_blocks, 16, 2, 16, 8, 64] bf16",
    )
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print(f"wrote {out}")
    if not all(r["byte_exact"] for r in rows):
        sys.exit("some transfers were not byte-exact")


if __name__ == "__main__":
    main()
