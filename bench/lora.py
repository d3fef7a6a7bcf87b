"""Multi-LoRA throughput: output tok/s of one batch with 1, 4 and 16 distinct adapters against
the base model alone, in one run (in-process ``LLM``, greedy, ``ignore_eos``).

    .venv/bin/python bench/lora.py [--device cpu|cuda] [--batch N] [--reps 3] [--max-tokens 64]
                                   [--apply-modes segmented dense] [--out bench/results/lora.json]
                                   [--arch llama|mixtral|qwen3_moe]

Defaults: CPU, batch 16; ``--device cuda`` defaults to batch 64 and bfloat16 (the GPU target
is >= 0.8 of base throughput with 16 adapters). The model is a random tiny Llama (``MODEL``,
written once under ``.models/``; ``--arch`` mixtral / qwen3_moe: the MoE families, 8 experts,
top 2); the adapters are random PEFT folders (rank ``--rank`` on every linear layer, and on an
MoE model also on the experts' fused parameters as PEFT's target_parameters saves them, written
next to it), so nothing is downloaded. Each (rep, variant) runs the same
prompts; variants alternate within a rep so host load hits all alike. Rows:

    base            LLM without lora settings
    base+lora-off   LLM with lora settings, every request on the base model (the hook's cost)
    K adapters      the batch spread over K distinct adapters (requests i -> adapter i mod K)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import loadavg, log  # noqa: E402

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
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """``count`` random PEFT LoRA folders (all linear layers, rank ``rank``, alpha 2 * rank)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    shapes |= {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    sparse = _sparse_layers(cfg)
    paths = []
    for i in range(count):
        folder = out / f"adapter-{i}"
        paths.append(folder)
        if (folder / "adapter_model.safetensors").exists():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(layers):
            for name, (i_f, o_f) in shapes.items():
                part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                if part == "mlp" and layer in sparse:
                    continue  # an MoE layer: its experts get _expert_tensors
                key = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, i_f, generator=gen) * 0.05
                tensors[f"{key}.lora_B.weight"] = torch.randn(o_f, rank, generator=gen) * 0.05
        experts = _expert_tensors(cfg, rank, gen)
        tensors |= experts
        save_file(tensors, folder / "adapter_model.safetensors")
        config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": LINEAR,
            "bias": "none",
        }
        if experts:
            config["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        (folder / "adapter_config.json").write_text(json.dumps(config))
    return paths


def _sparse_layers(cfg: dict[str, Any]) -> set[int]:
    """The layers holding experts (none for a dense model)."""
    if not (cfg.get("num_local_experts") or cfg.get("num_experts")):
        return set()
    return set(range(cfg["num_hidden_layers"])) - set(cfg.get("mlp_only_layers") or [])


def _expert_tensors(cfg: dict[str, Any], rank: int, gen: Any) -> dict[str, Any]:
    """An MoE model's expert LoRA as PEFT's target_parameters saves it (lora/peft_experts.py):
    per layer, gate_up_proj under ``experts.base_layer``, down_proj under ``experts``."""
    import torch

    e = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not e:
        return {}
    h = cfg["hidden_size"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    out = {}
    for layer in sorted(_sparse_layers(cfg)):
        key = f"base_model.model.model.layers.{layer}.mlp.experts"
        for sub, (i_f, o_f) in {".base_layer": (h, 2 * inter), "": (inter, h)}.items():
            out[f"{key}{sub}.lora_A.weight"] = torch.randn(rank * e, i_f, generator=gen) * 0.05
            out[f"{key}{sub}.lora_B.weight"] = torch.randn(o_f, rank * e, generator=gen) * 0.05
    return out


def run_variant(llm: Any, prompts: list[list[int]], loras: list[str] | None, max_tokens: int) -> float:
    from pdserve.engine.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, lora_request=loras)
    wall = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return len(prompts) * max_tokens / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--batch", type=int, default=None, help="default: 16 on cpu, 64 on cuda")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument(
        "--apply-modes", nargs="+", default=["auto"], choices=["auto", "segmented", "dense", "bgmv"]
    )
    ap.add_argument("--arch", choices=["llama", "mixtral", "qwen3_moe"], default="llama")
    ap.add_argument("--model-dir", type=Path, default=None, help="default: .models/bench-lora-ARCH")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lora.json")
    args = ap.parse_args()
    batch = args.batch or (64 if args.device == "cuda" else 16)
    dtype = "bfloat16" if args.device == "cuda" else "float32"

    import random

    from pdserve.engine.llm import LLM
    from pdserve.models.make_model import make_tiny_model

    args.model_dir = args.model_dir or ROOT / ".models" / f"bench-lora-{args.arch}"
    if not (args.model_dir / "config.json").exists():
        make_tiny_model(args.arch, args.model_dir, **MODEL)  # type: ignore[arg-type]
    n_adapters = max(args.adapters)
    paths = write_adapters(args.model_dir, args.model_dir / "adapters", n_adapters, args.rank)
    modules = {f"a{i}": str(p) for i, p in enumerate(paths)}
    rng = random.Random(0)
    common = dict(device=args.device, dtype=dtype, kv_cache_memory_bytes=256 << 20, max_num_seqs=batch)
    log(
        f"{args.arch} on {args.device}, batch {batch}, {args.max_tokens} new tokens, rank {args.rank}, "
        f"load {loadavg()}"
    )
    engines: dict[str, Any] = {"base": LLM(str(args.model_dir), **common)}  # type: ignore[arg-type]
    for mode in args.apply_modes:
        lora = {"max_loras": n_adapters, "max_lora_rank": args.rank, "apply_mode": mode, "modules": modules}
        engines[mode] = LLM(str(args.model_dir), lora=lora, **common)  # type: ignore[arg-type]
    variants: list[tuple[str, str, int]] = [("base", "base", 0)]
    for mode in args.apply_modes:
        variants.append((f"base+lora-off ({mode})", mode, 0))
        variants += [(f"{k} adapters ({mode})", mode, k) for k in args.adapters]
    results: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    warm = [[rng.randrange(3, 500) for _ in range(8)] for _ in range(2)]
    for llm in engines.values():
        llm.generate(warm, None)
    for rep in range(args.reps):
        prompts = [[rng.randrange(3, 500) for _ in range(args.prompt_len)] for _ in range(batch)]
        for name, engine, k in variants:
            loras = [f"a{i % k}" for i in range(batch)] if k else None
            results[name].append(run_variant(engines[engine], prompts, loras, args.max_tokens))
        log(f"rep {rep + 1}/{args.reps} done, load {loadavg()}")
    base = statistics.median(results["base"])
    print(f"\n{'variant':<28} {'tok/s (median)':>15} {'vs base':>8}   reps")
    rows = {}
    for name, vals in results.items():
        med = statistics.median(vals)
        rows[name] = {"median_tok_s": med, "reps": vals, "vs_base": med / base}
        print(f"{name:<28} {med:>15.1f} {med / base:>8.2f}   {', '.join(f'{v:.0f}' for v in vals)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"device": args.device, "arch": args.arch, "batch": batch, "rows": rows, "load": loadavg()},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
