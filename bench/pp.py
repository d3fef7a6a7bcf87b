"""Pipeline parallelism on this host: engine throughput of PP 1 / 2 / 4, and the P4->D2 fan-out.

    .venv/bin/python bench/pp.py [--num-requests 16] [--prompt-len 64] [--output-len 32]
        [--layers 4] [--hidden 256] [--transfer-tokens 2048] [--rounds 2]

Part 1 drives ``LLM`` (engine core + stage 0 in this process, stages 1.. spawned, gloo on CPU)
with the same closed batch for each PP size and prints tokens/s and TTFT p50.
Part 2 times what the stage topology adds to one request's KV push: P1->D1 (one stage pair)
vs P4->D2 (every D stage asks every P stage; pairs sharing no layer move no bytes), through
``KVProducer`` with the in-process loopback backend: alignment + descriptors + memmove, NOT a
Mooncake TCP transfer (stage-aware pushes between nodes are not wired yet; see the README).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench._common import loadavg
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.backend import LoopbackBackend
from pdserve.kvtransfer.connector import KVProducer
from pdserve.kvtransfer.regions import regions_for_kv_cache
from pdserve.kvtransfer.send_tracker import KVSendTracker
from pdserve.kvtransfer.topology import need_send, prefill_stages_to_ask, split_layers
from pdserve.models.make_model import make_tiny_model


def engine_run(model: Path, pp: int, args: argparse.Namespace) -> tuple[float, float]:
    prompts = [[(13 * i + j) % 400 + 1 for j in range(args.prompt_len)] for i in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    with LLM(str(model), device="cpu", dtype="float32", pipeline_parallel_size=pp, max_model_len=512) as llm:
        eng = llm.engine
        t0 = time.perf_counter()
        first: dict[str, float] = {}
        for i, p in enumerate(prompts):
            eng.add_request(p, params, request_id=f"r{i}")
        ntok = 0
        while eng.has_unfinished():
            for d in eng.step():
                ntok += len(d.token_ids)
                if d.token_ids and d.request_id not in first:
                    first[d.request_id] = time.perf_counter() - t0
        dt = time.perf_counter() - t0
    return ntok / dt, statistics.median(first.values())


GEOM = dict(block_size=16, num_kv_heads=8, head_dim=64, elem_bytes=2)  # a 1B-shaped bf16 KV


def transfer_run(p_pp: int, d_pp: int, layers: int, tokens: int, reps: int = 5) -> float:
    """Seconds for every decode stage to pull one request's KV from the prefill stages it asks."""
    nblocks = -(-tokens // GEOM["block_size"])
    names = [f"model.layers.{i}.self_attn" for i in range(layers)]
    per_block = 2 * GEOM["block_size"] * GEOM["num_kv_heads"] * GEOM["head_dim"]

    def stage(r: tuple[int, int]) -> tuple[torch.Tensor, LoopbackBackend, list]:
        cache = torch.ones(nblocks, r[1] - r[0], per_block, dtype=torch.bfloat16)
        be = LoopbackBackend()
        be.register(cache.data_ptr(), cache.numel() * 2)
        return cache, be, regions_for_kv_cache(cache.data_ptr(), nblocks, names[r[0] : r[1]], **GEOM)

    p_stages = [stage(r) for r in split_layers(layers, p_pp)]
    d_stages = [stage(r) for r in split_layers(layers, d_pp)]
    times = []
    for rep in range(reps):
        tracker = KVSendTracker(free_fn=lambda _t, _b: None, lease_s=60.0)
        prods = [
            KVProducer(be, regs, 16, lambda _t: None, stage=i, num_stages=p_pp, tracker=tracker)
            for i, (_c, be, regs) in enumerate(p_stages)
        ]
        tid = f"t{rep}"
        prods[0].on_hold(tid, list(range(nblocks)), need_send(1, p_pp, 1, d_pp))
        t0 = time.perf_counter()
        for d, (_c, be, regs) in enumerate(d_stages):
            for p in prefill_stages_to_ask(d, p_pp, d_pp):
                prods[p].push(tid, list(range(nblocks)), tokens, regs, be.session_id, consumer=(d, 0))
        times.append(time.perf_counter() - t0)
        assert tid not in tracker, "every stage reached its count: freed"
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--transfer-tokens", type=int, default=2048)
    ap.add_argument("--transfer-layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(f"load average before: {loadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model("llama", Path(tmp) / "m", num_layers=args.layers, hidden_size=args.hidden)
        engine_run(model, 1, args)  # warm-up: first-use costs (allocator, kernels) stay out of PP 1's row
        print(f"{'pp':>3} {'tok/s':>9} {'TTFT p50 ms':>12}")
        for _round in range(args.rounds):  # interleaved rounds: a shared host's load shifts
            for pp in (1, 2, 4):
                if pp > args.layers:
                    continue
                tps, ttft = engine_run(model, pp, args)
                print(f"{pp:>3} {tps:>9.1f} {ttft * 1e3:>12.1f}")
    base = transfer_run(1, 1, args.transfer_layers, args.transfer_tokens)
    fan = transfer_run(4, 2, args.transfer_layers, args.transfer_tokens)
    print(
        f"\nKV of a {args.transfer_tokens}-token prompt, {args.transfer_layers} layers (loopback, median of 5)"
    )
    print(f"P1->D1 {base * 1e3:8.2f} ms\nP4->D2 {fan * 1e3:8.2f} ms  ({fan / base:.2f}x)")
    print(f"load average after: {loadavg()}")


if __name__ == "__main__":
    main()
