"""LoRA on the attention and on the experts of the MoE families equals transformers + peft
``PeftModel`` on the same checkpoint (greedy, fp32, base-model prompts in the same batch).

PEFT 0.21 adapts transformers 5's fused 3-D expert parameters through ``target_parameters``
(``lora.ParamWrapper``): one rank-r LoRA per expert over the whole gate_up_proj and one over
down_proj; pdserve reads those files (lora/peft_experts.py) and packs them into the fused layout
with each parameter's stored scale (lora/moe.py). The reference merges each adapter into its
own base model (``PeftModel.merge_and_unload``: PEFT's forward of expert parameters is that same
W + delta W, re-merged at every call, which makes the unmerged reference ~2x slower).
Default run: Mixtral with a plain and an rsLoRA adapter and base-model prompts in one batch;
PDSERVE_FULL_TESTS=1 adds Qwen3-MoE and one slot (evictions between steps)."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from pdserve.engine.sampling_params import SamplingParams
from tests.lora.adapters import make_adapter, peft_merged_greedy

NEW_TOKENS = 8
FULL = bool(os.environ.get("PDSERVE_FULL_TESTS"))
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# PEFT requires every adapter of a model that targets parameters to target the same ones.
MOE_ADAPTERS: dict[str, dict[str, Any]] = {
    "plain": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "target_parameters": EXPERTS},
    "rslora": {  # alpha / sqrt(r) != alpha / r for every rank used; the patterns reach the experts
        "r": 4,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "target_parameters": EXPERTS,
        "rank_pattern": {"down_proj": 2},
        "alpha_pattern": {r"layers\.0\.mlp\.experts\.gate_up_proj": 32},
    },
}


def _jobs(seed: int, count: int) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    names = ["plain", "rslora", ""]
    return [(names[i % 3], [rng.randrange(3, 500) for _ in range(rng.randint(3, 80))]) for i in range(count)]


@pytest.mark.parametrize(
    "arch,max_loras",
    [
        ("mixtral", 2),
        pytest.param("qwen3_moe", 2, marks=pytest.mark.skipif(not FULL, reason="PDSERVE_FULL_TESTS=1")),
        pytest.param("qwen3_moe", 1, marks=pytest.mark.skipif(not FULL, reason="PDSERVE_FULL_TESTS=1")),
    ],
)
def test_moe_adapters_equal_peft(arch, max_loras, tiny_model_factory, tmp_path_factory, make_llm):
    model_dir = tiny_model_factory(arch)
    root = tmp_path_factory.mktemp(f"moe-lora-{arch}")
    adapters = {
        n: make_adapter(model_dir, root / n, seed=i + 1, **kw)
        for i, (n, kw) in enumerate(MOE_ADAPTERS.items())
    }
    jobs = _jobs(0, 6)
    want = peft_merged_greedy(model_dir, adapters, jobs, NEW_TOKENS)
    llm = make_llm(
        model_dir,
        kv_cache_memory_bytes=8 << 20,
        lora={
            "max_loras": max_loras,
            "max_lora_rank": 4,
            "modules": {n: str(p) for n, p in adapters.items()},
        },
    )
    manager = llm.engine.lora.manager
    rs = manager.adapters["rslora"].modules
    # the stored scales: rsLoRA's alpha / sqrt(r) with the patterns' r and alpha, per expert
    assert rs["model.layers.0.mlp.experts.3.gate_up_proj"].scale == pytest.approx(32 / 2)
    assert rs["model.layers.0.mlp.experts.3.down_proj"].scale == pytest.approx(8 / 2**0.5)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [
        o.outputs[0].token_ids
        for o in llm.generate([p for _, p in jobs], sp, lora_request=[n for n, _ in jobs])
    ]
    assert got == want
    base = [o.outputs[0].token_ids for o in llm.generate([p for _, p in jobs], sp)]
    for name in MOE_ADAPTERS:  # every adapter changes its prompts' tokens
        assert any(g != b for (n, _), g, b in zip(jobs, got, base, strict=True) if n == name), name
    if max_loras == 1:
        assert manager.metrics.slot_evictions >= 2
