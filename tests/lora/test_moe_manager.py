"""The LoRA manager on a tiny Mixtral: an adapter of the transformers 4 per-expert layout
(``block_sparse_moe.experts.{e}.w1 / w3 / w2``) loads and packs into the fused layout (gate's
rank block, then up's, block-diagonal B) with its stored scales; an expert name the model lacks
is refused naming it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pdserve.config.lora import LoRAConfig
from pdserve.lora.manager import LoRAManager
from pdserve.lora.moe import ExpertLoRASlots
from pdserve.lora.peft import LoRAAdapterError
from pdserve.models.loader import load_model

R = 2


def _folder(tmp_path, model_dir, names: dict[str, tuple[int, int]]):
    tensors = {}
    for name, (i, o) in names.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(R, i)
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(o, R)
    tmp_path.mkdir()
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    cfg = {"peft_type": "LORA", "r": R, "lora_alpha": 6, "use_rslora": True, "bias": "none"}
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    return tensors


def test_per_expert_mixtral_adapter_packs_into_the_fused_layout(tiny_model_factory, tmp_path):
    torch.manual_seed(0)
    model_dir = tiny_model_factory("mixtral")
    model, cfg = load_model(model_dir, torch.float32, "cpu")
    assert cfg.moe is not None
    h, inter = cfg.hidden_size, cfg.moe.expert_intermediate_size
    mgr = LoRAManager(model, LoRAConfig(max_loras=2, max_lora_rank=4), torch.float32, torch.device("cpu"))
    prefix = "model.layers.1.block_sparse_moe.experts.5"
    sizes = {f"{prefix}.w1": (h, inter), f"{prefix}.w3": (h, inter), f"{prefix}.w2": (inter, h)}
    tensors = _folder(tmp_path / "v4", model_dir, sizes)
    mgr.add_adapter("v4", tmp_path / "v4")
    mgr.activate(["v4"])
    slot = mgr.slot_of["v4"]
    experts = model.model.layers["1"].mlp.experts.lora
    assert isinstance(experts, ExpertLoRASlots)
    scale = 6 / R**0.5  # rsLoRA, stored at load
    a = {p: tensors[f"base_model.model.{prefix}.{p}.lora_A.weight"] for p in ("w1", "w3", "w2")}
    b = {p: tensors[f"base_model.model.{prefix}.{p}.lora_B.weight"] for p in ("w1", "w3", "w2")}
    torch.testing.assert_close(experts.a13[slot, 5, :R], a["w1"])  # gate's block
    torch.testing.assert_close(experts.a13[slot, 5, 4 : 4 + R], a["w3"])  # up's block at max_rank
    torch.testing.assert_close(experts.b13[slot, 5, :inter, :R], b["w1"])
    torch.testing.assert_close(experts.b13[slot, 5, inter:, 4 : 4 + R], b["w3"])
    assert not experts.b13[slot, 5, :inter, 4:].any() and not experts.b13[slot, 5, inter:, :4].any()
    torch.testing.assert_close(experts.a2[slot, 5, :R], a["w2"])
    assert experts.s13[slot, 5, :R].tolist() == pytest.approx([scale] * R)
    assert experts.s2[slot, 5, :R].tolist() == pytest.approx([scale] * R)
    assert not experts.a13[slot, 4].any() and experts.has_lora[slot]  # other experts untouched
    assert not model.model.layers["0"].mlp.experts.lora.has_lora[slot]  # type: ignore[union-attr]

    _folder(tmp_path / "bad", model_dir, {"model.layers.1.block_sparse_moe.experts.8.w1": (h, inter)})
    with pytest.raises(LoRAAdapterError, match=r"experts\.8\.w1.*not a LoRA-capable layer"):
        mgr.add_adapter("bad", tmp_path / "bad")
