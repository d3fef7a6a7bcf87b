"""KV offload tier: a multi-turn chat workload whose working set is several times the device KV
budget, with the tier off, the host tier on, and host + disk on.

    .venv/bin/python bench/offload.py [--device cpu|cuda] [--conversations 16] [--turns 4]
        [--first-turn-tokens 512] [--turn-tokens 128] [--output-tokens 8] [--working-set-ratio 6]
        [--model DIR] [--out bench/results/offload.json]

In-process ``LLMEngine``, one request at a time (closed loop, concurrency 1), turn t of every
conversation before turn t + 1, so the other conversations evict each one between its turns.
A turn's prompt is the conversation so far (previous prompts and answers) plus
``--turn-tokens`` new tokens. The device KV budget is the working set (every conversation's
final history) divided by ``--working-set-ratio``; the host tier holds the whole working set
("host"), or half of it with the disk tier holding the whole ("host+disk": a host budget of half
the working set, so returning turns hit both tiers). TTFT is add_request to the first token on
the host (engine steps only; no server). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import loadavg, log, pct
from pdserve.config.engine import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.config.kv_offload import KVOffloadConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.models.make_model import make_tiny_model

BLOCK = 16


def run_mode(
    model: str, args: argparse.Namespace, num_blocks: int, offload: KVOffloadConfig | None
) -> dict[str, Any]:
    cfg = EngineConfig(
        model=model,
        device=args.device,
        cache=CacheConfig(block_size=BLOCK, num_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens),
        kv_offload=offload,
    )
    eng = LLMEngine(cfg, load_tokenizer_=False)
    vocab = eng.arch.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    histories = [
        [rng.randrange(vocab) for _ in range(args.first_turn_tokens)] for _ in range(args.conversations)
    ]
    ttft: dict[str, list[float]] = {"first": [], "returning": []}
    prefill_returning = 0
    answers: list[list[int]] = []
    t_all = time.perf_counter()
    for turn in range(args.turns):
        for c in range(args.conversations):
            if turn:
                histories[c] += [rng.randrange(vocab) for _ in range(args.turn_tokens)]
            before = eng.counters.num_prefill_tokens_total
            t0 = time.perf_counter()
            eng.add_request(list(histories[c]), params, f"c{c}t{turn}")
            first: float | None = None
            out: list[int] = []
            while eng.has_unfinished():
                for d in eng.step():
                    if d.token_ids and first is None:
                        first = time.perf_counter() - t0
                    out += d.token_ids
            assert first is not None and len(out) == args.output_tokens
            ttft["returning" if turn else "first"].append(first)
            if turn:
                prefill_returning += eng.counters.num_prefill_tokens_total - before
            histories[c] += out
            answers.append(out)
    wall = time.perf_counter() - t_all
    res: dict[str, Any] = {
        "wall_s": round(wall, 2),
        "prefill_tokens": eng.counters.num_prefill_tokens_total,
        "prefill_tokens_returning": prefill_returning,
        "ttft_first_p50_ms": round(pct(ttft["first"], 0.5) * 1e3, 2),
        "ttft_returning_p50_ms": round(pct(ttft["returning"], 0.5) * 1e3, 2),
        "ttft_returning_p99_ms": round(pct(ttft["returning"], 0.99) * 1e3, 2),
        "prefix_hit_rate": round(eng.kv.pool.hit_rate, 3),
        "answers_digest": hashlib.blake2b(json.dumps(answers).encode(), digest_size=8).hexdigest(),
    }
    if eng.offload is not None:
        m = eng.offload.manager
        res.update(
            hit_tokens_cpu=m.hit_tokens["cpu"],
            hit_tokens_disk=m.hit_tokens["disk"],
            stored_blocks=m.num_stored_blocks,
            dropped_blocks=m.num_dropped_blocks,
            load_s_total=round(m.load_seconds_sum, 3),
        )
    eng.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: a tiny random Llama)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-turn-tokens", type=int, default=512)
    ap.add_argument("--turn-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--working-set-ratio", type=float, default=6.0)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--modes", nargs="+", default=["off", "host", "host+disk"])
    ap.add_argument("--out", default="bench/results/offload.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(
            make_tiny_model(
                "llama",
                Path(tmp) / "m",
                hidden_size=256,
                num_layers=4,
                num_heads=4,
                num_kv_heads=2,
                head_dim=64,
                intermediate_size=512,
                max_position_embeddings=4096,
            )
        )
        probe = LLMEngine(
            EngineConfig(
                model=model, device=args.device, cache=CacheConfig(block_size=BLOCK, num_blocks_override=1)
            ),
            load_tokenizer_=False,
        )
        block_bytes = probe.cache_sizes.bytes_per_block
        probe.close()
        final_tokens = (
            args.first_turn_tokens + (args.turns - 1) * args.turn_tokens + args.turns * args.output_tokens
        )
        working_blocks = args.conversations * -(-final_tokens // BLOCK)
        num_blocks = max(-(-final_tokens // BLOCK) + 2, int(working_blocks / args.working_set_ratio))
        ws_bytes = working_blocks * block_bytes
        log(
            f"working set {working_blocks} blocks ({ws_bytes >> 20} MiB), device budget {num_blocks} blocks "
            f"(x{working_blocks / num_blocks:.1f}), load {loadavg()}"
        )
        modes: dict[str, KVOffloadConfig | None] = {
            "off": None,
            "host": KVOffloadConfig(cpu_bytes=ws_bytes),
            "host+disk": KVOffloadConfig(
                cpu_bytes=ws_bytes // 2, disk_path=str(Path(tmp) / "disk"), disk_bytes=2 * ws_bytes
            ),
            "disk": KVOffloadConfig(disk_path=str(Path(tmp) / "disk"), disk_bytes=2 * ws_bytes),
        }
        results = {}
        for mode in args.modes:
            results[mode] = run_mode(model, args, num_blocks, modes[mode])
            log(f"{mode}: {results[mode]}")
    digests = {r["answers_digest"] for r in results.values()}
    log(f"greedy answers {'identical' if len(digests) == 1 else 'DIFFER'} across modes: {digests}")
    cols = [
        "ttft_first_p50_ms",
        "ttft_returning_p50_ms",
        "ttft_returning_p99_ms",
        "prefill_tokens",
        "prefill_tokens_returning",
        "hit_tokens_cpu",
        "hit_tokens_disk",
        "wall_s",
    ]
    print(f"{'mode':10s} " + " ".join(f"{c:>24s}" for c in cols))
    for mode, r in results.items():
        print(f"{mode:10s} " + " ".join(f"{r.get(c, '-')!s:>24s}" for c in cols))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "loadavg": loadavg(), "results": results}, indent=2))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
