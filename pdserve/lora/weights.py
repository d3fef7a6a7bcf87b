"""One module's LoRA weights with its stored scale, and the adapter error type."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.errors import InvalidRequestError


class LoRAAdapterError(InvalidRequestError):
    """An adapter cannot be served as given (file, config or shapes); names the problem."""


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One module's LoRA: ``delta = scale * (x @ a.T) @ b.T``."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    rank: int
    scale: float  # computed once by peft.module_scale(); read by every apply path

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The reference apply of one module (tests, MoE packing checks): [n, in] -> [n, out]."""
        return (x.float() @ self.a.float().T) @ self.b.float().T * self.scale
