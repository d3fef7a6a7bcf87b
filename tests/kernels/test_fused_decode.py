"""models/fused_decode.py: a Llama decoder layer through the fused GEMV path gives what the
separate kernels give (input norm + qkv, post-attention norm + gate_up, SiLU * up + down, the
residual stream), and the path is taken only where it reproduces the layer. The attention between
the projections is replaced by a fixed function of its input (this module does not touch it).
CPU runs use TRITON_INTERPRET=1 (tests/kernels/conftest.py), float32 for exact comparison."""

from __future__ import annotations

import pytest
import torch

from pdserve.models import fused_decode
from pdserve.models.config import ModelArchConfig

pytest.importorskip("triton", reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

HF = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
}


def _layer(attention_bias: bool = False):
    from pdserve.models.llama import LlamaDecoderLayer

    torch.manual_seed(0)
    cfg = ModelArchConfig.from_hf({**HF, "attention_bias": attention_bias})
    layer = LlamaDecoderLayer(cfg, 1).to(DEVICE)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        if attention_bias:
            layer.self_attn.o_proj.bias = None  # Qwen2: q/k/v bias only
    attn = layer.self_attn
    # The attention between the projections, as a fixed function of q (unit under test: the rest).
    attn.attend_qkv = lambda qkv, *a: torch.tanh(qkv[:, : attn.q_size]) * 1.5
    return layer


@pytest.mark.parametrize(("rows", "attention_bias"), [(1, False), (5, True)])
def test_fused_layer_equals_the_separate_kernels(monkeypatch, attention_bias: bool, rows: int) -> None:
    monkeypatch.setattr(fused_decode, "DEVICE_TYPES", ("cpu", "cuda"))
    monkeypatch.setattr(fused_decode, "DTYPES", (torch.float32,))
    layer = _layer(attention_bias)
    hidden = torch.randn(rows, 48, device=DEVICE)
    residual = torch.randn(rows, 48, device=DEVICE)
    args = (torch.zeros(rows, dtype=torch.long), None, None, None)
    with torch.no_grad():
        monkeypatch.setattr(fused_decode, "ENABLED", False)
        want_out, want_res = layer(hidden, residual.clone(), *args)
        monkeypatch.setattr(fused_decode, "ENABLED", True)
        assert fused_decode.applies(layer, hidden)
        got_out, got_res = layer(hidden, residual.clone(), *args)
    torch.testing.assert_close(got_res, want_res, rtol=1e-5, atol=1e-5)  # o differs by a rounding step
    torch.testing.assert_close(got_out, want_out, rtol=1e-4, atol=1e-4)


def test_taken_only_where_it_reproduces_the_layer(monkeypatch) -> None:
    monkeypatch.setattr(fused_decode, "ENABLED", True)
    monkeypatch.setattr(fused_decode, "DEVICE_TYPES", ("cpu", "cuda"))
    monkeypatch.setattr(fused_decode, "DTYPES", (torch.float32,))
    layer = _layer()
    assert fused_decode.applies(layer, torch.zeros(8, 48, device=DEVICE))
    assert not fused_decode.applies(layer, torch.zeros(9, 48, device=DEVICE))  # past MAX_ROWS
    assert not fused_decode.applies(layer, torch.zeros(1, 48, device=DEVICE, dtype=torch.float64))
    layer.mlp.down_proj.lora = object()  # a served LoRA adapter: its delta needs the plain path
    assert not fused_decode.applies(layer, torch.zeros(1, 48, device=DEVICE))
    monkeypatch.setattr(fused_decode, "DEVICE_TYPES", ("cuda",))
    if DEVICE == "cpu":
        assert not fused_decode.applies(_layer(), torch.zeros(1, 48))
