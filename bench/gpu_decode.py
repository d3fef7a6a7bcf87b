"""Decode throughput of pdserve on one CUDA device, against transformers and the roofline.

    python bench/gpu_decode.py --out DIR [--model-dir DIR] [--batches 1 16 64]
                               [--prompt-len 512] [--new-tokens 128]

Model: a Llama-1B-shaped random bf16 checkpoint (hidden 2048, 16 layers, 32 heads / 8 KV heads,
head_dim 64, intermediate 8192, vocab 128256), written with ``make_tiny_model`` into --model-dir
unless it is already there. Prompts are random token ids; every request generates exactly
--new-tokens tokens (ignore_eos).

Measured, per batch size:
  pdserve      decode tok/s = tokens of the decode phase / its wall time (from the step that
               returned every request's first token to the last token), driven by engine.step():
               CUDA graphs with asynchronous scheduling (the default), "graphs-sync" (the same,
               synchronous: schedule, run, wait, process, in turn), eager
               (enforce_eager), the torch paths (kernels backend "torch", eager; batch 64 only),
               and "graphs-unfused": graphs with llama.py's rotary and SiLU*up run through their
               torch twins (the path before the fused Triton kernels; patched here only).
               For graphs, one forward's replay is timed alone (GPU time, back to back) and so is
               the host time of launching it.
  transformers generate() in bf16 with sdpa, dynamic and static cache; decode tok/s =
               batch * (N - 1) / (t(N new tokens) - t(1 new token)).
  roofline     bytes one decode step must read (all weights but the embedding table, plus the
               embedding rows and the KV of every context at its mean length) over the
               device-to-device copy bandwidth measured here (read + write bytes / s).
  attention    one layer's paged attention (KV write included) at the mean context, torch vs Triton.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve import kernels
from pdserve.config.engine import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

MODEL_SHAPE = dict(
    hidden_size=2048,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    intermediate_size=8192,
    vocab_size=128256,
)
MAX_MODEL_LEN = 2048
BLOCK_SIZE = 16
MODES = ("graphs", "graphs-sync", "eager", "torch-attn", "graphs-unfused")
MODE_BATCHES = {"torch-attn": [64]}  # the torch path is ~40x slower: one batch size shows it


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median_ms(fn: Any, rep_ms: int = 300) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=50, rep=rep_ms, return_mode="median"))


def copy_bandwidth_gbps(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy of ``num_bytes``; read + write bytes per second."""
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    torch.cuda.empty_cache()
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def build_model(model_dir: Path) -> float:
    from pdserve.models.make_model import make_tiny_model

    if (model_dir / "config.json").is_file():
        return 0.0
    t0 = time.perf_counter()
    make_tiny_model(
        "llama", model_dir, dtype="bfloat16", max_position_embeddings=MAX_MODEL_LEN, **MODEL_SHAPE
    )
    return time.perf_counter() - t0


def make_prompts(batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL_SHAPE["vocab_size"], (batch, prompt_len), generator=gen).tolist()


# ----------------------------------------------------------------------------- unfused comparison


class _Unfused:
    """Rotary + KV store and SiLU*up through their torch twins (the code path before the fused
    kernels: ~7 small kernels per rotary call and a separate KV write, 2 for SiLU*up) for one
    block; bench only. ``kv_store.rotary_and_store_kv`` reads ``kernels.rotary_can_run`` and
    ``kernels.apply_rotary`` at call time, llama.py its own ``silu_and_mul``."""

    def __enter__(self) -> None:
        from pdserve.models import llama

        self._saved = (kernels.rotary_can_run, kernels.apply_rotary, llama.silu_and_mul)
        kernels.rotary_can_run = lambda *_a, **_k: False
        kernels.apply_rotary = kernels.apply_rotary_torch
        llama.silu_and_mul = kernels.silu_and_mul_torch

    def __exit__(self, *exc: object) -> None:
        from pdserve.models import llama

        kernels.rotary_can_run, kernels.apply_rotary, llama.silu_and_mul = self._saved


# ----------------------------------------------------------------------------- pdserve


