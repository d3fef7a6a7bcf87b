"""Prefill context parallelism: time to first token of one long prompt at pcp 1 / 2 / 4, without
speculation and with a draft model.

    .venv/bin/python bench/pcp.py [--prompt-len 16384] [--sizes 1,2,4] [--budget 16384]
        [--model DIR | --layers 4 --hidden 256 --heads 8 --kv-heads 2] [--dtype auto]
        [--draft-layers 1 | --draft-model DIR] [--k 3]
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

The draft-model rows (``speculative: draft_model``, k ``--k``; the draft a tiny Llama of
``--draft-layers`` layers with the target's other sizes, or ``--draft-model``; ``--draft-layers
0`` skips them) step the engine themselves: TTFT as above, then the second step's time (the
draft model's first catch-up over the prompt and its first token, split over the ranks as the
prefill was, then k - 1 one-token draft forwards and the verifying target step), and the
split catch-up tokens rank 0 computed itself (about 1/N of the prompt). The catch-up feeds the
first sampled token, so it runs in the step after the first token: it shows in the second
step, not in TTFT.
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


def timed_steps(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, float, int]:
    """(TTFT, the second step's seconds, the first token) of one request stepped alone."""
    eng = llm.engine
    t = time.perf_counter()
    eng.add_request(prompt, params, f"bench-{t}")
    stamps: list[float] = []
    first = -1
    while eng.has_unfinished():
        for d in eng.step():
            if d.token_ids:
                if not stamps:
                    first = d.token_ids[0]
                stamps.append(time.perf_counter())
    assert len(stamps) >= 2, "the request ended before its second step"
    return stamps[0] - t, stamps[1] - stamps[0], first


def time_size(
    model: Path, pcp: int, args: argparse.Namespace, vocab: int, draft: Path | None
) -> dict[str, object]:
    """One row: ``draft`` None times ``generate`` (max_tokens 1), else the draft-model case."""
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
    if draft is not None:
        kw["speculative"] = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.k}
    # with a draft model: k drafts in the second step (a step emits at most max_tokens - 1 + 1)
    params = SamplingParams(temperature=0.0, max_tokens=1 if draft is None else args.k + 2, ignore_eos=True)
    ttfts: list[float] = []
    second: list[float] = []
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
        drafter = getattr(llm.engine.runner, "drafter", None)
        draft_split0 = getattr(drafter, "num_split_tokens", 0)
        for r in range(args.rounds):
            prompt = [random.Random(r).randrange(3, vocab) for _ in range(args.prompt_len)]
            c0 = [cpu_seconds(pid) for pid in pids]
            t = time.perf_counter()
            if draft is None:
                firsts.append(llm.generate([prompt], params)[0].outputs[0].token_ids[0])
                ttfts.append(time.perf_counter() - t)
            else:
                ttft, step2, token = timed_steps(llm, prompt, params)
                ttfts.append(ttft)
                second.append(step2)
                firsts.append(token)
            cpus.append([round(cpu_seconds(pid) - c, 2) for pid, c in zip(pids, c0, strict=True)])
            more = f", second step {second[-1]:.2f} s" if second else ""
            log(
                f"pcp {pcp} {case_name(draft)} round {r}: TTFT {ttfts[-1]:.2f} s{more}, CPU s per rank {cpus[-1]}"
            )
        draft_split = (getattr(drafter, "num_split_tokens", 0) - draft_split0) // args.rounds
    return {
        "pcp": pcp,
        "case": case_name(draft),
        "second_step_s": second,
        "second_step_median_s": statistics.median(second) if second else None,
        "rank0_draft_split_tokens": draft_split,
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


def case_name(draft: Path | None) -> str:
    return "plain" if draft is None else "draft"


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
    p.add_argument(
        "--draft-layers", type=int, default=1, help="the tiny draft model's layers (0: no draft rows)"
    )
    p.add_argument("--draft-model", default=None, help="a draft checkpoint (the target's tokenizer)")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens of the draft rows")
    p.add_argument("--dtype", default="auto", help="auto: float32 on the CPU, bfloat16 on CUDA")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: rank r on GPU r (NCCL)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="cpu_threads of every rank (0: auto)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        dims = dict(
            hidden_size=args.hidden,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            head_dim=args.hidden // args.heads,
            intermediate_size=4 * args.hidden,
            max_position_embeddings=args.prompt_len + 64,
        )
        if args.model is None:
            model = make_tiny_model("llama", Path(tmp) / "tiny", num_layers=args.layers, **dims)
        else:
            model = Path(args.model)
        draft: Path | None = None
        if args.draft_model is not None:
            draft = Path(args.draft_model)
        elif args.draft_layers > 0:
            if args.model is not None:
                raise SystemExit(
                    "--model needs --draft-model (a checkpoint with its tokenizer) or --draft-layers 0"
                )
            draft = make_tiny_model(
                "llama", Path(tmp) / "draft", num_layers=args.draft_layers, seed=1, **dims
            )
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        log(f"load average before: {loadavg()}")
        rows = [
            time_size(model, n, args, vocab, d)
            for d in ([None] if draft is None else [None, draft])
            for n in sizes
        ]
    print(
        f"\nTTFT of one {args.prompt_len}-token prompt, budget {args.budget}, {args.dtype} on {args.device}, "
        f"model {args.model or 'tiny'}, draft {args.draft_model or f'tiny, {args.draft_layers} layers'} (k {args.k})"
    )
    print(
        f"{'case':>6} {'pcp':>4} {'TTFT s':>8} {'speedup':>8} {'busiest rank CPU s':>19} {'speedup':>8} "
        f"{'rank 0 split':>13} {'2nd step s':>11} {'speedup':>8} {'rank 0 draft split':>19}"
    )
    for case in ("plain", "draft"):
        of_case = [row for row in rows if row["case"] == case]
        if not of_case:
            continue
        base, cpu_base, step_base = (
            of_case[0][k] for k in ("ttft_median_s", "max_rank_cpu_median_s", "second_step_median_s")
        )
        assert isinstance(base, float) and isinstance(cpu_base, float)
        for row in of_case:
            t, c, s2 = row["ttft_median_s"], row["max_rank_cpu_median_s"], row["second_step_median_s"]
            assert isinstance(t, float) and isinstance(c, float)
            speedups = f"{base / t:>7.2f}x {c:>19.2f} {cpu_base / c:>7.2f}x"
            step = "-" if s2 is None else f"{s2:.2f} {step_base / s2:>7.2f}x"  # type: ignore[operator]
            print(
                f"{case:>6} {row['pcp']:>4} {t:>8.2f} {speedups} {row['rank0_split_tokens']:>13} {step:>20} "
                f"{row['rank0_draft_split_tokens']:>19}"
            )
    firsts: set[tuple[object, ...]] = {tuple(row["first_tokens"]) for row in rows}  # type: ignore[arg-type]
    print("first tokens agree across sizes" if len(firsts) == 1 else f"FIRST TOKENS DIFFER: {firsts}")
    log(f"load average after: {loadavg()}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
