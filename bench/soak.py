"""Soak: many concurrent streams through router -> prefill -> decode for minutes.

    PYTHONPATH=$PWD .venv/bin/python bench/soak.py [--streams 256] [--seconds 300] [--warmup-s 30]
                                                   [--window-s 60] [--out bench/results/soak.json]

Real processes (the local cluster of ``pdserve up``: router, prefill-0, decode-0; tiny random
Llama). ``--streams`` clients loop for ``--seconds``, each sending streaming completions with
the official ``openai`` client: prompts mixed short (local path, < 32 tokens) and long
(~200 tokens, disaggregated), 8-48 new tokens. Reported:

- requests, errors (any exception or error event), tokens/s;
- KV leases that expired on prefill (``KV lease expired`` in its log: a request still alive lost
  its KV) and decode's failed pulls / keep-alive answers "unknown";
- free KV blocks at the start and after the run (must be equal: nothing held);
- memory of each process at the start and end of every ``--window-s`` window after the warm-up
  and a timeline every ``--rss-every-s`` seconds: RSS, and for prefill and decode its split into
  the CPU KV cache's resident pages (``pdserve:kv_cache_resident_bytes``: a block's pages become
  resident on its first use and never-used blocks are handed out first, so this part grows up
  to the cache's size under load, a bound, not a leak) and the rest, whose growth from the end
  of the warm-up to the end must stay < 5 %;
- per-request maps left on prefill and decode once the load ended
  (``pdserve:request_state_entries``, must all be 0);
- the router's failed legs by role and gRPC status, and requests by path (a prefill leg past
  ``router.prefill_timeout_s`` shows as a DEADLINE_EXCEEDED prefill leg and a local_fallback).

The last line says PASS or FAIL with the figures; the exit status says the same (0: every
criterion met).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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


def memory_mib(rc: Any, pids: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per process: RSS, and for engine nodes the CPU KV cache's resident part and the rest.
    The KV cache's pages become resident on a block's first use (never-used blocks are handed
    out first), so that part grows up to the cache's size under load; the rest must stay flat."""
    out = {}
    for name, pid in pids.items():
        rss = rss_mib(pid)
        kv = node_metric(rc, name, "pdserve:kv_cache_resident_bytes") / 2**20 if name != "router" else 0.0
        out[name] = {"rss": round(rss, 1), "kv": round(kv, 1), "rest": round(rss - kv, 1)}
    return out


def growth_pct(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]], key: str) -> dict[str, float]:
    return {n: round(100 * (b[n][key] / a[n][key] - 1), 2) for n in a}


def request_state_left(rc: Any, names: list[str]) -> dict[str, dict[str, float]]:
    """Non-zero ``pdserve:request_state_entries`` per node (every per-request map; {} when idle)."""
    left: dict[str, dict[str, float]] = {}
    for name in names:
        n = rc.node(name)
        text = httpx.get(f"http://{n.metrics_address}/metrics", timeout=5).text
        for ln in text.splitlines():
            if ln.startswith("pdserve:request_state_entries{") and float(ln.split()[-1]) != 0:
                left.setdefault(name, {})[ln.split('map="')[1].split('"')[0]] = float(ln.split()[-1])
    return left


