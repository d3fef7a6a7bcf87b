"""Prefill context parallelism: time to first token of one long prompt at pcp 1 / 2 / 4.

    .venv/bin/python bench/pcp.py [--prompt-len 16384] [--sizes 1,2,4] [--budget 16384]
        [--model DIR | --layers 4 --hidden 256 --heads 8 --kv-heads 2] [--dtype auto]
        [--device cpu|cuda] [--rounds 2] [--threads N] [--out results.json]

Each size builds ``LLM(model, pcp=N)`` (rank 0 in this process, ranks 1..N-1 spawned; gloo on
the CPU, NCCL on GPUs with rank r on GPU r), warms up on a short split prompt, then times ``generate`` of one ``--prompt-len`` prompt
with ``max_tokens=1`` (a fresh prompt each round, prefix caching off): that is the TTFT of an
idle engine, prefill and the first sample; beside it each rank's CPU seconds in that call (on a
shared host the wall time also holds other processes' work: the busiest rank's CPU time is
what a host with a free core per rank would approach). ``--budget`` is the step's token budget (a prefill
node's default is 16,384: the whole prompt in one split chunk). The first tokens of every size
must agree (greedy). A CPU engine's ranks take ``cpu_threads`` each (auto: half the host's
cores over the ranks, at least one); ``--threads`` sets it for every size, and the pcp 1 row
is then also the one-process baseline with those threads.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import loadavg, log
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.models.make_model import make_tiny_model


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_size(model: Path, pcp: int, args: argparse.Namespace, vocab: int) -> dict[str, object]:
    rng = random.Random(1234)
    kw: dict[str, object] = dict(
        pcp=pcp,
        device=args.device,
        dtype=args.dtype,
        max_num_batched_tokens=args.budget,
        max_model_len=args.prompt_len + 8,
        enable_prefix_caching=False,
        max_num_seqs=4,
    )
    if args.threads:
        kw["cpu_threads"] = args.threads
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ttfts: list[float] = []
    cpus: list[list[float]] = []
    firsts: list[int] = []
    t0 = time.perf_counter()
    with LLM(str(model), **kw) as llm:
        start_s = time.perf_counter() - t0
        llm.generate([[rng.randrange(3, vocab) for _ in range(64 * pcp)]], params)  # warm-up
        workers = getattr(llm.engine.runner, "workers", None)
        pids = [os.getpid(), *(workers.pids() if workers is not None else [])]
        ctx = getattr(llm.engine.runner, "pcp", None)  # the split tokens rank 0 computed itself
        split0 = ctx.num_split_tokens if ctx is not None else 0
        for r in range(args.rounds):
            prompt = [random.Random(r).randrange(3, vocab) for _ in range(args.prompt_len)]
            c0 = [cpu_seconds(pid) for pid in pids]
            t = time.perf_counter()
            out = llm.generate([prompt], params)
            ttfts.append(time.perf_counter() - t)
            cpus.append([round(cpu_seconds(pid) - c, 2) for pid, c in zip(pids, c0, strict=True)])
            firsts.append(out[0].outputs[0].token_ids[0])
            log(f"pcp {pcp} round {r}: TTFT {ttfts[-1]:.2f} s, CPU s per rank {cpus[-1]}")
    return {
        "pcp": pcp,
        "ttft_s": ttfts,
        "ttft_median_s": statistics.median(ttfts),
        "cpu_s_per_rank": cpus,  # each round: CPU seconds of rank 0, 1, ...
        # the busiest rank's CPU seconds: what a host with a free core per rank approaches (the
        # exchange's waits aside); on a busy host the wall time also holds other processes' work
        "max_rank_cpu_median_s": statistics.median(max(c) for c in cpus),
        "first_tokens": firsts,
        "engine_start_s": round(start_s, 2),
        "rank0_split_tokens": ((ctx.num_split_tokens if ctx is not None else 0) - split0) // args.rounds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=16384)
    p.add_argument("--sizes", default="1,2,4")
    p.add_argument("--budget", type=int, default=16384, help="max_num_batched_tokens")
    p.add_argument("--model", default=None, help="a checkpoint folder (default: a tiny random Llama)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dtype", default="auto", help="auto: float32 on the CPU, bfloat16 on CUDA")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: rank r on GPU r (NCCL)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="cpu_threads of every rank (0: auto)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            model = make_tiny_model(
                "llama",
                Path(tmp) / "tiny",
                num_layers=args.layers,
                hidden_size=args.hidden,
                num_heads=args.heads,
                num_kv_heads=args.kv_heads,
                head_dim=args.hidden // args.heads,
                intermediate_size=4 * args.hidden,
                max_position_embeddings=args.prompt_len + 64,
            )
        else:
            model = Path(args.model)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        log(f"load average before: {loadavg()}")
        rows = [time_size(model, n, args, vocab) for n in sizes]
    base = rows[0]["ttft_median_s"]
    assert isinstance(base, float)
    print(
        f"\nTTFT of one {args.prompt_len}-token prompt, budget {args.budget}, {args.dtype} on {args.device}, model {args.model or 'tiny'}"
    )
    cpu_base = rows[0]["max_rank_cpu_median_s"]
    assert isinstance(cpu_base, float)
    print(
        f"{'pcp':>4} {'TTFT s':>8} {'speedup':>8} {'busiest rank CPU s':>19} {'speedup':>8} {'rank 0 split':>13}"
    )
    for row in rows:
        t, c = row["ttft_median_s"], row["max_rank_cpu_median_s"]
        assert isinstance(t, float) and isinstance(c, float)
        speedups = f"{base / t:>7.2f}x {c:>19.2f} {cpu_base / c:>7.2f}x"
        print(f"{row['pcp']:>4} {t:>8.2f} {speedups} {row['rank0_split_tokens']:>13}")
    firsts = {tuple(row["first_tokens"]) for row in rows}  # type: ignore[arg-type]
    print("first tokens agree across sizes" if len(firsts) == 1 else f"FIRST TOKENS DIFFER: {firsts}")
    log(f"load average after: {loadavg()}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
