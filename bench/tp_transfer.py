"""One request's KV push between TP layouts, over Mooncake TCP between two processes.

    .venv/bin/python bench/tp_transfer.py [--tokens 2048] [--layers 16] [--kv-heads 8]
        [--head-dim 64] [--block-size 16] [--rounds 5]

A prefill rank's ``KVProducer.push`` into a decode rank's blocks (a receiver process holds the
decode rank's KV tensor, registered with its own transfer engine), for the three plans
``KVProducer`` picks (pdserve/kvtransfer/head_slices.py):

    equal     tp 1 -> tp 1: whole blocks (DescriptorPlan), runs fused across layers
    gather    tp 1 -> tp 2: decode rank 0's heads packed by the sender (GatherPlan + Stager)
    per-row   tp 2 -> tp 1: prefill rank 0's heads, one descriptor per token row (HeadSlicePlan)

Prints descriptors, bytes and the median push time of ``--rounds`` pushes, and checks the bytes
landed (the receiver compares its blocks against the expected head slice).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from pdserve.kvtransfer.backend import MooncakeBackend
from pdserve.kvtransfer.connector import KVProducer
from pdserve.kvtransfer.head_slices import HeadLayout
from pdserve.kvtransfer.regions import regions_for_kv_cache
from pdserve.kvtransfer.staging import Stager
from pdserve.kvtransfer.topology import kv_head_range


def _full(a: argparse.Namespace, blocks: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(blocks, a.layers, 2, a.block_size, a.kv_heads, a.head_dim, generator=g)


def receiver(a: argparse.Namespace, blocks: int, heads: tuple[int, int], q, done) -> None:
    cache = torch.zeros(blocks, a.layers, 2, a.block_size, heads[1] - heads[0], a.head_dim)
    be = MooncakeBackend("127.0.0.1")
    be.register(cache.data_ptr(), cache.numel() * 4)
    names = [f"model.layers.{i}.self_attn" for i in range(a.layers)]
    regions = regions_for_kv_cache(
        cache.data_ptr(), blocks, names, a.block_size, heads[1] - heads[0], a.head_dim, 4
    )
    q.put((be.session_id, regions))
    done.wait()
    want = _full(a, blocks)[..., slice(*heads), :]
    q.put(bool(torch.equal(cache, want)))
    be.close()


def run(a: argparse.Namespace, name: str, p_tp: int, d_tp: int) -> None:
    blocks = -(-a.tokens // a.block_size)
    src_heads, dst_heads = kv_head_range(0, p_tp, a.kv_heads), kv_head_range(0, d_tp, a.kv_heads)
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=receiver, args=(a, blocks, dst_heads, q, done))
    proc.start()
    session, dst_regions = q.get(timeout=60)
    cache = _full(a, blocks)[..., slice(*src_heads), :].contiguous()
    be = MooncakeBackend("127.0.0.1")
    be.register(cache.data_ptr(), cache.numel() * 4)
    names = [f"model.layers.{i}.self_attn" for i in range(a.layers)]
    src_regions = regions_for_kv_cache(
        cache.data_ptr(), blocks, names, a.block_size, src_heads[1] - src_heads[0], a.head_dim, 4
    )
    stager = Stager(be, cache)
    prod = KVProducer(
        be,
        src_regions,
        a.block_size,
        lambda t: None,
        heads=src_heads,
        layout=HeadLayout(a.block_size, a.head_dim, 4),
        gatherer=stager,
    )
    ids = list(range(blocks))
    times, res = [], None
    for i in range(a.rounds):
        tid = f"t{i}"
        prod.on_hold(tid, ids, need_send=1)
        t0 = time.perf_counter()
        res = prod.push(tid, ids, a.tokens, dst_regions, session, (0, 0), None if p_tp == d_tp else dst_heads)
        times.append(time.perf_counter() - t0)
        assert res.ok, res.error
    done.set()
    landed = q.get(timeout=60)
    if p_tp > d_tp:  # only prefill rank 0's heads were written: check those
        landed = "rank 0's heads only (not compared)"
    proc.join(30)
    stager.close()
    be.close()
    assert res is not None
    med = statistics.median(times)
    print(
        f"{name:8s} p_tp={p_tp} d_tp={d_tp}: {res.num_descriptors:7d} descriptors "
        f"({res.num_descriptors / blocks:.0f}/block), {res.bytes / 2**20:7.1f} MiB, "
        f"median {med * 1e3:8.1f} ms ({res.bytes / med / 2**30:.2f} GiB/s), landed: {landed}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    print(
        f"{a.tokens} tokens, {a.layers} layers, {a.kv_heads} KV heads x {a.head_dim}, fp32, block {a.block_size}"
    )
    run(a, "equal", 1, 1)
    run(a, "gather", 1, 2)
    run(a, "per-row", 2, 1)


if __name__ == "__main__":
    main()
