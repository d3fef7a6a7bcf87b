"""cuda_graphs_off_reason: which runners capture no CUDA graphs, and the reason they log (the
first that applies). A torch.device("cuda") object needs no GPU; the model is a stand-in with the
two stage flags the check reads."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from pdserve.config.engine import EngineConfig
from pdserve.config.lora import LoRAConfig
from pdserve.engine.cuda_graphs import cuda_graphs_off_reason

CUDA = torch.device("cuda")
LORA = LoRAConfig(max_loras=1, max_lora_rank=2)


def _model(first: bool = True, last: bool = True) -> Any:
    return SimpleNamespace(is_first_stage=first, is_last_stage=last)


def test_a_whole_model_on_cuda_with_triton_attention_captures() -> None:
    assert cuda_graphs_off_reason(EngineConfig(model="/m"), CUDA, "triton", _model()) is None


def test_each_reason_in_order() -> None:
    cfg = EngineConfig(model="/m")
    assert cuda_graphs_off_reason(cfg, torch.device("cpu"), "triton", _model()) == "device cpu"
    eager = EngineConfig(model="/m", enforce_eager=True, lora=LORA)
    assert cuda_graphs_off_reason(eager, CUDA, "torch", _model()) == "enforce_eager=True"
    lora = cuda_graphs_off_reason(EngineConfig(model="/m", lora=LORA), CUDA, "torch", _model())
    assert lora is not None and lora.startswith("LoRA adapters run eagerly")
    torch_attn = cuda_graphs_off_reason(cfg, CUDA, "torch", _model(last=False))
    assert torch_attn == "attention backend 'torch' writes KV with data-dependent shapes"
    stage = cuda_graphs_off_reason(cfg, CUDA, "triton", _model(last=False))
    assert stage == "pipeline stages run eagerly"
