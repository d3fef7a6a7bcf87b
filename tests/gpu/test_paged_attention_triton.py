"""Triton paged attention (KV write + attention + split merge) against the torch path.

Runs on CUDA, and on CPU under the Triton interpreter (tiny shapes, fp32 only: the interpreter
has no bf16). Caches are NaN-filled, so a read of a never-written or padded slot shows up as NaN.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.models.attention import AttentionMetadata
from pdserve.models.paged_attention import paged_attention
from tests.models.helpers import build_metadata

triton = pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@dataclasses.dataclass
class Case:
    q: torch.Tensor  # [num_tokens, H, D]
    k: torch.Tensor  # [num_tokens, Hkv, D]
    v: torch.Tensor
    cache: torch.Tensor  # whole stage cache, 2 layers: [num_blocks, 2, 2, bs, Hkv, D]
    meta: AttentionMetadata


def _case(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    # Never-written slots hold huge finite garbage (stale KV); the mask must keep it out.
    cache = torch.full((num_blocks, 2, 2, block_size, num_kv_heads, head_dim), 3e4)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(max(1, -(-s // block_size)))] for s in seq_lens]
    layer = cache[:, 1]
    for q_len, seq_len, table in zip(query_lens, seq_lens, tables, strict=True):
        for pos in range(seq_len - q_len):  # context already in the cache
            layer[table[pos // block_size], :, pos % block_size] = torch.randn(
                2, num_kv_heads, head_dim, generator=gen
            )
    n = sum(query_lens)
    q = torch.randn(n, num_heads, head_dim, generator=gen)
    # k, v as strided views of one fused projection, like the model's qkv split
    kv = torch.randn(n, 2 * num_kv_heads * head_dim, generator=gen)
    k = kv[:, : num_kv_heads * head_dim].view(n, num_kv_heads, head_dim)
    v = kv[:, num_kv_heads * head_dim :].view(n, num_kv_heads, head_dim)
    meta = build_metadata(query_lens, seq_lens, tables, block_size)
    dev = torch.device(DEVICE)
    meta = dataclasses.replace(
        meta,
        slot_mapping=meta.slot_mapping.to(dev),
        query_start_loc=meta.query_start_loc.to(dev),
        seq_lens=meta.seq_lens.to(dev),
        block_tables=meta.block_tables.to(dev),
    )
    return Case(q.to(dev, dtype), k.to(dev, dtype), v.to(dev, dtype), cache.to(dev, dtype), meta)


def _run(case: Case, backend: str, upcast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and the written stage cache (inputs untouched)."""
    dtype = torch.float32 if upcast else case.q.dtype
    cache = case.cache.to(dtype, copy=True)
    meta = dataclasses.replace(case.meta, backend=backend)
    out = paged_attention(
        case.q.to(dtype), case.k.to(dtype), case.v.to(dtype), cache[:, 1], meta, case.q.shape[-1] ** -0.5
    )
    return out, cache


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


MIXED = [
    ([5, 1, 17, 3, 1], [5, 9, 40, 20, 1]),  # fresh prompt, decodes, chunks after a prefix
    ([1, 1, 1], [7, 1, 30]),  # pure decode
    ([70], [70]),  # one prompt longer than a query tile
]


@pytest.mark.parametrize(("query_lens", "seq_lens"), MIXED)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 2, 16, 4), (4, 4, 8, 16), (6, 1, 16, 8), (8, 2, 24, 16)],
)
def test_triton_matches_torch_fp32(
    query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size
) -> None:
    case = _case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    ref, ref_cache = _run(case, "torch")
    out, cache = _run(case, "triton")
    assert out.shape == ref.shape and not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, ref_cache, equal_nan=True, rtol=0, atol=0)  # same slots written


@pytest.mark.parametrize("num_splits", [1, 2, 4, 16])
def test_decode_splits_match(num_splits: int) -> None:
    from pdserve.kernels import triton_attention, triton_kv_write

    case = _case([1, 1, 1, 1], [70, 1, 130, 16], 4, 2, 16, 8, seed=num_splits)
    ref, _ = _run(case, "torch")
    cache = case.cache.clone()
    triton_kv_write.write_kv_cache(case.k, case.v, cache[:, 1], case.meta.slot_mapping)
    m = case.meta
    out = triton_attention.paged_attention(
        case.q, cache[:, 1], m.block_tables, m.seq_lens, m.query_start_loc, 1, 16**-0.5, num_splits
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_padding_rows_write_nothing_and_read_nothing() -> None:
    """A captured batch's padding rows: slot -1, seq_len 0. Real rows are unaffected."""
    case = _case([1, 1], [9, 20], 4, 2, 16, 4)
    real, real_cache = _run(case, "triton")
    dev = case.q.device
    meta = dataclasses.replace(
        case.meta,
        num_tokens=4,
        slot_mapping=torch.cat([case.meta.slot_mapping, torch.tensor([-1, -1], device=dev)]),
        query_start_loc=torch.arange(5, dtype=torch.int32, device=dev),
        seq_lens=torch.cat([case.meta.seq_lens, torch.zeros(2, dtype=torch.int32, device=dev)]),
        block_tables=torch.cat([case.meta.block_tables, torch.zeros_like(case.meta.block_tables)]),
        query_lens_cpu=[1] * 4,
        seq_lens_cpu=[64] * 4,
        max_seq_len=64,
        static_bounds=True,
        backend="triton",
    )
    pad = lambda t: torch.cat([t, torch.randn_like(t)])  # noqa: E731
    cache = case.cache.clone()
    out = paged_attention(pad(case.q), pad(case.k), pad(case.v), cache[:, 1], meta, 16**-0.5)
    torch.testing.assert_close(out[:2], real, rtol=0, atol=0)
    assert (out[2:] == 0).all()
    torch.testing.assert_close(cache, real_cache, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (6, 1, 34), (8, 8, 8)])
