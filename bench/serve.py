"""Serving benchmark: guidellm against a local pdserve cluster, plus the router's added latency.

    .venv/bin/python bench/serve.py [--skip-install] [--out bench/results/serve.json]
                                    [--concurrency 1 4 16] [--requests 24 48 96]
                                    [--prompt-tokens 256] [--output-tokens 128]
                                    [--latency-requests 200]

What it does, in order:

1. Installs guidellm into its own venv (``.bench-venvs/guidellm``) unless it is already there
   (``pip install torch==2.13.0 guidellm`` in one command, so torch stays the CPU build).
2. Builds (or reuses) a tiny random Llama (``--model-dir``, default ``.models/tiny-llama``: hidden
   128, 2 heads x head_dim 64) and starts the same local cluster ``pdserve up`` does (router +
   prefill-0 + decode-0, with ``services.launcher``), logs under ``bench/results/serve-logs/``.
   A few warm-up requests take both paths once; a warm-up that fails right after the router
   reports ready is retried for up to 15 s and recorded (``warmup_failures`` in the JSON).
3. Runs guidellm once (``guidellm run --scenario``, written next to the logs): fixed concurrency
   (``concurrent`` profile) at each ``--concurrency`` level, synthetic text prompts of
   ``--prompt-tokens`` tokens asking for exactly ``--output-tokens`` tokens (guidellm sends
   ``ignore_eos``), streaming ``/v1/completions``, each level bounded by ``--requests`` and
   ``--max-seconds``. Prompts are longer than the router's ``local_prefill_max_tokens`` (32), so
   every request takes the disaggregated path (prefill-0 -> KV over Mooncake -> decode-0).
   From guidellm's JSON: TTFT p50/p99, ITL p50 (per request: (last - first token) / (n - 1)),
   TPOT p50 and output tok/s (output tokens of successful requests / the level's duration).
4. Router added latency, sequential, on the idle cluster: one short prompt (< 32 tokens, so the
   router prefills it on the decode node: the local path), ``max_tokens=1``, greedy, sent
   ``--latency-requests`` times each way, interleaved round-robin:
       direct        gRPC ``DecodeService.Decode`` on decode-0 (``remote_prefill=False``), one channel
       router-text   ``POST /v1/completions`` on the router, the prompt as text (router tokenizes)
       router-ids    the same with the prompt as token ids (no tokenization in the router)
       http-floor    ``GET /health`` on the router (HTTP client + uvicorn + FastAPI, no backend)
   One keep-alive ``httpx.Client`` for all HTTP. Added latency = router-text - direct (p50, p99).
   The router's ``requests_by_path`` counter is read before and after to check that every
   latency request took the local path.
5. Prints a table, writes ``--out`` (JSON; guidellm's raw report lands next to it as
   ``serve.guidellm.json``) and stops the cluster (also on errors and Ctrl-C).

The host is small (2 cores, shared): the cluster's three processes, guidellm and this script
all compete for them, so absolute numbers are noisy and low; compare runs on the same host only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Run as a script from a checkout (`python bench/serve.py`) without installing the package.
sys.path.insert(0, str(ROOT))

from bench._common import loadavg, log, pct, run_logged, scan_logs  # noqa: E402

DEFAULT_VENV = ROOT / ".bench-venvs" / "guidellm"
DEFAULT_MODEL_DIR = ROOT / ".models" / "tiny-llama"
DEFAULT_OUT = ROOT / "bench" / "results" / "serve.json"
DEFAULT_BASE_PORT = 23500
# < 32 tokens (the router's local_prefill_max_tokens): prefilled on the decode node.
LATENCY_PROMPT = "Hello from the router benchmark."
GUIDELLM_TIMEOUT_S = 480.0


# -- guidellm venv -----------------------------------------------------------------------------
def guidellm_bin(venv: Path) -> Path:
    return venv / "bin" / "guidellm"


def guidellm_version(venv: Path) -> str | None:
    py = venv / "bin" / "python"
    if not py.exists():
        return None
    r = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; print(m.version('guidellm'))"],
        capture_output=True,
        text=True,
    )
    return r.stdout.strip() if r.returncode == 0 and guidellm_bin(venv).exists() else None


def install_guidellm(venv: Path) -> None:
    log(f"installing guidellm into {venv} (with the CPU torch wheel, ~1 min)")
    if not (venv / "bin" / "python").exists():
        run_logged(["python3", "-m", "venv", str(venv)])
    # One command: guidellm's unpinned torch dependency would otherwise pull the CUDA build.
    run_logged([str(venv / "bin" / "pip"), "install", "torch==2.13.0", "guidellm"])


# -- cluster -----------------------------------------------------------------------------------
class Cluster:
    """`pdserve up`'s cluster (router + prefill-0 + decode-0) as child processes."""

    def __init__(self, model_dir: Path, run_dir: Path, base_port: int) -> None:
        from pdserve.config.cluster import default_local_cluster, write_cluster_config
        from services.launcher import pick_base_port

        base = pick_base_port("127.0.0.1", base_port)
        self.config = default_local_cluster(model_dir, base, host="127.0.0.1")
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.cfg_path = write_cluster_config(self.config, run_dir / "cluster.yaml")
        self.children: list[Any] = []

    def start(self) -> float:
        from services.launcher import start_child, wait_ready

        t0 = time.monotonic()
        for n in self.config.nodes:
            self.children.append(start_child(self.cfg_path, n.role, n.name, self.run_dir))
        self.children.append(start_child(self.cfg_path, "router", None, self.run_dir))
        wait_ready(self.config, self.children, timeout_s=240)
        return time.monotonic() - t0

    def stop(self) -> None:
        from services.launcher import stop_children

        stop_children(self.children)

    def check_alive(self) -> None:
        from services.launcher import tail

        for c in self.children:
            if c.proc.poll() is not None:
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode}:\n{tail(c.log_path)}")

    @property
    def router_url(self) -> str:
        return self.config.router_url

    @property
    def model_name(self) -> str:
        return self.config.served_name(self.config.model)

    def decode_address(self) -> str:
        return self.config.node("decode-0").grpc_address


