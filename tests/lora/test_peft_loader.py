"""PEFT folders -> LoRAAdapter: each module's stored scale, and every refusal by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.lora.peft import LoRAAdapterError, load_peft_adapter, module_rank_alpha, module_scale

HIDDEN, INTER = 8, 12
TARGETS = {
    f"model.layers.{i}.{part}": shape
    for i in range(2)
    for part, shape in {
        "self_attn.q_proj": (HIDDEN, HIDDEN),
        "self_attn.v_proj": (HIDDEN, 4),
        "mlp.down_proj": (INTER, HIDDEN),
    }.items()
}


def _write(folder: Path, config: dict, modules: dict[str, tuple[int, int, int]]) -> Path:
    """``modules``: name -> (rank, in, out); lora_A / lora_B random."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "none", **config}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = {}
    for name, (r, i, o) in modules.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(r, i)
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(o, r)
    save_file(tensors, folder / "adapter_model.safetensors")
    return folder


def test_scale_rslora_and_patterns(tmp_path):
    cfg = {
        "use_rslora": True,
        "rank_pattern": {"down_proj": 2, r"layers\.1\.self_attn\.q_proj": 6},
        "alpha_pattern": {"v_proj": 32},
    }
    mods = {
        "model.layers.0.self_attn.q_proj": (4, HIDDEN, HIDDEN),
        "model.layers.1.self_attn.q_proj": (6, HIDDEN, HIDDEN),
        "model.layers.0.self_attn.v_proj": (4, HIDDEN, 4),
        "model.layers.1.mlp.down_proj": (2, INTER, HIDDEN),
    }
    a = load_peft_adapter("x", _write(tmp_path / "a", cfg, mods), TARGETS, max_lora_rank=8)
    m = a.modules
    assert m["model.layers.0.self_attn.q_proj"].scale == pytest.approx(8 / math.sqrt(4))  # not 8 / 4
    assert m["model.layers.1.self_attn.q_proj"].scale == pytest.approx(8 / math.sqrt(6))
    assert m["model.layers.0.self_attn.v_proj"].scale == pytest.approx(32 / math.sqrt(4))
    assert m["model.layers.1.mlp.down_proj"].scale == pytest.approx(8 / math.sqrt(2))
    assert a.max_rank == 6
    # the stored scale is what the module's delta uses
    w = m["model.layers.1.mlp.down_proj"]
    x = torch.randn(3, INTER)
    torch.testing.assert_close(w.delta(x), (x @ w.a.T) @ w.b.T * (8 / math.sqrt(2)))


def test_plain_scale_and_peft_pattern_rule():
    assert module_scale(8, 16, False) == 2.0 and module_scale(4, 8, True) == 4.0
    cfg = {"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 4}, "alpha_pattern": {}}
    assert module_rank_alpha(cfg, "model.layers.0.self_attn.q_proj") == (4, 16.0)
    assert module_rank_alpha(cfg, "model.layers.0.self_attn.xq_proj") == (8, 16.0)  # whole names only


QPROJ = {"model.layers.0.self_attn.q_proj": (4, HIDDEN, HIDDEN)}


@pytest.mark.parametrize(
    "config,modules,words",
    [
        ({"use_dora": True}, QPROJ, "DoRA"),
        ({"peft_type": "IA3"}, QPROJ, "PEFT type 'IA3'"),
        ({"modules_to_save": ["lm_head"]}, QPROJ, "modules_to_save"),
        ({"bias": "all"}, QPROJ, "bias 'all'"),
        ({}, {"model.layers.0.self_attn.o_proj": (4, HIDDEN, HIDDEN)}, "not a LoRA-capable layer"),
        ({}, {"model.layers.5.self_attn.q_proj": (4, HIDDEN, HIDDEN)}, "not a LoRA-capable layer"),
        ({}, {"model.layers.0.self_attn.q_proj": (4, HIDDEN + 1, HIDDEN)}, "base-model mismatch"),
        (
            {"r": 16, "lora_alpha": 16},
            {"model.layers.0.self_attn.q_proj": (16, HIDDEN, HIDDEN)},
            "max_lora_rank",
        ),
    ],
)
def test_refusals(tmp_path, config, modules, words):
    folder = _write(tmp_path / "a", config, modules)
    with pytest.raises(LoRAAdapterError, match=words):
        load_peft_adapter("x", folder, TARGETS, max_lora_rank=8)


def test_malformed_files(tmp_path):
    with pytest.raises(LoRAAdapterError, match="not a folder"):
        load_peft_adapter("x", tmp_path / "nothing", TARGETS, 8)
    folder = _write(tmp_path / "a", {}, QPROJ)
    (folder / "adapter_model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(LoRAAdapterError, match="malformed safetensors"):
        load_peft_adapter("x", folder, TARGETS, 8)
    (folder / "adapter_config.json").write_text("[1, 2")
    with pytest.raises(LoRAAdapterError, match="malformed JSON"):
        load_peft_adapter("x", folder, TARGETS, 8)


def test_content_hash_is_the_identity(tmp_path):
    torch.manual_seed(0)
    a = load_peft_adapter("x", _write(tmp_path / "a", {}, QPROJ), TARGETS, 8)
    b = load_peft_adapter("x", _write(tmp_path / "b", {}, QPROJ), TARGETS, 8)  # other random weights
    again = load_peft_adapter("x", tmp_path / "a", TARGETS, 8)
    assert a.ident == again.ident and a.ident != b.ident
