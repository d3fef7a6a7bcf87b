"""services/lora_rpc.request_lora_refusal: a node runs a request only under the adapter content
the KV was computed under (an engine stand-in holding a real LoRAServing over a fake model)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from pdserve.config.lora import LoRAConfig
from pdserve.lora.manager import LoRAManager
from pdserve.lora.peft import LoRAAdapter, LoRAModuleWeights
from pdserve.lora.serving import LoRAServing
from pdserve.models.linear import Linear
from services.lora_rpc import request_lora_refusal


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down_proj = Linear(4, 4, bias=False)


def test_refusals_by_identity():
    mgr = LoRAManager(_Tiny(), LoRAConfig(max_loras=1, max_lora_rank=2), torch.float32, torch.device("cpu"))
    w = LoRAModuleWeights(torch.zeros(2, 4), torch.zeros(4, 2), 2, 1.0)
    mgr.adapters["a"] = LoRAAdapter("a", "/a", b"\x01" * 16, {"down_proj": w}, 2)
    engine = SimpleNamespace(lora=LoRAServing(mgr))
    ident = mgr.adapters["a"].ident
    assert request_lora_refusal(engine, "a", ident) is None  # type: ignore[arg-type]
    assert request_lora_refusal(engine, "a", "") is None  # type: ignore[arg-type]
    assert request_lora_refusal(engine, "", "") is None  # type: ignore[arg-type]
    other = "a@" + "02" * 16  # same name, other content: KV made under it is never continued here
    assert "prefilled under" in request_lora_refusal(engine, "a", other)  # type: ignore[arg-type, operator]
    assert "does not hold" in request_lora_refusal(engine, "b", "")  # type: ignore[arg-type, operator]
    assert "without a lora_name" in request_lora_refusal(engine, "", ident)  # type: ignore[arg-type, operator]
    no_lora = SimpleNamespace(lora=None)
    assert "serves no LoRA" in request_lora_refusal(no_lora, "a", ident)  # type: ignore[arg-type, operator]
