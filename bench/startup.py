"""Engine start-up with the default KV budget: tiny model, whole GPU (or the CPU default).

    python bench/startup.py [--device cuda] [--layers 2]

A tiny model on a large GPU gets millions of KV blocks (90% of free memory / a few KiB each):
this times building the engine (weights, KV cache, block pool, CUDA-graph capture) and its first
request, and prints the block count and the process's peak host memory.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import torch

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.models.make_model import make_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        make_tiny_model("llama", model_dir, num_layers=args.layers)
        t0 = time.perf_counter()
        llm = LLM(str(model_dir), device=args.device)
        t1 = time.perf_counter()
        out = llm.generate([[3, 4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        t2 = time.perf_counter()
        eng = llm.engine
        peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(
            f"device {args.device}: {eng.cache_sizes.num_blocks:,} KV blocks of {eng.cache_sizes.bytes_per_block:,} B; "
            f"engine up in {t1 - t0:.2f} s, first request ({len(out[0].outputs[0].token_ids)} tokens) in {t2 - t1:.2f} s; "
            f"peak host RSS {peak_gib:.2f} GiB; blocks left in use {eng.kv.pool.num_used_blocks}"
        )


if __name__ == "__main__":
    main()