def router_path_counts(client: Any) -> dict[str, float]:
    text = client.get("/metrics").text
    out = {}
    for m in re.finditer(r'^pdserve:router_requests_by_path_total\{path="(\w+)"\} ([0-9.e+]+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def warm_up(client: Any, model: str, prompt_tokens: int, retry_s: float = 15.0) -> list[str]:
    """Load both paths once (first requests pay lazy init: handshake, Mooncake sessions).

    The router reports ready once a decode node answers; its channel to the prefill node may
    still be in reconnect backoff then, and a disaggregated request fails at once (500). Such
    failures are retried for ``retry_s`` and returned, so the report shows them.
    """
    long_prompt = list(range(3, 3 + prompt_tokens))
    failures: list[str] = []
    for prompt in (LATENCY_PROMPT, long_prompt, long_prompt, LATENCY_PROMPT):
        what = "text" if isinstance(prompt, str) else f"{len(prompt)} token ids"
        deadline = time.monotonic() + retry_s
        while True:
            t0 = time.monotonic()
            r = client.post(
                "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            )
            if r.status_code == 200:
                break
            msg = f"warm-up ({what}): {r.status_code} after {time.monotonic() - t0:.3f} s: {r.text[:400]}"
            if time.monotonic() > deadline:
                raise RuntimeError(msg)
            failures.append(msg)
            log(f"  {msg} (retrying)")
            time.sleep(0.2)
    return failures


# -- guidellm ----------------------------------------------------------------------------------
def run_guidellm(args: argparse.Namespace, cluster: Cluster, model_dir: Path, raw_out: Path) -> dict:
    levels = args.concurrency
    counts = args.requests if len(args.requests) == len(levels) else [args.requests[-1]] * len(levels)
    scenario = {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": cluster.router_url,
                "model": cluster.model_name,
                "request_format": "/v1/completions",
            },
            "profile": {"kind": "concurrent", "streams": levels[0]},
            "constraints": [
                {"kind": "max_requests", "count": counts[0]},
                {"kind": "max_duration", "seconds": args.max_seconds},
            ],
            "tokenizer": {"kind": "hf_auto", "model": str(model_dir)},
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": args.prompt_tokens,
                    "output_tokens": args.output_tokens,
                }
            ],
            "outputs": [{"kind": "json", "path": str(raw_out)}],
        },
        # One sub-benchmark per level, run back to back by one guidellm process.
        "benchmarks": [
            {"profile.streams": c, "constraints[0].count": n} for c, n in zip(levels, counts, strict=True)
        ],
    }
    scen_path = cluster.run_dir / "guidellm-scenario.json"
    scen_path.write_text(json.dumps(scenario, indent=2))
    log_path = cluster.run_dir / "guidellm.log"
    cmd = [str(guidellm_bin(args.venv)), "run", "--scenario", str(scen_path), "--disable-progress"]
    log("$ " + " ".join(cmd) + f"  (log: {log_path})")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    raw_out.unlink(missing_ok=True)
    t0 = time.monotonic()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                logf.write(line)
                # guidellm's own progress lines: one when a level starts and one when it ends.
                m = re.search(r"(Benchmark \d+ \(\S+\): (?:started|completed).*)", line)
                if m:
                    log("  guidellm: " + m.group(1))
                if time.monotonic() - t0 > GUIDELLM_TIMEOUT_S:
                    raise TimeoutError(f"guidellm ran past {GUIDELLM_TIMEOUT_S:.0f} s")
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if rc != 0 or not raw_out.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"guidellm failed (exit {rc}); last lines of {log_path}:\n{tail}")
    log(f"  guidellm done in {time.monotonic() - t0:.0f} s")
    return parse_guidellm(json.loads(raw_out.read_text()))


