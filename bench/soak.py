"""Soak: many concurrent streams through router -> prefill -> decode for minutes.

    PYTHONPATH=$PWD .venv/bin/python bench/soak.py [--streams 256] [--seconds 300]
                                                   [--warmup-s 30] [--out bench/results/soak.json]

Real processes (the local cluster of ``pdserve up``: router, prefill-0, decode-0; tiny random
Llama). ``--streams`` clients loop for ``--seconds``, each sending streaming completions with
the official ``openai`` client: prompts mixed short (local path, < 32 tokens) and long
(~200 tokens, disaggregated), 8-48 new tokens. Reported:

- requests, errors (any exception or error event), tokens/s;
- KV leases that expired on prefill (``KV lease expired`` in its log: a request still alive lost
  its KV) and decode's failed pulls / keep-alive answers "unknown";
- free KV blocks at the start and after the run (must be equal: nothing held);
- RSS of each node process after the warm-up and at the end (growth must stay < 5 %), and a
  timeline of it every ``--rss-every-s`` seconds (a trend, not only two points);
- the router's failed legs by role and gRPC status, and requests by path (a prefill leg past
  ``router.prefill_timeout_s`` shows as a DEADLINE_EXCEEDED prefill leg and a local_fallback).

Pass/fail is the exit status (0: every criterion met).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import openai

from bench._common import log
from tests.e2e.cluster import running_cluster
from tests.e2e.lifecycle_helpers import isolated_cluster_config, wait_nothing_held

WORDS = "the quick brown fox jumps over a lazy dog while servers move caches between nodes".split()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def router_samples(rc: Any, prefix: str) -> dict[str, float]:
    text = httpx.get(rc.cluster.router_url + "/metrics", timeout=5).text
    return {ln.split()[0]: float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(prefix)}


def node_metric(rc: Any, node: str, name: str) -> float:
    n = rc.node(node)
    text = httpx.get(f"http://{n.metrics_address}/metrics", timeout=5).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + "{"))


async def client_loop(rc: Any, seed: int, stop_at: float, stats: dict[str, Any]) -> None:
    rng = random.Random(seed)
    c = openai.AsyncOpenAI(base_url=rc.base_url, api_key="x", max_retries=0, timeout=120)
    try:
        while time.monotonic() < stop_at:
            n_words = rng.choice([4, 8, 150, 200])  # short: local path; long: disaggregated
            prompt = " ".join(rng.choice(WORDS) for _ in range(n_words))
            try:
                stream = await c.completions.create(
                    model=rc.model_name,
                    prompt=prompt,
                    max_tokens=rng.randint(8, 48),
                    stream=True,
                    temperature=0.8,
                    seed=rng.randrange(1 << 30),
                    extra_body={"ignore_eos": True},
                )
                async for chunk in stream:
                    stats["tokens"] += 1 if chunk.choices and chunk.choices[0].text is not None else 0
                stats["requests"] += 1
            except openai.APIError as e:
                stats["errors"] += 1
                stats["error_samples"].append(
                    f"{type(e).__name__}: {str(e)[:120]} (cause {e.__cause__!r:.120})"
                )
    finally:
        await c.close()


async def run(args: argparse.Namespace, rc: Any) -> dict[str, Any]:
    pids = {c.name: c.proc.pid for c in rc.children}
    free0 = {n: rc.load(n).num_blocks_total - rc.load(n).num_blocks_used for n in ("prefill-0", "decode-0")}
    fail0 = node_metric(rc, "decode-0", "pdserve:kv_transfer_failures_total")
    unk0 = node_metric(rc, "decode-0", "pdserve:kv_keepalive_unknown_total")
    stats: dict[str, Any] = {"requests": 0, "errors": 0, "tokens": 0, "error_samples": []}
    t0 = time.monotonic()
    stop_at = t0 + args.seconds
    tasks = [asyncio.ensure_future(client_loop(rc, i, stop_at, stats)) for i in range(args.streams)]
    timeline: list[dict[str, float]] = []

    async def sample_rss() -> None:
        while time.monotonic() < stop_at:
            timeline.append(
                {"t": round(time.monotonic() - t0), **{n: round(rss_mib(p), 1) for n, p in pids.items()}}
            )
            await asyncio.sleep(args.rss_every_s)

    sampler = asyncio.ensure_future(sample_rss())
    await asyncio.sleep(min(args.warmup_s, args.seconds / 2))
    rss_warm = {n: rss_mib(p) for n, p in pids.items()}
    log(f"warm: {stats['requests']} requests, RSS {rss_warm}")
    await asyncio.gather(*tasks)
    took = time.monotonic() - t0
    sampler.cancel()
    rss_end = {n: rss_mib(p) for n, p in pids.items()}
    wait_nothing_held(rc, ["prefill-0", "decode-0"], timeout_s=30)
    free1 = {n: rc.load(n).num_blocks_total - rc.load(n).num_blocks_used for n in ("prefill-0", "decode-0")}
    expired = (rc.run_dir / "prefill-0.log").read_text(errors="replace").count("KV lease expired")
    growth = {n: round(100 * (rss_end[n] / rss_warm[n] - 1), 2) for n in pids}
    return {
        "streams": args.streams,
        "seconds": round(took, 1),
        "requests": stats["requests"],
        "errors": stats["errors"],
        "error_samples": stats["error_samples"][:5],
        "tokens_per_s": round(stats["tokens"] / took, 1),
        "lease_expiries": expired,
        "decode_pull_failures": node_metric(rc, "decode-0", "pdserve:kv_transfer_failures_total") - fail0,
        "keepalive_unknown": node_metric(rc, "decode-0", "pdserve:kv_keepalive_unknown_total") - unk0,
        "keepalive_transfers": node_metric(rc, "decode-0", "pdserve:kv_keepalive_transfers_total"),
        "free_blocks_start": free0,
        "free_blocks_end": free1,
        "rss_mib_warm": {n: round(v, 1) for n, v in rss_warm.items()},
        "rss_mib_end": {n: round(v, 1) for n, v in rss_end.items()},
        "rss_growth_pct": growth,
        "rss_timeline_mib": timeline,
        "router_leg_failures": router_samples(rc, "pdserve:router_leg_failures_total"),
        "router_paths": router_samples(rc, "pdserve:router_requests_by_path_total"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--warmup-s", type=float, default=30.0)
    ap.add_argument("--rss-every-s", type=float, default=15.0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the node processes
    from pdserve.models.make_model import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    model = make_tiny_model("llama", root / "model")
    cfg = isolated_cluster_config(model, router={"request_timeout_s": 600})
    with running_cluster(cfg, root / "run") as rc:
        res = asyncio.run(run(args, rc))
    ok = (
        res["errors"] == 0
        and res["lease_expiries"] == 0
        and res["decode_pull_failures"] == 0
        and res["free_blocks_start"] == res["free_blocks_end"]
        and all(g < 5 for g in res["rss_growth_pct"].values())
    )
    res["pass"] = ok
    print(json.dumps(res, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
