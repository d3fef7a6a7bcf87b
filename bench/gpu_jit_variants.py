"""Triton kernels compiled while serving: do batch shapes keep adding compiled variants?

    python bench/gpu_jit_variants.py [--requests 300] [--seed 0]

A Triton kernel is compiled again for every new specialization of its arguments: an integer
argument equal to 1 or divisible by 16, a pointer aligned to 16 bytes. An argument that follows
the batch (the number of sequences, the block table's width) therefore compiles a kernel anew,
for ~0.3-1 s on the engine thread, the first few times each combination turns up -- in the
middle of serving. This drives one engine (tiny Llama, the Llama-1B head layout, CUDA graphs)
through two phases of random traffic (prompt lengths 1-700, 1-64 new tokens, 0-8 arrivals per
step) with an empty Triton cache, and prints, per phase, the variants compiled per kernel (the
``.cubin`` files in the fresh cache) and the steps slower than 5x the median with their time. A
kernel whose specializations are all fixed at start-up compiles nothing in phase 2.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = tempfile.mkdtemp(prefix="pdserve-triton-cache-")
os.environ["TRITON_CACHE_DIR"] = CACHE  # before triton is imported: every compile is counted


def variants() -> Counter[str]:
    return Counter(p.stem for p in Path(CACHE).rglob("*.cubin"))


def phase(engine, rng: random.Random, n: int, vocab: int, tag: str) -> dict:  # type: ignore[no-untyped-def]
    from pdserve.engine.sampling_params import SamplingParams

    before = variants()
    pending = n
    step_s: list[float] = []
    k = 0
    while pending or engine.has_unfinished():
        for _ in range(min(pending, rng.randint(0, 8))):
            plen = rng.randint(1, 700)
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 64), ignore_eos=True)
            engine.add_request([rng.randrange(5, vocab) for _ in range(plen)], params, f"{tag}-{k}")
            k += 1
            pending -= 1
        t0 = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t0)
    new = variants() - before
    med = statistics.median(step_s)
    slow = [s for s in step_s if s > 5 * med]
    return {"new": new, "steps": len(step_s), "median_ms": med * 1e3, "slow": len(slow), "slow_s": sum(slow)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300, help="requests per phase")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    from pdserve.engine.llm import LLM
    from pdserve.models.make_model import make_tiny_model

    vocab = 4096
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model(
            "llama",
            d,
            hidden_size=512,
            num_layers=2,
            num_heads=8,
            num_kv_heads=2,
            head_dim=64,
            vocab_size=vocab,
        )
        t0 = time.perf_counter()
        llm = LLM(
            str(path), device=args.device, dtype="bfloat16", max_model_len=1024, kv_cache_memory_bytes=1 << 30
        )
        start = variants()
        print(
            f"engine up in {time.perf_counter() - t0:.1f} s; {sum(start.values())} kernel variants compiled at start"
        )
        rng = random.Random(args.seed)
        rows = [phase(llm.engine, rng, args.requests, vocab, f"p{i}") for i in (1, 2)]
    print(
        f"\n{'phase':<6} {'steps':>6} {'median ms':>10} {'slow steps':>11} {'their s':>8}  new variants per kernel"
    )
    for i, r in enumerate(rows, 1):
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["new"].items())) or "none"
        print(f"{i:<6} {r['steps']:>6} {r['median_ms']:>10.2f} {r['slow']:>11} {r['slow_s']:>8.2f}  {kinds}")
    total = variants()
    print("\nall variants at the end: " + ", ".join(f"{k} {v}" for k, v in sorted(total.items())))


if __name__ == "__main__":
    main()