def parse_guidellm(report: dict) -> dict:
    levels = []
    for b in report["benchmarks"]:
        m = b["metrics"]

        def ok(name: str, m: dict = m) -> dict:
            return m[name]["successful"]

        ttft, itl, tpot, lat = (
            ok("time_to_first_token_ms"),
            ok("inter_token_latency_ms"),
            ok("time_per_output_token_ms"),
            ok("request_latency"),
        )
        out_tokens = ok("output_token_count")["total_sum"]
        levels.append(
            {
                "concurrency": b["config"]["strategy"]["streams"],
                "requests": m["request_totals"],
                "duration_s": round(b["duration"], 3),
                "ttft_ms_p50": ttft["percentiles"]["p50"],
                "ttft_ms_p99": ttft["percentiles"]["p99"],
                "ttft_ms_mean": ttft["mean"],
                "itl_ms_p50": itl["percentiles"]["p50"],
                "tpot_ms_p50": tpot["percentiles"]["p50"],
                "request_latency_s_p50": lat["percentiles"]["p50"],
                "output_tokens": out_tokens,
                "output_tok_s": out_tokens / b["duration"] if b["duration"] > 0 else float("nan"),
                "prompt_tokens_p50": ok("prompt_token_count")["percentiles"]["p50"],
                "output_tokens_per_request_p50": ok("output_token_count")["percentiles"]["p50"],
                "guidellm_warnings": [w.get("message", "") for w in b.get("warnings") or []],
            }
        )
    return {"guidellm_version": report.get("metadata", {}).get("guidellm_version"), "levels": levels}


# -- router added latency ----------------------------------------------------------------------
def router_latency(cluster: Cluster, model_dir: Path, n: int, warmup: int) -> dict:
    import grpc
    import httpx

    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.models.loader import load_tokenizer
    from pdserve.rpc import channel
    from pdserve.rpc import node_pb2 as pb
    from pdserve.rpc import node_pb2_grpc as pb_grpc
    from pdserve.rpc.convert import sampling_to_pb

    ids = list(load_tokenizer(model_dir)(LATENCY_PROMPT)["input_ids"])
    limit = cluster.config.router.local_prefill_max_tokens
    if len(ids) >= limit:
        raise SystemExit(f"latency prompt has {len(ids)} tokens; it must be < {limit} to take the local path")
    sampling = sampling_to_pb(SamplingParams(max_tokens=1, temperature=0.0))
    md = channel.auth_metadata(cluster.config.shared_token)
    body_text = {"model": cluster.model_name, "prompt": LATENCY_PROMPT, "max_tokens": 1, "temperature": 0}
    body_ids = {**body_text, "prompt": ids}
    answers: dict[str, set[str]] = {"direct": set(), "router-text": set(), "router-ids": set()}

    with (
        grpc.insecure_channel(cluster.decode_address(), options=channel.OPTIONS) as ch,
        httpx.Client(base_url=cluster.router_url, timeout=30.0) as client,
    ):
        stub = pb_grpc.DecodeServiceStub(ch)

        def direct() -> None:
            req = pb.DecodeRequest(
                request_id=uuid.uuid4().hex, prompt_token_ids=ids, sampling=sampling, remote_prefill=False
            )
            deltas = list(stub.Decode(req, timeout=30.0, metadata=md))
            if not deltas or deltas[-1].finish_reason not in ("length", "stop"):
                raise RuntimeError(f"direct Decode did not finish: {deltas[-1:]}")
            answers["direct"].add("".join(d.text for d in deltas))

        def router(body: dict, key: str) -> None:
            r = client.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"router answered {r.status_code}: {r.text[:500]}")
            answers[key].add(r.json()["choices"][0]["text"])

        def health() -> None:
            client.get("/health").raise_for_status()

        calls = {
            "direct": direct,
            "router-text": lambda: router(body_text, "router-text"),
            "router-ids": lambda: router(body_ids, "router-ids"),
            "http-floor": health,
        }
        names = list(calls)
        for _ in range(warmup):
            for f in calls.values():
                f()
        before = router_path_counts(client)
        samples: dict[str, list[float]] = {k: [] for k in names}
        for i in range(n):
            # Rotate the order so no variant always runs right after another one.
            for k in names[i % len(names) :] + names[: i % len(names)]:
                t0 = time.perf_counter_ns()
                calls[k]()
                samples[k].append((time.perf_counter_ns() - t0) / 1e6)
        after = router_path_counts(client)

    paths = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}
    stats = {
        k: {
            "p50_ms": pct(v, 0.5),
            "p99_ms": pct(v, 0.99),
            "mean_ms": statistics.fmean(v),
            "min_ms": min(v),
            "n": len(v),
        }
        for k, v in samples.items()
    }
    d, rt, ri = stats["direct"], stats["router-text"], stats["router-ids"]
    return {
        "prompt": LATENCY_PROMPT,
        "prompt_tokens": len(ids),
        "max_tokens": 1,
        "stats": stats,
        "added_ms_p50": rt["p50_ms"] - d["p50_ms"],
        "added_ms_p99": rt["p99_ms"] - d["p99_ms"],
        "added_ms_p50_token_ids": ri["p50_ms"] - d["p50_ms"],
        "goal_p50_ms": 1.0,
        "meets_goal": rt["p50_ms"] - d["p50_ms"] <= 1.0,
        "router_paths_during_latency_run": paths,
        "all_local_path": paths.get("local", 0.0) == 2 * n and paths.get("disaggregated", 0.0) == 0.0,
        "same_answer_all_ways": len(set().union(*answers.values())) == 1,
        "answers": {k: sorted(v) for k, v in answers.items()},
    }