def test_rotary_and_store_kv_fused_equals_rotary_then_write(num_heads, num_kv_heads, head_dim) -> None:
    """One Triton launch (rotate q and k, store k and v at their slots) gives what the torch twin
    and the two-kernel chain give: same rotated q, same cache bytes; padding rows (slot -1) store
    nothing. Then attention over that cache equals paged_attention on the unfused inputs."""
    from pdserve.kernels import apply_rotary_torch, rotary_cos_sin_cache
    from pdserve.models.config import RopeConfig
    from pdserve.models.kv_store import rotary_and_store_kv
    from pdserve.models.paged_attention import attend_cached

    case = _case([5, 1, 3, 1], [5, 9, 20, 2], num_heads, num_kv_heads, head_dim, 4)
    dev = case.q.device
    n = case.q.shape[0]
    slots = case.meta.slot_mapping.clone()
    slots[4] = -1  # a padding row between real rows
    meta = dataclasses.replace(case.meta, slot_mapping=slots)
    positions = torch.tensor([0, 1, 2, 3, 4, 8, 17, 18, 19, 1], device=dev)[:n]
    cos_sin = rotary_cos_sin_cache(RopeConfig("default", 10000.0).inv_freq(head_dim).to(dev), 32)
    q_ref, k_ref = apply_rotary_torch(case.q, case.k, positions, cos_sin)
    results = {}
    for backend in ("torch", "triton"):
        cache = case.cache.clone()
        m = dataclasses.replace(meta, backend=backend)
        k_out = torch.full(case.k.shape, float("nan"), dtype=case.k.dtype, device=dev)
        q_rot = rotary_and_store_kv(case.q, case.k, case.v, positions, cos_sin, cache[:, 1], m, k_out)
        results[backend] = (q_rot, cache, attend_cached(q_rot, cache[:, 1], m, head_dim**-0.5))
        # the rotated keys also in token order (cudnn_prefill's k_out), padding row included
        torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5, msg=backend)
    torch.testing.assert_close(results["triton"][0], q_ref, rtol=1e-5, atol=1e-5)
    # (the "torch" attention path still rotates with the Triton kernel on CUDA: backend "auto")
    torch.testing.assert_close(results["torch"][0], q_ref, rtol=1e-5, atol=1e-5)
    want = case.cache.clone()
    keep = slots >= 0
    layer = want[:, 1]
    bs = layer.shape[2]
    layer[slots[keep] // bs, 0, slots[keep] % bs] = k_ref[keep]
    layer[slots[keep] // bs, 1, slots[keep] % bs] = case.v[keep]
    for backend, (_, cache, _) in results.items():
        torch.testing.assert_close(cache, want, rtol=1e-5, atol=1e-5, msg=backend)
    assert (results["triton"][1][:, 0] == case.cache[:, 0]).all(), "another layer was written"
    unfused = paged_attention(
        q_ref,
        k_ref,
        case.v,
        case.cache.clone()[:, 1],
        dataclasses.replace(meta, backend="torch"),
        head_dim**-0.5,
    )
    real = torch.arange(n, device=dev) != 4
    torch.testing.assert_close(results["triton"][2][real], unfused[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [
        ([1] * 16, [1000 + 37 * i for i in range(16)]),  # decode, long contexts, splits
        ([1], [3000]),  # batch 1 decode: 16 splits
        ([300, 1, 1, 129, 64], [300, 700, 1, 900, 64]),  # mixed prefill/decode
    ],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 64), (16, 2, 128), (12, 12, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.gpu
@requires_cuda
def test_triton_half_precision_vs_fp32_reference(
    query_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype
):
    """bf16/fp16 on realistic shapes: ||out - ref|| / ||ref|| < 1e-2 against the fp32 torch path."""
    case = _case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, 16, dtype=dtype)
    ref, _ = _run(case, "torch", upcast=True)  # fp32 torch path on the same (rounded) inputs
    out, _ = _run(case, "triton")
    assert out.dtype == dtype and not out.isnan().any()
    assert _rel_err(out, ref) < 1e-2, _rel_err(out, ref)
