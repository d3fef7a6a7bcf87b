"""pdserve: disaggregated prefill/decode LLM serving."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pdserve.engine.llm import LLM
    from pdserve.engine.outputs import CompletionOutput, RequestOutput
    from pdserve.engine.sampling_params import SamplingParams


def __getattr__(name: str):  # lazy: `import pdserve` must not import torch
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.engine.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from pdserve.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(name)


__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
