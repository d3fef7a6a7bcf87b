"""PEFT-made adapters for a tiny Llama checkpoint, and the PeftModel greedy reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig keywords: plain LoRA on q/v, rsLoRA with per-module patterns (its
# alpha / sqrt(r) differs from alpha / r for every rank used), MLP only.
ADAPTERS: dict[str, dict[str, Any]] = {
    "plain": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "rslora": {
        "r": 4,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ALL_LINEAR,
        "rank_pattern": {"down_proj": 8, r"layers\.1\.self_attn\.k_proj": 2},
        "alpha_pattern": {"o_proj": 32},
    },
    "mlp": {"r": 8, "lora_alpha": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
}


def make_adapter(model_dir: Path, out_dir: Path, seed: int = 0, std: float = 0.1, **lora_kw: Any) -> Path:
    """A PEFT LoRA folder with random A and B (PEFT starts B at zero, which would change nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **lora_kw))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    peft_model.save_pretrained(out_dir)
    return out_dir


def make_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    return {
        name: make_adapter(model_dir, root / name, seed=i + 1, **kw)
        for i, (name, kw) in enumerate(ADAPTERS.items())
    }


def peft_greedy(
    model_dir: Path, adapters: dict[str, Path], jobs: list[tuple[str, list[int]]], new_tokens: int
) -> list[list[int]]:
    """Greedy tokens of transformers + ``PeftModel`` for (adapter name or "" for base, prompt) jobs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.generation_config.eos_token_id = None
    names = list(adapters)
    model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    model.eval()
    out = []
    with torch.no_grad():
        for name, prompt in jobs:
            ids = torch.tensor([prompt])
            kw = dict(
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            if name:
                model.set_adapter(name)
                g = model.generate(input_ids=ids, **kw)
            else:
                with model.disable_adapter():
                    g = model.generate(input_ids=ids, **kw)
            out.append(g[0, len(prompt) :].tolist())
    return out


def peft_merged_greedy(
    model_dir: Path, adapters: dict[str, Path], jobs: list[tuple[str, list[int]]], new_tokens: int
) -> list[list[int]]:
    """``peft_greedy`` with each adapter merged into its own copy of the base model
    (``PeftModel.merge_and_unload``): what PEFT's forward computes for expert parameters anyway
    (W + delta W, ``ParamWrapper``), without re-merging the experts at every forward (~50 ms a
    parameter on the CI host: minutes for a tiny MoE's reference)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out: dict[int, list[int]] = {}
    for name in ["", *adapters]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if name:
            model = PeftModel.from_pretrained(model, str(adapters[name])).merge_and_unload()
        model.generation_config.eos_token_id = None
        model.eval()
        with torch.no_grad():
            for i, (job_name, prompt) in enumerate(jobs):
                if job_name != name:
                    continue
                ids = torch.tensor([prompt])
                g = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
                out[i] = g[0, len(prompt) :].tolist()
    return [out[i] for i in range(len(jobs))]
