"""The flash prefill path (models/flash_prefill.py) against the paged Triton kernel it replaces."""

from __future__ import annotations

import pytest
import torch

from pdserve.models import cudnn_prefill, flash_prefill
from pdserve.models.attention import AttentionMetadata
from pdserve.models.paged_attention import attend_cached

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BS, HKV, H, D = 16, 8, 32, 64


def _batch(qlens: list[int], seqlens: list[int], dtype: torch.dtype, static: bool = False):
    dev = torch.device("cuda")
    per = [-(-s // BS) for s in seqlens]
    nblocks = sum(per) + 4
    cache = torch.randn((nblocks, 3, 2, BS, HKV, D), dtype=dtype, device=dev)[:, 1]  # a layer view
    perm = (torch.randperm(nblocks - 1) + 1).tolist()
    width = max(per)
    table = torch.zeros((len(seqlens), width), dtype=torch.int32)
    i = 0
    for r, n in enumerate(per):
        table[r, :n] = torch.tensor(perm[i : i + n])
        i += n
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    n = sum(qlens)
    slots = torch.cat(
        [
            table[r, torch.arange(s - q, s) // BS].long() * BS + torch.arange(s - q, s) % BS
            for r, (q, s) in enumerate(zip(qlens, seqlens, strict=True))
        ]
    )
    meta = AttentionMetadata(
        num_tokens=n,
        slot_mapping=slots.to(dev),
        query_start_loc=qsl.to(dev),
        seq_lens=torch.tensor(seqlens, dtype=torch.int32, device=dev),
        block_tables=table.to(dev),
        query_lens_cpu=qlens,
        seq_lens_cpu=seqlens,
        max_query_len=max(qlens),
        max_seq_len=max(seqlens),
        block_size=BS,
        backend="triton",
        static_bounds=static,
    )
    q = torch.randn((n, H, D), dtype=dtype, device=dev)
    return q, cache, meta


@pytest.mark.parametrize(
    "qlens,seqlens",
    [
        ([2000, 1000, 37], [2000, 1000, 37]),  # fresh prompts
        ([300, 512, 1, 17], [300, 900, 400, 17]),  # a chunk after context and a decode row
    ],
)
def test_flash_prefill_matches_triton(qlens, seqlens, monkeypatch):
    monkeypatch.setattr(cudnn_prefill, "ENABLED", False)  # this test is about the flash path
    q, cache, meta = _batch(qlens, seqlens, torch.bfloat16)
    assert flash_prefill.applicable(q, meta)
    out = attend_cached(q, cache, meta, D**-0.5)
    assert flash_prefill._broken is None, flash_prefill._broken
    flash_prefill.ENABLED = False
    try:
        meta.refilled()
        ref = attend_cached(q, cache, meta, D**-0.5)
    finally:
        flash_prefill.ENABLED = True
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    assert err < 1e-2, err
    assert torch.isfinite(out).all()


def test_flash_prefill_stays_off_for_decode_graphs_fp32_and_old_context():
    q, _, meta = _batch([1, 1], [500, 700], torch.bfloat16)
    assert not flash_prefill.applicable(q, meta)  # decode tiles
    q, _, meta = _batch([64, 64], [64, 64], torch.bfloat16, static=True)
    assert not flash_prefill.applicable(q, meta)  # CUDA-graph metadata
    q, _, meta = _batch([64, 64], [64, 64], torch.float32)
    assert not flash_prefill.applicable(q, meta)  # fp32: the Triton kernel's IEEE path
    q, _, meta = _batch([16, 16], [900, 900], torch.bfloat16)
    assert not flash_prefill.applicable(q, meta)  # mostly old context: gathering would dominate
    q, _, meta = _batch([3000, 2000], [3000, 2000], torch.bfloat16)
    assert not flash_prefill.applicable(q, meta)  # over MAX_FLASH_TOKENS: the Triton tiles win