# -- report ------------------------------------------------------------------------------------


def print_tables(serve: dict, lat: dict | None) -> None:
    print()
    print(f"guidellm {serve['guidellm_version']} -> pdserve router (streaming /v1/completions)")
    hdr = (
        f"{'conc':>5} {'ok/err/inc':>11} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
        f"{'TPOT p50':>9} {'out tok/s':>10} {'dur s':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in serve["levels"]:
        rq = r["requests"]
        print(
            f"{r['concurrency']:>5} {rq['successful']:>4}/{rq['errored']}/{rq['incomplete']:<4} "
            f"{r['ttft_ms_p50']:>7.1f}ms {r['ttft_ms_p99']:>7.1f}ms {r['itl_ms_p50']:>6.2f}ms "
            f"{r['tpot_ms_p50']:>7.2f}ms {r['output_tok_s']:>10.1f} {r['duration_s']:>6.1f}"
        )
    if lat is None:
        return
    print()
    print(
        f"router added latency: {lat['prompt_tokens']}-token prompt, max_tokens=1, local path, "
        f"{lat['stats']['direct']['n']} sequential requests each"
    )
    hdr = f"{'path':<13} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'min ms':>8}"
    print(hdr)
    print("-" * len(hdr))
    for k, s in lat["stats"].items():
        print(f"{k:<13} {s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f} {s['mean_ms']:>8.2f} {s['min_ms']:>8.2f}")
    verdict = "meets" if lat["meets_goal"] else "misses"
    print(
        f"router adds {lat['added_ms_p50']:+.2f} ms p50, {lat['added_ms_p99']:+.2f} ms p99 "
        f"({lat['added_ms_p50_token_ids']:+.2f} ms p50 with token-id prompts); {verdict} the <= 1 ms p50 goal"
    )
    if not lat["all_local_path"]:
        print(
            f"WARNING: not every latency request took the local path: {lat['router_paths_during_latency_run']}"
        )
    if not lat["same_answer_all_ways"]:
        print(f"WARNING: the paths answered differently: {lat['answers']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-install", action="store_true", help="never install guidellm (fail if missing)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="guidellm's venv")
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT, help="router port; nodes take +1..+4")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument(
        "--requests",
        nargs="+",
        type=int,
        default=[24, 48, 96],
        help="requests per concurrency level (one value per level, or one for all)",
    )
    ap.add_argument("--max-seconds", type=float, default=90.0, help="cap of each level's duration")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--latency-requests", type=int, default=200, help="sequential requests per variant")
    ap.add_argument("--latency-warmup", type=int, default=20)
    ap.add_argument("--skip-guidellm", action="store_true", help="only measure the router's added latency")
    args = ap.parse_args()
    args.out = args.out.resolve()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.venv = args.venv.resolve()
    run_dir = args.out.parent / f"{args.out.stem}-logs"
    raw_out = args.out.with_name(f"{args.out.stem}.guidellm.json")

    # SIGTERM -> the same clean stop as Ctrl-C.
    def on_term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)

    t_start = time.monotonic()
    log(
        f"host: {platform.machine()}, {os.cpu_count()} CPUs, load {loadavg()} (shared host: numbers are noisy)"
    )
    version = None
    if not args.skip_guidellm:
        version = guidellm_version(args.venv)
        if version is None:
            if args.skip_install:
                raise SystemExit(f"guidellm is not installed in {args.venv} and --skip-install was given")
            install_guidellm(args.venv)
            version = guidellm_version(args.venv)
            if version is None:
                raise SystemExit("guidellm install finished but `guidellm` is not importable")
        log(f"guidellm {version} in {args.venv}")
    t_bench = time.monotonic()

    model_dir = args.model_dir.resolve()
    if not (model_dir / "config.json").exists():  # built once, then reused
        from pdserve.models.make_model import make_tiny_model

        make_tiny_model("llama", model_dir, hidden_size=128, num_heads=2, num_kv_heads=2, head_dim=64)
    log(f"model: {model_dir}")

    cluster = Cluster(model_dir, run_dir, args.base_port)
    result: dict[str, Any] = {
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "note": "2 shared cores run the cluster, guidellm and this script together: numbers are noisy",
        "model_dir": str(model_dir),
        "cluster": {"router": cluster.router_url, "config": str(cluster.cfg_path), "logs": str(run_dir)},
        "config": {
            k: getattr(args, k)
            for k in (
                "concurrency",
                "requests",
                "max_seconds",
                "prompt_tokens",
                "output_tokens",
                "latency_requests",
                "latency_warmup",
            )
        },
    }
    serve: dict | None = None
    lat: dict | None = None
    try:
        log(f"starting router + prefill-0 + decode-0 at {cluster.router_url} (logs: {run_dir})")
        result["cluster"]["startup_s"] = round(cluster.start(), 1)
        log(f"  cluster ready in {result['cluster']['startup_s']} s")
        import httpx

        with httpx.Client(base_url=cluster.router_url, timeout=60.0) as client:
            result["warmup_failures"] = warm_up(client, cluster.model_name, args.prompt_tokens)
            paths_before = router_path_counts(client)
        if not args.skip_guidellm:
            log(
                f"guidellm: concurrency {args.concurrency}, requests {args.requests}, {args.prompt_tokens} in / "
                f"{args.output_tokens} out, load {loadavg()}"
            )
            serve = run_guidellm(args, cluster, model_dir, raw_out)
            cluster.check_alive()
            with httpx.Client(base_url=cluster.router_url, timeout=10.0) as client:
                after = router_path_counts(client)
            serve["router_paths"] = {
                k: after.get(k, 0.0) - paths_before.get(k, 0.0) for k in set(after) | set(paths_before)
            }
            serve["raw_report"] = str(raw_out)
            result["guidellm"] = serve
        log(f"router added latency: {args.latency_requests} requests per variant, load {loadavg()}")
        lat = router_latency(cluster, model_dir, args.latency_requests, args.latency_warmup)
        cluster.check_alive()
        result["router_latency"] = lat
    finally:
        log("stopping the cluster")
        cluster.stop()
        result["log_problems"] = scan_logs(run_dir, skip=("guidellm.log",))
        result["total_s"] = round(time.monotonic() - t_start, 1)
        result["bench_s"] = round(time.monotonic() - t_bench, 1)  # without the install
        args.out.write_text(json.dumps(result, indent=2))
        log(f"wrote {args.out}")

    if serve is not None:
        print_tables(serve, lat)
    elif lat is not None:
        print_tables({"guidellm_version": None, "levels": []}, lat)
    if result.get("warmup_failures"):
        print("\nwarm-up requests that failed right after the router reported ready (then retried, ok):")
        for msg in result["warmup_failures"][:5]:
            print(f"  {msg[:300]}")
    if result["log_problems"]:
        print()
        print("warnings / errors in the cluster's logs:")
        for name, lines in result["log_problems"].items():
            print(f"  {name}: {len(lines)} line(s), first: {lines[0][:200]}")
    print(f"\ntotal {result['total_s']:.0f} s (benchmark part {result['bench_s']:.0f} s)")


if __name__ == "__main__":
    main()
