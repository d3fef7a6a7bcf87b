"""A step's samples: ``SampledTensors`` on the device (nothing synchronised yet) and the
``SamplerOutput`` lists read from them (``pdserve.engine.sampler`` makes both)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.host_batch import copy_to_host
from pdserve.engine.outputs import TokenLogprob


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # Per row: the sampled token's logprob and the top-N alternatives (N = params.logprobs),
    # best first, when params.logprobs is not None; else None.
    logprobs: list[TokenLogprob | None]


@dataclass
class SampledTensors:
    """A step's samples still on the device (or in pinned host copies of them): nothing here has
    synchronised with the GPU. ``output()`` reads them into Python lists."""

    token_ids: torch.Tensor  # [num_rows] int64
    logprob_rows: list[int]  # rows that asked for logprobs
    num_top: list[int]  # per logprob row: how many alternatives it asked for
    chosen_logprobs: torch.Tensor | None = None  # [len(logprob_rows)] float32
    top_logprobs: torch.Tensor | None = None  # [len(logprob_rows), max(num_top)] float32, best first
    top_token_ids: torch.Tensor | None = None  # [len(logprob_rows), max(num_top)] int64

    def tensors(self) -> list[torch.Tensor]:
        return [
            t
            for t in (self.token_ids, self.chosen_logprobs, self.top_logprobs, self.top_token_ids)
            if t is not None
        ]

    def copy_to_host(self, host_like: Callable[[torch.Tensor], torch.Tensor]) -> SampledTensors:
        """The same samples copied into host tensors made by ``host_like`` (pinned: the copies
        do not block the host; read them only once the stream's work up to here has finished)."""

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            return copy_to_host(t, host_like)

        token_ids = host(self.token_ids)
        assert token_ids is not None
        return SampledTensors(
            token_ids,
            self.logprob_rows,
            self.num_top,
            host(self.chosen_logprobs),
            host(self.top_logprobs),
            host(self.top_token_ids),
        )

    def output(self) -> SamplerOutput:
        token_ids = self.token_ids.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(token_ids)
        if self.logprob_rows:
            assert self.chosen_logprobs is not None
            chosen = self.chosen_logprobs.tolist()
            top_lp: list[list[float]] = [[] for _ in self.logprob_rows]
            top_ids: list[list[int]] = [[] for _ in self.logprob_rows]
            if self.top_logprobs is not None and self.top_token_ids is not None:
                top_lp, top_ids = self.top_logprobs.tolist(), self.top_token_ids.tolist()
            for j, row in enumerate(self.logprob_rows):
                n = self.num_top[j]
                logprobs[row] = TokenLogprob(
                    token_id=token_ids[row],
                    logprob=chosen[j],
                    top=tuple(zip(top_ids[j][:n], top_lp[j][:n], strict=True)),
                )
        return SamplerOutput(token_ids, logprobs)
