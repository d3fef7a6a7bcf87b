"""Config parsing, registry and loader edge cases."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from pdserve.errors import ConfigError, UnsupportedError
from pdserve.models.config import ModelArchConfig, RopeConfig
from pdserve.models.loader import iter_safetensors, load_model, load_tokenizer
from pdserve.models.qwen3 import Qwen3ForCausalLM
from pdserve.models.registry import get_model_class

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def _copy_with_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unknown_architecture_raises(tiny_models: Mapping[str, Path], tmp_path: Path) -> None:
    model_dir = _copy_with_config(tiny_models["llama"], tmp_path / "m", architectures=["FooForCausalLM"])
    with pytest.raises(UnsupportedError, match=r"FooForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(model_dir, torch.float32, "cpu")
    assert get_model_class(["FooModel", "Qwen3ForCausalLM"]) is Qwen3ForCausalLM


def test_unsupported_features_raise() -> None:
    with pytest.raises(UnsupportedError, match="yarn"):
        ModelArchConfig.from_hf(
            {**BASE, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4}}
        )
    with pytest.raises(UnsupportedError, match="sliding"):
        ModelArchConfig.from_hf({**BASE, "layer_types": ["sliding_attention", "full_attention"]})
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelArchConfig.from_hf({k: v for k, v in BASE.items() if k != "hidden_size"})


def test_config_fields_v4_and_v5_rope() -> None:
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    v4 = ModelArchConfig.from_hf(
        {
            **BASE,
            "rope_theta": 5e5,
            "rope_scaling": {"rope_type": "llama3", **scaling},
            "torch_dtype": "bfloat16",
        },
        {"eos_token_id": [7, 9], "bos_token_id": 1},
    )
    v5 = ModelArchConfig.from_hf(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}, "eos_token_id": 9}
    )
    assert v4.rope == v5.rope == RopeConfig("llama3", 5e5, 8.0, 1.0, 4.0, 64)
    assert v4.head_dim == 4 and v4.num_key_value_heads == 2 and v4.torch_dtype == "bfloat16"
    assert v4.eos_token_ids == (7, 9) and v4.bos_token_id == 1 and v5.eos_token_ids == (9,)
    assert ModelArchConfig.from_hf(
        {**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}}
    ).rope == RopeConfig("linear", 1e4, factor=2.0)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_inv_freq_matches_transformers(rope_parameters: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, rope_parameters=dict(rope_parameters))
    rope_type = rope_parameters["rope_type"]
    if rope_type == "default":
        expected = 1.0 / (1e4 ** (torch.arange(0, 32, 2, dtype=torch.int64).float() / 32))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    ours = ModelArchConfig.from_hf({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    torch.testing.assert_close(ours.rope.inv_freq(ours.head_dim), expected, rtol=1e-6, atol=0)


def test_sharded_checkpoint_reads_only_needed_shards(tiny_models: Mapping[str, Path], tmp_path: Path) -> None:
    """Sharded save (index.json); a last stage must not open shards without its tensors."""
    from transformers import AutoModelForCausalLM

    src = tiny_models["llama"]
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    shutil.copy(src / "generation_config.json", sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2

    full, _ = load_model(src, torch.float32, "cpu")
    last, _ = load_model(sharded, torch.float32, "cpu", layer_start=1)
    assert last.layer_names == ["model.layers.1.self_attn"]
    full_params = dict(full.named_parameters())
    for name, param in last.named_parameters():
        torch.testing.assert_close(param, full_params[name], rtol=0, atol=0)
    # Only shards that hold layer 1 / norm / lm_head are opened.
    needed = {f for n, f in index.items() if last.needs_weight(n)}
    embed_shard = index["model.embed_tokens.weight"]
    assert embed_shard not in needed
    (sharded / embed_shard).unlink()  # would raise if the loader tried to open it
    load_model(sharded, torch.float32, "cpu", layer_start=1)


def test_missing_weight_raises(tiny_models: Mapping[str, Path]) -> None:
    model, _ = load_model(tiny_models["llama"], torch.float32, "cpu")
    weights = [
        (n, t)
        for n, t in iter_safetensors(tiny_models["llama"], lambda n: True)
        if "layers.1.mlp.up_proj" not in n
    ]
    with pytest.raises(ConfigError, match=r"layers\.1\.mlp\.gate_up_proj\.weight\[up\]"):
        model.load_weights(weights)
    with pytest.raises(ConfigError, match="has shape"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])


def test_stage_range_and_tokenizer(tiny_models: Mapping[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"\[1, 1\)"):
        load_model(tiny_models["qwen2"], torch.float32, "cpu", layer_start=1, layer_end=1)
    tok = load_tokenizer(tiny_models["qwen2"])
    _, cfg = load_model(tiny_models["qwen2"], torch.bfloat16, "cpu", layer_end=1)
    assert cfg.eos_token_ids == (tok.eos_token_id,) and len(tok) <= cfg.vocab_size
    assert tok.decode(tok.encode("héllo, 世界!")) == "héllo, 世界!"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_meta_build_runs_no_random_init(tiny_models: Mapping[str, Path], monkeypatch) -> None:
    """load_model builds on the meta device: no init op runs there (normal_ on a meta tensor
    imports torch._dynamo, ~1.2 s of every node process's start), and the checkpoint's weights
    are what the model holds."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a random init ran during load_model")

    model_dir = tiny_models["llama"]  # built (by transformers, with its init) before the patch
    monkeypatch.setattr(torch.nn.init, "normal_", refuse)
    model, _ = load_model(model_dir, torch.float32, "cpu")
    want = dict(iter_safetensors(model_dir, lambda name: name == "model.embed_tokens.weight"))
    assert torch.equal(model.model.embed_tokens.weight, want["model.embed_tokens.weight"])