async def run(args: argparse.Namespace, rc: Any) -> dict[str, Any]:
    pids = {c.name: c.proc.pid for c in rc.children}
    nodes = ["prefill-0", "decode-0"]
    free0 = {n: rc.load(n).num_blocks_total - rc.load(n).num_blocks_used for n in nodes}
    fail0 = node_metric(rc, "decode-0", "pdserve:kv_transfer_failures_total")
    unk0 = node_metric(rc, "decode-0", "pdserve:kv_keepalive_unknown_total")
    stats: dict[str, Any] = {"requests": 0, "errors": 0, "tokens": 0, "error_samples": []}
    t0 = time.monotonic()
    stop_at = t0 + args.seconds
    load: list[float] = []
    tasks = [asyncio.ensure_future(client_loop(rc, i, stop_at, stats)) for i in range(args.streams)]
    timeline: list[dict[str, Any]] = []

    async def sample() -> None:
        while time.monotonic() < stop_at:
            mem = await asyncio.to_thread(memory_mib, rc, pids)
            timeline.append({"t": round(time.monotonic() - t0), **mem})
            load.append(os.getloadavg()[0])
            await asyncio.sleep(args.rss_every_s)

    sampler = asyncio.ensure_future(sample())
    warm_s = min(args.warmup_s, args.seconds / 2)
    await asyncio.sleep(warm_s)
    # windows of --window-s after the warm-up: memory at the start and end of each
    windows: list[dict[str, Any]] = []
    w_start = await asyncio.to_thread(memory_mib, rc, pids)
    log(f"warm: {stats['requests']} requests, memory {w_start}")
    t_w = time.monotonic()
    while t_w < stop_at - args.window_s / 2:
        t_next = t_w + args.window_s if t_w + 1.5 * args.window_s < stop_at else stop_at - 0.5
        await asyncio.sleep(max(0.0, t_next - time.monotonic()))
        w_end = await asyncio.to_thread(memory_mib, rc, pids)
        windows.append(
            {
                "from_s": round(t_w - t0),
                "to_s": round(time.monotonic() - t0),
                "requests_so_far": stats["requests"],
                "start_mib": w_start,
                "end_mib": w_end,
                "rest_growth_pct": growth_pct(w_start, w_end, "rest"),
            }
        )
        log(f"window {windows[-1]['from_s']}-{windows[-1]['to_s']} s: {windows[-1]['rest_growth_pct']}")
        w_start, t_w = w_end, time.monotonic()
    await asyncio.gather(*tasks)
    took = time.monotonic() - t0
    sampler.cancel()
    wait_nothing_held(rc, nodes, timeout_s=30)
    idle = await asyncio.to_thread(memory_mib, rc, pids)
    left = request_state_left(rc, nodes)
    free1 = {n: rc.load(n).num_blocks_total - rc.load(n).num_blocks_used for n in nodes}
    expired = (rc.run_dir / "prefill-0.log").read_text(errors="replace").count("KV lease expired")
    first, last = windows[0]["start_mib"], windows[-1]["end_mib"]
    return {
        "streams": args.streams,
        "seconds": round(took, 1),
        "warmup_s": warm_s,
        "requests": stats["requests"],
        "errors": stats["errors"],
        "error_samples": stats["error_samples"][:5],
        "tokens_per_s": round(stats["tokens"] / took, 1),
        "loadavg_1m_min_mean_max": [
            round(min(load), 2),
            round(sum(load) / len(load), 2),
            round(max(load), 2),
        ],
        "lease_expiries": expired,
        "decode_pull_failures": node_metric(rc, "decode-0", "pdserve:kv_transfer_failures_total") - fail0,
        "keepalive_unknown": node_metric(rc, "decode-0", "pdserve:kv_keepalive_unknown_total") - unk0,
        "keepalive_transfers": node_metric(rc, "decode-0", "pdserve:kv_keepalive_transfers_total"),
        "free_blocks_start": free0,
        "free_blocks_end": free1,
        "request_state_left": left,
        "kv_cache_bytes": {n: node_metric(rc, n, "pdserve:kv_cache_budget_bytes") for n in nodes},
        "windows": windows,
        "memory_mib_after_warmup": first,
        "memory_mib_end": last,
        "memory_mib_idle_after": idle,
        "rss_growth_pct": growth_pct(first, last, "rss"),
        "rest_growth_pct": growth_pct(first, last, "rest"),
        "timeline_mib": timeline,
        "router_leg_failures": router_samples(rc, "pdserve:router_leg_failures_total"),
        "router_paths": router_samples(rc, "pdserve:router_requests_by_path_total"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--warmup-s", type=float, default=30.0)
    ap.add_argument("--rss-every-s", type=float, default=15.0)
    ap.add_argument("--window-s", type=float, default=60.0, help="memory windows after the warm-up")
    # 16,384 blocks of the tiny model: every block used once within a 60 s warm-up at 128 streams,
    # so growth after it is not the KV cache (and its blocks' bookkeeping) filling on first use
    ap.add_argument("--kv-cache-bytes", type=int, default=128 << 20, help="each node's KV cache")
    ap.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the node processes
    from pdserve.models.make_model import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    model = make_tiny_model("llama", root / "model")
    cfg = isolated_cluster_config(
        model, router={"request_timeout_s": 600}, all={"kv_cache_memory_bytes": args.kv_cache_bytes}
    )
    with running_cluster(cfg, root / "run") as rc:
        res = asyncio.run(run(args, rc))
    ok = (
        res["errors"] == 0
        and res["lease_expiries"] == 0
        and res["decode_pull_failures"] == 0
        and res["free_blocks_start"] == res["free_blocks_end"]
        and not res["request_state_left"]
        and all(g < 5 for g in res["rest_growth_pct"].values())
    )
    res["pass"] = ok
    print(json.dumps(res, indent=1))
    first, last = res["memory_mib_after_warmup"], res["memory_mib_end"]
    for n in first:
        log(
            f"{n}: RSS {first[n]['rss']} -> {last[n]['rss']} MiB ({res['rss_growth_pct'][n]:+.2f} %), of it "
            f"KV cache {first[n]['kv']} -> {last[n]['kv']} MiB; the rest {first[n]['rest']} -> "
            f"{last[n]['rest']} MiB ({res['rest_growth_pct'][n]:+.2f} %, limit 5 %)"
        )
    log(
        f"{'PASS' if ok else 'FAIL'}: {res['requests']} requests, {res['errors']} errors, "
        f"growth after the {res['warmup_s']:.0f} s warm-up outside the KV cache "
        f"{res['rest_growth_pct']} (< 5 %), per-request maps left {res['request_state_left'] or 'none'}, "
        f"load average {res['loadavg_1m_min_mean_max']}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
