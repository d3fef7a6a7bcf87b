"""Pipeline parallelism on this host: engine and served throughput of PP 1 / 2 / 4, and the
cost of the P4->D2 fan-out (in-process and between real node processes over Mooncake TCP).

    .venv/bin/python bench/pp.py [--num-requests 16] [--prompt-len 64] [--output-len 32]
        [--layers 4] [--hidden 256] [--transfer-tokens 2048] [--rounds 2] [--skip-served]

Part 1 drives ``LLM`` (engine core + stage 0 in this process, stages 1.. spawned, gloo on CPU)
with the same closed batch for each PP size and prints tokens/s and TTFT p50.
Part 2 ("served") starts router + prefill (pp=N) + decode (pp=N) as real processes for N in
1, 2, 4 and sends the same load through the official openai client (streaming): tokens/s and
TTFT p50 as a client sees them.
Part 3 times one request's KV transfer for a ``--transfer-tokens`` prompt between real nodes,
P1->D1 vs P4->D2 (every decode stage asks every prefill stage; pairs that share no layer move no
bytes): decode's per-pull wall time (``kv_transfer_seconds`` / pulls: all of its stages' PushKV
calls, prefill fanning each out to its stages' own Mooncake endpoints).
Part 4 is the same comparison in-process through ``KVProducer`` with the loopback backend
(alignment + descriptors + memmove only).
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

from bench._common import loadavg, pct
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


def start_cluster(model: Path, p_pp: int, d_pp: int, run_dir: Path, port_hint: int, **node: object):  # type: ignore[no-untyped-def]
    """router + prefill-0 (pp=p_pp) + decode-0 (pp=d_pp) as real processes; returns (cluster, children)."""
    from pdserve.config.cluster import ClusterConfig, default_local_cluster, write_cluster_config
    from services.launcher import pick_base_port, start_child, wait_ready

    base = pick_base_port("127.0.0.1", port_hint)  # a different block per cluster: no TIME_WAIT clash
    data = default_local_cluster(model, base).model_dump(mode="json", exclude_unset=True)
    data["router"]["local_prefill_max_tokens"] = 0  # every request goes prefill -> decode
    for n in data["nodes"]:
        n.update(node, pp=p_pp if n["role"] == "prefill" else d_pp)
    cluster = ClusterConfig.from_dict(data)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = write_cluster_config(cluster, run_dir / "cluster.yaml")
    children = [start_child(cfg, n.role, n.name, run_dir) for n in cluster.nodes]
    children.append(start_child(cfg, "router", None, run_dir))
    try:
        wait_ready(cluster, children, timeout_s=300)
    except BaseException:
        from services.launcher import stop_children

        stop_children(children)
        raise
    return cluster, children


def metric(url: str, name: str) -> float:
    import httpx

    text = httpx.get(url).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def served_run(model: Path, pp: int, args: argparse.Namespace, run_dir: Path) -> tuple[float, float]:
    import asyncio

    import openai

    from services.launcher import stop_children

    cluster, children = start_cluster(model, pp, pp, run_dir, 34000 + 100 * pp, max_model_len=512)
    name = cluster.served_name(cluster.model)
    prompts = [[(13 * i + j) % 400 + 3 for j in range(args.prompt_len)] for i in range(args.num_requests)]

    async def load() -> tuple[float, float]:
        client = openai.AsyncOpenAI(base_url=cluster.router_url + "/v1", api_key="x", max_retries=0)

        async def one(p: list[int], t0: float) -> tuple[int, float]:
            ttft, n = 0.0, 0
            stream = await client.completions.create(
                model=name,
                prompt=p,
                max_tokens=args.output_len,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for ch in stream:
                if ch.choices and ch.choices[0].text and not ttft:
                    ttft = time.perf_counter() - t0
                if ch.usage:
                    n = ch.usage.completion_tokens
            return n, ttft

        await one(prompts[0], time.perf_counter())  # warm-up (first-use costs, handshakes)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(p, t0) for p in prompts))
        dt = time.perf_counter() - t0
        await client.close()
        return sum(n for n, _ in res) / dt, pct([t for _, t in res], 0.5)

    try:
        return asyncio.run(load())
    finally:
        stop_children(children)


def served_transfer_run(
    model: Path, p_pp: int, d_pp: int, args: argparse.Namespace, run_dir: Path
) -> tuple[float, float]:
    """Decode's mean per-pull wall time (s) and bytes per pull, over ``--transfer-reps`` requests."""
    import openai

    from services.launcher import stop_children

    cluster, children = start_cluster(
        model,
        p_pp,
        d_pp,
        run_dir,
        25000 + 100 * p_pp + 10 * d_pp,  # below the ephemeral range (32768+)
        max_model_len=args.transfer_tokens + 16,
        max_num_batched_tokens=4096,
    )
    d = cluster.node("decode-0")
    murl = f"http://127.0.0.1:{d.metrics_port}/metrics"
    client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", max_retries=0, timeout=300)
    name = cluster.served_name(cluster.model)

    def ask(i: int) -> None:
        prompt = [(7 * i + j) % 400 + 3 for j in range(args.transfer_tokens)]
        client.completions.create(
            model=name, prompt=prompt, max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
        )

    try:
        ask(999)  # warm-up: handshake, first-use costs
        s0, b0 = (
            metric(murl, "pdserve:kv_transfer_seconds_total"),
            metric(murl, "pdserve:kv_transfer_bytes_total"),
        )
        for i in range(args.transfer_reps):
            ask(i)
        s1, b1 = (
            metric(murl, "pdserve:kv_transfer_seconds_total"),
            metric(murl, "pdserve:kv_transfer_bytes_total"),
        )
        assert metric(murl, "pdserve:kv_transfer_failures_total") == 0
        return (s1 - s0) / args.transfer_reps, (b1 - b0) / args.transfer_reps
    finally:
        stop_children(children)


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
    ap.add_argument("--transfer-reps", type=int, default=5)
    ap.add_argument("--transfer-hidden", type=int, default=512)
    ap.add_argument("--skip-served", action="store_true", help="parts 1 and 4 only (no node processes)")
    ap.add_argument("--skip-engine", action="store_true", help="no part 1")
    ap.add_argument("--transfer-only", action="store_true", help="part 3 (and 4) only")
    args = ap.parse_args()
    print(f"load average before: {loadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model("llama", Path(tmp) / "m", num_layers=args.layers, hidden_size=args.hidden)
        args.skip_engine = args.skip_engine or args.transfer_only
        if not args.skip_engine:
            engine_run(model, 1, args)  # warm-up: first-use costs (allocator, kernels) stay out of PP 1's row
        print(f"{'pp':>3} {'tok/s':>9} {'TTFT p50 ms':>12}")
        for _round in range(
            0 if args.skip_engine else args.rounds
        ):  # interleaved rounds: a shared host's load shifts
            for pp in (1, 2, 4):
                if pp > args.layers:
                    continue
                tps, ttft = engine_run(model, pp, args)
                print(f"{pp:>3} {tps:>9.1f} {ttft * 1e3:>12.1f}")
        if not args.skip_served:
            print(f"\nserved: router + prefill pp=N + decode pp=N, {args.num_requests} concurrent streams")
            print(f"{'pp':>3} {'tok/s':>9} {'TTFT p50 ms':>12}")
            rows: dict[int, tuple[float, float]] = {}
            for pp in () if args.transfer_only else (1, 2, 4):
                if pp <= args.layers:
                    rows[pp] = served_run(model, pp, args, Path(tmp) / f"served{pp}")
                    tps, ttft = rows[pp]
                    print(f"{pp:>3} {tps:>9.1f} {ttft * 1e3:>12.1f}  ({tps / rows[1][0]:.2f}x tok/s of pp 1)")
            tmodel = make_tiny_model(
                "llama",
                Path(tmp) / "t",
                num_layers=8,
                hidden_size=args.transfer_hidden,
                num_heads=8,
                num_kv_heads=8,
                head_dim=args.transfer_hidden // 8,
                max_position_embeddings=args.transfer_tokens + 64,
            )
            t11, b11 = served_transfer_run(tmodel, 1, 1, args, Path(tmp) / "x11")
            t42, b42 = served_transfer_run(tmodel, 4, 2, args, Path(tmp) / "x42")
            print(
                f"\nKV of a {args.transfer_tokens}-token prompt between real nodes (Mooncake TCP, loopback), "
                f"8 layers, hidden {args.transfer_hidden}, fp32; decode's pull wall time, mean of {args.transfer_reps}"
            )
            print(f"P1->D1 {t11 * 1e3:8.2f} ms  {b11 / 2**20:7.1f} MiB")
            print(f"P4->D2 {t42 * 1e3:8.2f} ms  {b42 / 2**20:7.1f} MiB  ({t42 / t11:.2f}x)")
    base = transfer_run(1, 1, args.transfer_layers, args.transfer_tokens)
    fan = transfer_run(4, 2, args.transfer_layers, args.transfer_tokens)
    print(
        f"\nKV of a {args.transfer_tokens}-token prompt, {args.transfer_layers} layers (loopback, median of 5)"
    )
    print(f"P1->D1 {base * 1e3:8.2f} ms\nP4->D2 {fan * 1e3:8.2f} ms  ({fan / base:.2f}x)")
    print(f"load average after: {loadavg()}")


if __name__ == "__main__":
    main()
