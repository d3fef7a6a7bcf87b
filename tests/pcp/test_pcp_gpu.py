"""Prefill context parallelism on GPUs (NCCL, rank r on GPU r): pcp 2 and 4 must generate what
pcp 1 generates, through the Triton attention path (fp32: token-exact), eagerly and with the
decode steps' CUDA graphs; and with a draft model or an MTP module drafting after the split
prefill (rank 0's MTP KV equal pcp 1's). Skipped without enough GPUs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.pcp.test_pcp_engine import _check
from tests.pcp.test_pcp_spec import _check_draft_model, _check_mtp

pytestmark = pytest.mark.gpu
GPU: dict[str, Any] = dict(device="cuda", kv_cache_memory_bytes=256 << 20)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("pcp", [2, 4])
def test_pcp_on_gpus_equals_pcp1(tiny_models: Any, pcp: int, enforce_eager: bool) -> None:
    if torch.cuda.device_count() < pcp:
        pytest.skip(f"pcp {pcp} needs {pcp} GPUs, {torch.cuda.device_count()} visible")
    _check(tiny_models["llama"], pcp, [20, 700, 301, 1500], seed=3, enforce_eager=enforce_eager, **GPU)


@pytest.mark.parametrize("method", ["draft_model", "mtp"])
@pytest.mark.parametrize("pcp", [2, 4])
def test_pcp_speculation_on_gpus_equals_pcp1(tiny_model_factory: Any, pcp: int, method: str) -> None:
    if torch.cuda.device_count() < pcp:
        pytest.skip(f"pcp {pcp} needs {pcp} GPUs, {torch.cuda.device_count()} visible")
    check = _check_draft_model if method == "draft_model" else _check_mtp
    check(tiny_model_factory("llama", mtp=True), pcp, [700, 20, 1500], max_tokens=16, **GPU)
