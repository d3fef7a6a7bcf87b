"""The cuDNN prefill path (models/cudnn_prefill.py) against the paged Triton kernel and the torch
path (SDPA over the gathered context), on fresh prompts and on steps mixing fresh prompts with
chunks after cached context and decode rows."""

from __future__ import annotations

import pytest
import torch

from pdserve.models import cudnn_prefill, flash_prefill
from pdserve.models.paged_attention import attend_cached
from tests.gpu.test_flash_prefill import D, _batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def _cudnn_on(monkeypatch):
    monkeypatch.setattr(cudnn_prefill, "ENABLED", True)  # off by default until measured


def _reference(q, cache, meta, backend, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(cudnn_prefill, "ENABLED", False)
        m.setattr(flash_prefill, "ENABLED", False)
        meta.refilled()
        meta.backend = backend
        try:
            return attend_cached(q, cache, meta, D**-0.5).float()
        finally:
            meta.backend = "triton"
            meta.refilled()


@pytest.mark.parametrize("pass_keys", [True, False])
@pytest.mark.parametrize(
    "qlens,seqlens",
    [
        ([2000, 1024, 300], [2000, 1024, 300]),  # fresh prompts only (1024: no padding needed)
        # a chunk after context, a short fresh prompt (Triton), a decode row, two fresh prompts
        ([512, 1500, 100, 1, 1300, 17], [900, 1500, 100, 400, 1300, 30]),
    ],
)
def test_cudnn_prefill_matches_triton_and_torch(qlens, seqlens, pass_keys, monkeypatch):
    q, cache, meta = _batch(qlens, seqlens, torch.bfloat16)
    assert cudnn_prefill.applicable(q, meta)
    k = v = None
    if pass_keys:  # what the model passes: the step's keys and values in token order
        blk, off = meta.slot_mapping // meta.block_size, meta.slot_mapping % meta.block_size
        k, v = cache[blk, 0, off].clone(), cache[blk, 1, off].clone()
    out = attend_cached(q, cache, meta, D**-0.5, k, v)
    assert cudnn_prefill._broken is None, cudnn_prefill._broken
    assert meta._dense_plan is not None and meta._dense_plan.num_fresh >= 1024  # the cuDNN path ran
    assert out.shape == q.shape and torch.isfinite(out).all()
    for backend in ("triton", "torch"):
        ref = _reference(q, cache, meta, backend, monkeypatch)
        err = float((out.float() - ref).norm() / ref.norm())
        assert err < 1e-2, (backend, err)


def test_cudnn_prefill_stays_off_for_small_steps_graphs_fp32_and_decodes():
    q, _, meta = _batch([1, 1], [500, 700], torch.bfloat16)
    assert not cudnn_prefill.applicable(q, meta)  # decode tiles
    q, _, meta = _batch([1024, 1024], [1024, 1024], torch.bfloat16, static=True)
    assert not cudnn_prefill.applicable(q, meta)  # CUDA-graph metadata
    q, _, meta = _batch([1024, 1024], [1024, 1024], torch.float32)
    assert not cudnn_prefill.applicable(q, meta)  # fp32: the Triton kernel's IEEE path
    q, _, meta = _batch([64, 64], [64, 64], torch.bfloat16)
    assert not cudnn_prefill.applicable(q, meta)  # below MIN_FRESH_TOKENS
    q, cache, meta = _batch([1500, 1500], [1600, 2000], torch.bfloat16)  # no fresh row
    assert cudnn_prefill.attend(q, cache, meta, D**-0.5) is None
    q, cache, meta = _batch([200] * 8, [200] * 8, torch.bfloat16)  # fresh, but every prompt short
    assert not cudnn_prefill.applicable(q, meta)


@pytest.mark.parametrize("path", ["cudnn", "flash"])
def test_a_mixed_step_is_queued_without_waiting_for_the_device(path, monkeypatch):
    """Asynchronous scheduling launches step N+1 while step N runs: nothing in the attention of a
    prefill step may wait for the device (a pageable host-to-device copy, ``.item()``, an output
    size the host must read back). torch raises on any such call in sync-debug "error" mode."""
    monkeypatch.setattr(cudnn_prefill, "ENABLED", path == "cudnn")
    monkeypatch.setattr(flash_prefill, "ENABLED", path == "flash")
    # a chunk after context, a fresh prompt, a decode row, a second fresh prompt, a short one
    q, cache, meta = _batch([512, 1500, 1, 1300, 17], [900, 1500, 400, 1300, 30], torch.bfloat16)
    k = v = None
    if path == "cudnn":
        blk, off = meta.slot_mapping // meta.block_size, meta.slot_mapping % meta.block_size
        k, v = cache[blk, 0, off].clone(), cache[blk, 1, off].clone()
    attend_cached(q, cache, meta, D**-0.5, k, v)  # compiles / plans once outside the check
    meta.refilled()
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = attend_cached(q, cache, meta, D**-0.5, k, v)
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    assert out.shape == q.shape
    assert (meta._dense_plan if path == "cudnn" else meta._flash_index) is not None  # the path ran
