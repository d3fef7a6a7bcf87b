"""A fleet of 2 prefill + 2 decode nodes (CPU, tiny random Llama, real processes, a real
redis-server): TTFT p50 / p90 / p99 and prompt tokens computed under prefix_affinity (the prompt
hash), least_loaded and cache_aware routing, on two workloads run one after the other on each
policy's own fresh cluster:

    multi-turn     N conversations x T turns, the follow-ups' prompts = history + 12 new tokens
    shared-system  N one-turn requests: one system prompt, then each its own question

    PYTHONPATH=$PWD .venv/bin/python bench/fleet.py [--convs 16] [--turns 4] [--out FILE]
        [--model-dir DIR] [--first-len 40] [--turn-len 12] [--workloads multi_turn,shared_system]

``--model-dir`` serves a local checkpoint (e.g. SmolLM2-135M as bench/real_cpu.py finds it) instead
of the tiny random Llama; ``--first-len`` makes each conversation's opening that long, so a
follow-up's history (1-2k tokens) costs a real prefill where it is not cached. The first turn of
every conversation is cold under every policy: with T turns, 1 / T of the requests are cold, and
TTFT p90 can only show routing when that share is under 10 % (T > 10).

Requests go one at a time (TTFT at concurrency 1; a shuffled order within each turn, a 0.3 s
pause between turns), or with ``--concurrency C`` C conversations at a time, each its turns in
order with a 0.3 s pause (at concurrency 1 least_loaded sends every request to the first, idle
node, which then holds every history: no policy can beat that). Prompt tokens computed = prompt tokens sent - prefix-cache hits, from the
nodes' own counters (pdserve:prefix_cache_hit_blocks).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import loadavg, log, pct
from bench.fleet_workload import (
    Conversation,
    PieceIds,
    fleet_cluster,
    hit_blocks,
    multi_turn,
    node_counters,
    run_concurrent,
    run_workload,
    shared_system_prompt,
)

BS = 16
POLICIES = ("prefix_affinity", "least_loaded", "cache_aware")


def _summary(convs: list[Conversation], hits: float) -> dict[str, float]:
    ttfts = [t * 1000 for c in convs for t in c.ttfts_s]
    follow_ups = [t * 1000 for c in convs for t in c.ttfts_s[1:]]  # where routing can matter
    sent = sum(len(p) for c in convs for p in c.prompts)
    return {
        "requests": len(ttfts),
        "ttft_p50_ms": round(pct(ttfts, 0.5), 1),
        "ttft_p90_ms": round(pct(ttfts, 0.9), 1),
        "ttft_p99_ms": round(pct(ttfts, 0.99), 1),
        "follow_up_ttft_p50_ms": round(pct(follow_ups, 0.5), 1),
        "follow_up_ttft_p90_ms": round(pct(follow_ups, 0.9), 1),
        "prompt_tokens": sent,
        "prompt_tokens_computed": int(sent - hits * BS),
        "local_path": sum(r.get("x-pdserve-path") == "local" for c in convs for r in c.routes),
    }


def main() -> None:
    import openai

    from pdserve.config.cluster import write_cluster_config
    from pdserve.models.loader import load_tokenizer
    from pdserve.models.make_model import make_tiny_model
    from services.launcher import start_child, stop_children, wait_ready
    from tests.registry.redis_proc import RedisProcess

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--convs", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--model-dir", type=Path, default=None, help="a local checkpoint (default: tiny Llama)")
    ap.add_argument("--first-len", type=int, default=40, help="tokens of each conversation's opening")
    ap.add_argument("--turn-len", type=int, default=12, help="new tokens of each follow-up")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--workloads", default="multi_turn,shared_system")
    ap.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="each node's KV cache")
    ap.add_argument(
        "--concurrency", type=int, default=1, help="conversations at a time (1: turn by turn, shuffled)"
    )
    ap.add_argument("--local-prefill-max-tokens", type=int, default=32, help="router setting, every policy")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pdserve-fleet-"))
    model_dir = args.model_dir or make_tiny_model("llama", work / "model")
    pieces = PieceIds(load_tokenizer(model_dir))
    redis = RedisProcess().start()
    results: dict[str, dict[str, dict[str, float]]] = {}
    log(f"load average before: {loadavg()}")
    try:
        for policy in args.policies.split(","):
            cluster = fleet_cluster(
                str(model_dir),
                redis.url,
                policy,
                2,
                2,
                25000,
                node_settings={"kv_cache_memory_bytes": args.kv_cache_bytes},
                local_prefill_max_tokens=args.local_prefill_max_tokens,
                # cold prefills of long histories, several at once on a loaded CPU host
                prefill_timeout_s=300.0,
                decode_first_token_timeout_s=300.0,
            )
            run_dir = work / policy
            run_dir.mkdir()
            cfg = write_cluster_config(cluster, run_dir / "cluster.yaml")
            children = [start_child(cfg, n.role, n.name, run_dir) for n in cluster.nodes]
            children.append(start_child(cfg, "router", None, run_dir))
            try:
                wait_ready(cluster, children, timeout_s=300)
                client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="unused", max_retries=0)
                model = cluster.served_name(cluster.model)
                results[policy] = {}
                workloads = {
                    "multi_turn": lambda: multi_turn(
                        args.convs, args.turns, first_len=args.first_len, turn_len=args.turn_len, seed=1
                    ),
                    "shared_system": lambda: shared_system_prompt(args.convs, args.system_len, 24, seed=5),
                }
                for name in args.workloads.split(","):
                    convs = workloads[name]()
                    before = node_counters(cluster)
                    if args.concurrency > 1:
                        run_concurrent(client, model, convs, args.max_tokens, pieces, args.concurrency, 0.3)
                    else:
                        run_workload(client, model, convs, args.max_tokens, pieces, seed=2, think_s=0.3)
                    results[policy][name] = _summary(convs, hit_blocks(before, node_counters(cluster)))
                    log(f"{policy} {name}: {results[policy][name]}")
            finally:
                stop_children(children)
    finally:
        redis.stop()
    log(f"load average after: {loadavg()}")
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
