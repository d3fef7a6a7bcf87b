"""A rank's local attention metadata (pdserve/pcp/step.local_metadata) gives each of its tokens
the attention the global step gives it, on the torch path and on the Triton kernel (the GPU's
path; here under TRITON_INTERPRET=1), once the cache holds the whole step's K/V (after the
exchange). Global step: a decode row, a split chunk after cached context, a short prompt."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates a kernel (imported lazily)

from pdserve import kernels
from pdserve.models.attention import AttentionMetadata
from pdserve.models.paged_attention import attend_cached
from pdserve.pcp.index_map import plan_step
from pdserve.pcp.step import local_metadata

BLOCK, HEADS, KV_HEADS, HEAD_DIM = 16, 4, 2, 16
# (cached positions, new positions) per request, and its blocks
ROWS = [(29, 1), (8, 64), (0, 20)]
TABLES = [[9, 10], [0, 1, 2, 3, 4], [5, 6]]


def _global_meta(device: torch.device) -> AttentionMetadata:
    slots: list[int] = []
    for (cached, new), table in zip(ROWS, TABLES, strict=True):
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, cached + new)]
    qlens = [new for _, new in ROWS]
    seq_lens = [cached + new for cached, new in ROWS]
    width = max(len(t) for t in TABLES)
    table = [t + [0] * (width - len(t)) for t in TABLES]
    i32 = dict(dtype=torch.int32, device=device)
    return AttentionMetadata(
        num_tokens=sum(qlens),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, qlens[0], qlens[0] + qlens[1], sum(qlens)], **i32),  # type: ignore[arg-type]
        seq_lens=torch.tensor(seq_lens, **i32),  # type: ignore[arg-type]
        block_tables=torch.tensor(table, **i32),  # type: ignore[arg-type]
        query_lens_cpu=qlens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
        block_size=BLOCK,
    )


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("pcp", [2, 3])
def test_local_rows_attend_as_in_the_global_step(backend: str, pcp: int) -> None:
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (PDSERVE_TRITON=1 bash scripts/bootstrap.sh)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(pcp)
    kv_cache = torch.randn(11, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(device)
    meta = _global_meta(device)
    q = torch.randn(meta.num_tokens, HEADS, HEAD_DIM, generator=g).to(device)
    want = attend_cached(q, kv_cache, meta, HEAD_DIM**-0.5)  # the torch path, global rows
    plan = plan_step(meta.query_lens_cpu, meta.seq_lens_cpu, pcp, BLOCK)
    assert plan.is_split
    for view in plan.views:
        rows = torch.tensor(view.token_rows, dtype=torch.int64, device=device)
        local = local_metadata(plan, view.rank, meta, rows)
        local.backend = backend  # type: ignore[assignment]
        with kernels.use_backend(backend):  # type: ignore[arg-type]
            got = attend_cached(q[rows].contiguous(), kv_cache, local, HEAD_DIM**-0.5)
        torch.testing.assert_close(got, want[rows], atol=2e-5, rtol=1e-4)