def _engine(model_dir: Path, mode: str, max_batch: int, prompt_len: int) -> LLMEngine:
    cfg = EngineConfig(
        model=str(model_dir),
        dtype="bfloat16",
        device="cuda",
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=not mode.startswith("graphs"),
        async_scheduling=mode != "graphs-sync",  # the other modes measure other things, async
        cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_bytes=4 << 30, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=max_batch * prompt_len),
    )
    return LLMEngine(cfg, load_tokenizer_=False)


def _generate_timed(
    engine: LLMEngine, prompts: list[list[int]], new_tokens: int, tag: str, timeline: bool = False
) -> dict[str, Any]:
    """Run to completion through ``engine.step()``; time the decode phase.

    The decode window opens when every request has its first token (the step that returned
    those also launched the first decode step, whose GPU work starts only once the prefill's
    has ended) and closes when the last token arrives; every token received inside it counts.
    Inside the window, ``wait`` is the host time spent blocked on the device (the step's event)
    and ``host`` the rest of the steps' wall time: under asynchronous scheduling a wait > 0
    means the GPU, not the host, set the pace.

    ``timeline``: CUDA events around each launch (and after the graph replay) split each decode
    step's GPU time into inputs + forward, LM head + sampling + copy-out, and idle time before
    the step's first work (the host was late): ``gpu_*_ms`` medians.
    """
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        engine.add_request(p, params, rid)
    runner = engine.runner
    wait_s = [0.0]
    orig_launch = runner.launch

    marks: list[tuple[Any, Any, Any]] = []
    graphs = runner.cuda_graphs
    orig_run = graphs.run if graphs is not None else None
    mid: list[Any] = [None]
    if timeline and graphs is not None:

        def marked_run(*a: Any, **kw: Any) -> Any:
            out = orig_run(*a, **kw)  # type: ignore[misc]
            mid[0] = torch.cuda.Event(enable_timing=True)
            mid[0].record()
            return out

        graphs.run = marked_run  # type: ignore[method-assign]

    def timed_launch(*a: Any, **kw: Any) -> Any:
        if timeline:
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
            mid[0] = None
        pending = orig_launch(*a, **kw)
        if timeline:
            e2 = torch.cuda.Event(enable_timing=True)
            e2.record()
            marks.append((e0, mid[0], e2))
        result = pending.result

        def timed_result() -> Any:
            t = time.perf_counter()
            if pending.event is not None:
                pending.event.synchronize()
            wait_s[0] += time.perf_counter() - t
            return result()

        pending.result = timed_result  # type: ignore[method-assign]
        return pending

    runner.launch = timed_launch  # type: ignore[method-assign]
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    started: set[str] = set()
    step_s: list[float] = []
    t_open = None
    wait_open = 0.0
    decode_tokens = 0
    t_prefill = time.perf_counter()
    try:
        while engine.has_unfinished():
            t0 = time.perf_counter()
            deltas = engine.step()
            t1 = time.perf_counter()
            if t_open is not None:
                step_s.append(t1 - t0)
                decode_tokens += sum(len(d.token_ids) for d in deltas)
            for d in deltas:
                tokens[d.request_id].extend(d.token_ids)
                if d.token_ids:
                    started.add(d.request_id)
            if t_open is None and len(started) == len(rids):
                t_open, wait_open = t1, wait_s[0]
        t_close = time.perf_counter()
    finally:
        runner.launch = orig_launch  # type: ignore[method-assign]
        if orig_run is not None:
            graphs.run = orig_run  # type: ignore[method-assign,union-attr]
    assert t_open is not None
    gpu: dict[str, float] = {}
    if marks:
        torch.cuda.synchronize()
        steady = [m for m in marks[len(marks) // 4 :] if m[1] is not None]  # decode steps, graphs
        if len(steady) > 2:
            fwd = [m[0].elapsed_time(m[1]) for m in steady]
            post = [m[1].elapsed_time(m[2]) for m in steady]
            idle = [a[2].elapsed_time(b[0]) for a, b in itertools.pairwise(steady)]
            gpu = {
                "gpu_forward_ms": statistics.median(fwd),
                "gpu_head_sample_ms": statistics.median(post),
                "gpu_idle_before_ms": statistics.median(idle),
                "gpu_steps_timed": len(steady),
            }
    total = t_close - t_open
    steps = max(1, len(step_s))
    wait = wait_s[0] - wait_open
    return {
        "async_scheduling": engine.async_scheduling,
        "decode_steps": len(step_s),
        "decode_tokens": decode_tokens,
        "decode_tok_s": decode_tokens / total if total else 0.0,
        "step_ms_mean": 1e3 * total / steps,
        "step_ms_median": 1e3 * statistics.median(step_s) if step_s else 0.0,
        "wait_ms_mean": 1e3 * wait / steps,
        "host_ms_mean": 1e3 * (total - wait) / steps,
        "prefill_s": t_open - t_prefill,
        "tokens": [tokens[r] for r in rids],
        **gpu,
    }


def host_profile(engine: LLMEngine, batch: int, prompt_len: int, steps: int = 40) -> dict:
    """cProfile of ``steps`` decode steps at ``batch`` (host Python only); prints the top entries."""
    import cProfile
    import io
    import pstats

    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    for i, p in enumerate(make_prompts(batch, prompt_len, seed=7)):
        engine.add_request(p, params, f"prof{batch}-{i}")
    for _ in range(8):
        engine.step()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    ms = 1e3 * (time.perf_counter() - t0) / steps
    while engine.has_unfinished():
        engine.step()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
    log(f"host profile, batch {batch}, async={engine.async_scheduling}: {ms:.3f} ms/step under cProfile")
    print(buf.getvalue(), flush=True)
    return {"batch": batch, "ms_per_step_profiled": ms}


def pinned_alloc_us(n: int = 2000) -> float:
    """Host time of one small pinned allocation used as a non-blocking copy source (the per-copy
    staging that PinnedStaging replaced), through torch's caching host allocator."""
    dst = torch.empty(512, dtype=torch.int64, device="cuda")

    def once() -> None:
        h = torch.empty(512, dtype=torch.int64, pin_memory=True)
        dst.copy_(h, non_blocking=True)

    for _ in range(50):
        once()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        once()
    us = 1e6 * (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return us


def _profile_replay(graphs: Any, bs: int, replays: int = 5) -> list[dict]:
    """GPU time per replay of each kernel of the captured decode step (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graphs.replay(bs)
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = ev.self_device_time_total / replays
        if us > 0:
            rows.append({"kernel": ev.key[:90], "us_per_step": us, "calls_per_step": ev.count / replays})
    rows.sort(key=lambda r: -r["us_per_step"])
    log(f"replay kernels, batch {bs} (us per step, calls per step):")
    for r in rows[:14]:
        log(f"  {r['us_per_step']:8.1f} us  x{r['calls_per_step']:5.1f}  {r['kernel']}")
    log(
        f"  total {sum(r['us_per_step'] for r in rows):.1f} us in {sum(r['calls_per_step'] for r in rows):.0f} kernels"
    )
    return rows[:40]


def run_pdserve(
    model_dir: Path,
    mode: str,
    batches: list[int],
    prompt_len: int,
    new_tokens: int,
    profile_replays: bool = False,
) -> list[dict]:
    backend = "torch" if mode == "torch-attn" else "auto"
    unfused = _Unfused() if mode == "graphs-unfused" else None
    results = []
    engine = None
    with kernels.use_backend(backend):
        if unfused:
            unfused.__enter__()
        try:
            t0 = time.perf_counter()
            engine = _engine(model_dir, mode, max(batches), prompt_len)
            log(f"pdserve {mode}: engine up in {time.perf_counter() - t0:.1f} s")
            for b in batches:
                _generate_timed(engine, make_prompts(b, 32, seed=99), 8, f"warm{b}")  # compile, autotune
                r = _generate_timed(engine, make_prompts(b, prompt_len, seed=b), new_tokens, f"b{b}")
                r.update(mode=mode, batch=b)
                graphs = engine.runner.cuda_graphs
                if graphs is not None:
                    bs = graphs.padded_size(b)
                    r["graph_runs"] = graphs.num_runs
                    r["replay_ms"] = median_ms(lambda bs=bs, graphs=graphs: graphs.replay(bs))
                    launch_s = []
                    for _ in range(20):
                        torch.cuda.synchronize()
                        t = time.perf_counter()
                        graphs.replay(bs)
                        launch_s.append(time.perf_counter() - t)
                    torch.cuda.synchronize()
                    r["launch_ms"] = 1e3 * statistics.median(launch_s)
                    if profile_replays and mode == "graphs":
                        r["replay_kernels"] = _profile_replay(graphs, bs)
                        tl = _generate_timed(
                            engine, make_prompts(b, prompt_len, seed=b), 48, f"tl{b}", timeline=True
                        )
                        r.update({k: v for k, v in tl.items() if k.startswith("gpu_")})
                        log(
                            f"pdserve {mode} batch {b} GPU per step (events): inputs+forward "
                            f"{tl.get('gpu_forward_ms', float('nan')):.3f} ms, LM head+sample+copy "
                            f"{tl.get('gpu_head_sample_ms', float('nan')):.3f} ms, idle before "
                            f"{tl.get('gpu_idle_before_ms', float('nan')):.3f} ms"
                        )
                log(
                    f"pdserve {mode} batch {b}: {r['decode_tok_s']:,.0f} tok/s, step {r['step_ms_mean']:.3f} ms "
                    f"(host {r['host_ms_mean']:.3f}, wait {r['wait_ms_mean']:.3f})"
                    + (
                        f", replay {r['replay_ms']:.3f} ms, launch {r['launch_ms']:.3f} ms"
                        if "replay_ms" in r
                        else ""
                    )
                )
                results.append(r)
            if profile_replays and mode == "graphs":
                host_profile(engine, max(batches), prompt_len)
            weights = sum(
                p.numel() * p.element_size()
                for n, p in engine.runner.model.named_parameters()
                if "embed_tokens" not in n
            )
            for r in results:
                r["weight_bytes"] = weights
        finally:
            if unfused:
                unfused.__exit__()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    return results


# ----------------------------------------------------------------------------- transformers


def run_transformers(
    model_dir: Path, batches: list[int], prompt_len: int, new_tokens: int, caches: list[str]
) -> list[dict]:
    """generate() with a per-step clock (a stopping criterion that never stops): decode tok/s =
    batch * (steps - 1) / (last step - first step), so the prefill is excluded. Each config is
    warmed with the same shapes first (the static cache compiles its decode step)."""
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> torch.Tensor:
            torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.cuda().eval()
    model.generation_config.eos_token_id = None
    results = []
    for b in batches:
        ids = torch.tensor(make_prompts(b, prompt_len, seed=b), device="cuda")
        for cache in caches:
            extra = {"cache_implementation": "static"} if cache == "static" else {}
            clock = StepClock()

            def gen(
                n: int, clock: StepClock = clock, ids: torch.Tensor = ids, extra: dict = extra
            ) -> torch.Tensor:
                clock.times.clear()
                with torch.no_grad():
                    return model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=n,
                        min_new_tokens=n,
                        do_sample=False,
                        pad_token_id=0,
                        stopping_criteria=StoppingCriteriaList([clock]),
                        **extra,
                    )

            try:
                t0 = time.perf_counter()
                gen(new_tokens if cache == "static" else 8)  # static: compile for these shapes
                warm_s = time.perf_counter() - t0
                out = gen(new_tokens)
            except Exception as e:  # report and go on: a failing cache kind must not sink the run
                log(f"transformers batch {b} {cache} cache failed: {type(e).__name__}: {e}")
                results.append({"batch": b, "cache": cache, "error": f"{type(e).__name__}: {e}"})
                continue
            steps = len(clock.times) - 1
            tok_s = b * steps / (clock.times[-1] - clock.times[0])
            log(
                f"transformers batch {b} {cache}: {tok_s:,.0f} tok/s ({steps} decode steps; warm-up {warm_s:.1f} s)"
            )
            results.append(
                {
                    "batch": b,
                    "cache": cache,
                    "decode_tok_s": tok_s,
                    "decode_steps": steps,
                    "warmup_s": warm_s,
                    "tokens": out[:, prompt_len:].tolist(),
                }
            )
    return results


# ----------------------------------------------------------------------------- attention alone


def run_attention(batches: list[int], ctx: int, copy_gbps: float) -> list[dict]:
    """One layer's decode attention (KV write included) at context ``ctx``.

    torch path: eager (its padding check syncs, so it cannot be captured); Triton: eager, and
    in a CUDA graph over 16 layers' caches (GPU time without launch gaps, no L2 reuse).
    """
    from pdserve.models.attention import AttentionMetadata
    from pdserve.models.paged_attention import paged_attention

    layers = MODEL_SHAPE["num_layers"]
    heads, kv_heads, dim = MODEL_SHAPE["num_heads"], MODEL_SHAPE["num_kv_heads"], MODEL_SHAPE["head_dim"]
    results = []
    for b in batches:
        per_seq = -(-ctx // BLOCK_SIZE)
        num_blocks = b * per_seq + 1
        stage = torch.randn(
            (num_blocks, layers, 2, BLOCK_SIZE, kv_heads, dim), dtype=torch.bfloat16, device="cuda"
        )
        table = (
            (torch.randperm(num_blocks - 1, device="cuda")[: b * per_seq] + 1)
            .view(b, per_seq)
            .to(torch.int32)
        )
        pos = ctx - 1
        slots = (table[:, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE).contiguous()
        q = torch.randn((b, heads, dim), dtype=torch.bfloat16, device="cuda")
        k = torch.randn((b, kv_heads, dim), dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        row: dict[str, Any] = {"batch": b, "ctx": ctx, "kv_bytes": b * ctx * 2 * kv_heads * dim * 2}
        outs = {}
        for backend in ("torch", "triton"):
            meta = AttentionMetadata(
                num_tokens=b,
                slot_mapping=slots,
                query_start_loc=torch.arange(b + 1, dtype=torch.int32, device="cuda"),
                seq_lens=torch.full((b,), ctx, dtype=torch.int32, device="cuda"),
                block_tables=table,
                query_lens_cpu=[1] * b,
                seq_lens_cpu=[ctx] * b,
                max_query_len=1,
                max_seq_len=ctx,
                block_size=BLOCK_SIZE,
                backend=backend,  # type: ignore[arg-type]
            )

            def call(i: int = 0, meta: AttentionMetadata = meta, q=q, k=k, v=v, stage=stage) -> torch.Tensor:
                return paged_attention(q, k, v, stage[:, i % layers], meta, dim**-0.5)

            outs[backend] = call().float()
            row[f"{backend}_eager_us"] = 1e3 * median_ms(call, rep_ms=200)
            if backend == "triton":
                row["triton_graph_us"] = graph_us(call, layers)
        row["rel_err"] = float((outs["triton"] - outs["torch"]).norm() / outs["torch"].norm())
        row["triton_of_copy"] = row["kv_bytes"] / (row["triton_graph_us"] * 1e-6) / 1e9 / copy_gbps
        row["speedup"] = row["torch_eager_us"] / row["triton_graph_us"]
        log(
            f"attention batch {b} ctx {ctx}: torch eager {row['torch_eager_us']:.1f} us, triton eager "
            f"{row['triton_eager_us']:.1f} us, in a graph {row['triton_graph_us']:.1f} us "
            f"({row['triton_of_copy']:.2f} of copy), rel err {row['rel_err']:.1e}"
        )
        results.append(row)
        del stage
    torch.cuda.empty_cache()
    return results


def run_fused_kernels(batches: list[int]) -> list[dict]:
    """One layer's rotary (q and k) and SiLU*up at decode batch sizes: fused Triton kernel vs the
    torch twin, GPU time in a CUDA graph of 16 calls (as in the decode step)."""
    rows = [_fused_kernels_at(b) for b in batches]
    for r in rows:
        log(
            f"fused kernels batch {r['batch']}: rotary {r['rotary_triton_us']:.1f} us "
            f"(twin {r['rotary_torch_us']:.1f}), silu_and_mul {r['silu_and_mul_triton_us']:.1f} us "
            f"(twin {r['silu_and_mul_torch_us']:.1f})"
        )
    return rows


def _fused_kernels_at(b: int) -> dict:
    heads, kv_heads, dim = MODEL_SHAPE["num_heads"], MODEL_SHAPE["num_kv_heads"], MODEL_SHAPE["head_dim"]
    inter, layers = MODEL_SHAPE["intermediate_size"], MODEL_SHAPE["num_layers"]
    cache = kernels.rotary_cos_sin_cache(torch.rand(dim // 2, device="cuda"), MAX_MODEL_LEN)
    qkv = torch.randn((b, (heads + 2 * kv_heads) * dim), dtype=torch.bfloat16, device="cuda")
    q = qkv[:, : heads * dim].view(b, heads, dim)  # views of the fused output, as in the model
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(b, kv_heads, dim)
    pos = torch.randint(0, MAX_MODEL_LEN, (b,), device="cuda")
    gate_up = torch.randn((b, 2 * inter), dtype=torch.bfloat16, device="cuda")
    return {
        "batch": b,
        "rotary_triton_us": graph_us(lambda i=0: kernels.apply_rotary(q, k, pos, cache), layers),
        "rotary_torch_us": graph_us(lambda i=0: kernels.apply_rotary_torch(q, k, pos, cache), layers),
        "silu_and_mul_triton_us": graph_us(lambda i=0: kernels.silu_and_mul(gate_up), layers),
        "silu_and_mul_torch_us": graph_us(lambda i=0: kernels.silu_and_mul_torch(gate_up), layers),
    }


def logits_check(model_dir: Path, prompt_len: int) -> dict:
    """The benchmark model's logits at every prompt position (prefill, then 16 decode steps):
    pdserve bf16 and transformers bf16 against transformers fp32 (the tests' check, full size)."""
    from tests.gpu.test_engine_cuda import _pdserve_logits, _transformers_logits

    prompt = make_prompts(1, prompt_len, seed=7)[0]
    ref = _transformers_logits(model_dir, torch.float32, prompt)
    hf16 = _transformers_logits(model_dir, torch.bfloat16, prompt)
    ours = _pdserve_logits(model_dir, torch.bfloat16, prompt, prefill_len=prompt_len - 16)

    def rel(x: torch.Tensor, ref: torch.Tensor = ref) -> float:
        return float((x - ref).norm() / ref.norm())

    def top1(x: torch.Tensor, ref: torch.Tensor = ref) -> float:
        return float((x.argmax(-1) == ref.argmax(-1)).float().mean())

    out = {"pdserve_bf16_rel_err": rel(ours), "transformers_bf16_rel_err": rel(hf16)}
    out |= {"pdserve_bf16_top1_agree": top1(ours), "transformers_bf16_top1_agree": top1(hf16)}
    gc.collect()
    torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------- report


def roofline(r: dict, prompt_len: int, new_tokens: int, copy_gbps: float) -> dict:
    """Bytes one decode step reads at the mean context, and the tok/s that copy bandwidth allows."""
    b = r["batch"]
    ctx_mean = prompt_len + 1 + (new_tokens - 2) / 2  # decode steps end at contexts 513 .. 639
    kv_per_token = MODEL_SHAPE["num_layers"] * 2 * MODEL_SHAPE["num_kv_heads"] * MODEL_SHAPE["head_dim"] * 2
    step_bytes = r["weight_bytes"] + b * MODEL_SHAPE["hidden_size"] * 2 + b * ctx_mean * kv_per_token
    step_s = step_bytes / (copy_gbps * 1e9)
    return {"step_bytes": step_bytes, "roofline_step_ms": 1e3 * step_s, "roofline_tok_s": b / step_s}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def print_tables(report: dict) -> None:
    print()
    print(f"device: {report['device']}; copy {report['copy_gbps']:,.0f} GB/s (read+write); "
          f"prompt {report['prompt_len']}, {report['new_tokens']} new tokens, bf16")  # fmt: skip
    hf_best: dict[int, float] = {}
    hf_dyn: dict[int, float] = {}
    for h in report["transformers"]:
        if "decode_tok_s" in h:
            hf_best[h["batch"]] = max(hf_best.get(h["batch"], 0.0), h["decode_tok_s"])
            if h["cache"] == "dynamic":
                hf_dyn[h["batch"]] = h["decode_tok_s"]
    header = (
        f"{'engine':<22} {'batch':>5} {'tok/s':>9} {'step ms':>8} {'host ms':>8} {'wait ms':>8} "
        f"{'replay ms':>9} {'roof tok/s':>10} {'of roof':>7} {'vs HF dyn':>9} {'vs HF best':>10}"
    )
    print(header)
    print("-" * len(header))

    def ratio(x: float, ref: float | None, width: int) -> str:
        return f"{x / ref:>{width - 1}.1f}x" if ref else f"{'-':>{width}}"

    for r in report["pdserve"]:
        print(
            f"{'pdserve ' + r['mode']:<22} {r['batch']:>5} {r['decode_tok_s']:>9,.0f} {r['step_ms_mean']:>8.3f} "
            f"{r['host_ms_mean']:>8.3f} {r['wait_ms_mean']:>8.3f} {r.get('replay_ms', float('nan')):>9.3f} "
            f"{r['roofline_tok_s']:>10,.0f} {r['decode_tok_s'] / r['roofline_tok_s']:>7.2f} "
            f"{ratio(r['decode_tok_s'], hf_dyn.get(r['batch']), 9)} "
            f"{ratio(r['decode_tok_s'], hf_best.get(r['batch']), 10)}"
        )
    for h in report["transformers"]:
        if "decode_tok_s" in h:
            print(f"{'transformers ' + h['cache']:<22} {h['batch']:>5} {h['decode_tok_s']:>9,.0f}")
    print()
    hdr = (
        f"{'attention, 1 layer':<20} {'batch':>5} {'ctx':>5} {'torch eager us':>14} {'triton eager us':>15} "
        f"{'triton graph us':>15} {'of copy':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for a in report["attention"]:
        print(
            f"{'decode + KV write':<20} {a['batch']:>5} {a['ctx']:>5} {a['torch_eager_us']:>14.1f} "
            f"{a['triton_eager_us']:>15.1f} {a['triton_graph_us']:>15.1f} {a['triton_of_copy']:>7.2f}"
        )
    print()
    hdr = f"{'per layer, in a graph':<22} {'batch':>5} {'triton us':>9} {'torch twin us':>13}"
    print(hdr)
    print("-" * len(hdr))
    for f in report.get("fused_kernels", []):
        for name in ("rotary", "silu_and_mul"):
            print(f"{name:<22} {f['batch']:>5} {f[name + '_triton_us']:>9.1f} {f[name + '_torch_us']:>13.1f}")
    for line in report["checks"]:
        print(line)


# ----------------------------------------------------------------------------- diagnostics


def graph_us(fn: Any, calls: int) -> float:
    """GPU microseconds of one ``fn()``: ``calls`` of it captured in one CUDA graph, replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return 1e3 * median_ms(graph.replay, rep_ms=100) / calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_decode.json")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/pdserve-llama1b-random"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--profile-replays", action="store_true", help="list each kernel's GPU time in a graph replay"
    )
    parser.add_argument(
        "--skip-micro", action="store_true", help="skip the per-layer attention / fused-kernel timings"
    )
    parser.add_argument(
        "--hf-caches",
        nargs="+",
        choices=("dynamic", "static"),
        default=["dynamic", "static"],
        help="transformers KV caches to time (static compiles its decode step: ~30 s per batch size)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_decode.py needs a CUDA device; nothing run.")
        return 2
    import transformers
    import triton

    args.out.mkdir(parents=True, exist_ok=True)
    out_path = args.out / "gpu_decode.json"
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "num_sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers_version": transformers.__version__,
        "model_shape": MODEL_SHAPE,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "max_model_len": MAX_MODEL_LEN,
        "pdserve": [],
        "transformers": [],
        "attention": [],
        "fused_kernels": [],
        "checks": [],
    }

    def save() -> None:
        out_path.write_text(json.dumps(report, indent=1) + "\n")

    report["copy_gbps"] = copy_bandwidth_gbps()
    log(f"copy bandwidth {report['copy_gbps']:,.0f} GB/s")
    report["pinned_alloc_us"] = pinned_alloc_us()
    log(f"one small pinned allocation + non-blocking copy from it: {report['pinned_alloc_us']:.1f} us")
    report["model_build_s"] = build_model(args.model_dir)
    log(f"model ready in {args.model_dir} ({report['model_build_s']:.0f} s)")
    ctx_mean = args.prompt_len + args.new_tokens // 2
    if not args.skip_micro:
        report["attention"] = run_attention(args.batches, ctx_mean, report["copy_gbps"])
        report["fused_kernels"] = run_fused_kernels(args.batches)
    save()
    for mode in args.modes:
        try:
            batches = [b for b in args.batches if b in MODE_BATCHES.get(mode, args.batches)] or args.batches[
                -1:
            ]
            rows = run_pdserve(
                args.model_dir, mode, batches, args.prompt_len, args.new_tokens, args.profile_replays
            )
        except Exception as e:  # keep the other modes' numbers
            log(f"pdserve {mode} failed: {type(e).__name__}: {e}")
            report["checks"].append(f"pdserve {mode} FAILED: {type(e).__name__}: {e}")
            continue
        for r in rows:
            r.update(roofline(r, args.prompt_len, args.new_tokens, report["copy_gbps"]))
        report["pdserve"].extend(rows)
        save()
    try:
        report["logits"] = logits_check(args.model_dir, args.prompt_len)
        lg = report["logits"]
        report["checks"].append(
            f"logits vs transformers fp32 (prompt {args.prompt_len}, last 16 by decode steps): rel err pdserve "
            f"bf16 {lg['pdserve_bf16_rel_err']:.2e} (top-1 agree {lg['pdserve_bf16_top1_agree']:.3f}), "
            f"transformers bf16 {lg['transformers_bf16_rel_err']:.2e} (top-1 {lg['transformers_bf16_top1_agree']:.3f})"
        )
    except Exception as e:  # keep the throughput numbers
        report["checks"].append(f"logits check FAILED: {type(e).__name__}: {e}")
    save()
    if not args.skip_transformers:
        report["transformers"] = run_transformers(
            args.model_dir, args.batches, args.prompt_len, args.new_tokens, args.hf_caches
        )
    # Cross-checks of greedy tokens (bf16: informative; the tests assert on tiny models).
    by = {(r["mode"], r["batch"]): r["tokens"] for r in report["pdserve"]}
    for b in args.batches:
        for other in ("graphs-sync", "eager", "graphs-unfused"):
            if ("graphs", b) in by and (other, b) in by:
                same = sum(x == y for x, y in zip(by[("graphs", b)], by[(other, b)], strict=True))
                report["checks"].append(f"batch {b}: graphs vs {other}: {same}/{b} sequences token-identical")
        hf = [
            h for h in report["transformers"] if h["batch"] == b and "tokens" in h and h["cache"] == "dynamic"
        ]
        if ("graphs", b) in by and hf:
            prefix = [_common_prefix(x, y) for x, y in zip(by[("graphs", b)], hf[0]["tokens"], strict=True)]
            report["checks"].append(
                f"batch {b}: graphs vs transformers dynamic: mean identical prefix "
                f"{statistics.mean(prefix):.1f}/{args.new_tokens} tokens"
            )
    for r in report["pdserve"] + report["transformers"]:
        r.pop("tokens", None)
    save()
    print_tables(report)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
