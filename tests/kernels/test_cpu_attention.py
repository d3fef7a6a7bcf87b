"""The native CPU attention's AVX2 + FMA kernel (pdserve/kernels/cpu_attention.c) against a naive
fp32 reference and the portable scalar loop (cpu_native.c), both run in one process through
``cpu_native_attention.attention_simd``: grouped query heads, head_dim 64 and 128, lengths across block
boundaries, many requests of different lengths, prefill chunks beside decode rows, NaN rows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.kernels import cpu_native, cpu_native_attention
from pdserve.models.attention import AttentionMetadata
from tests.models.helpers import allocate_kv_cache, build_metadata

BF16 = torch.bfloat16


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return {"avx2", "fma"} <= set(flags.split())


@pytest.fixture
def simd() -> Iterator[None]:
    """The native library with its AVX2 attention on; on again after the test."""
    if not cpu_native.available():
        pytest.skip(f"native CPU kernels unavailable here: {cpu_native.unavailable_reason()}")
    if not cpu_native_attention.attention_simd(True):
        pytest.skip("this CPU has no AVX2 + FMA: the attention takes the scalar loop only")
    yield
    cpu_native_attention.attention_simd(True)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Naive fp32 attention of one query token over all keys: q [H, D], k / v [S, Hkv, D]."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,shd->hs", q, k) * scale
    return torch.einsum("hs,shd->hd", scores.softmax(-1), v)


def _case(
    query_lens: list[int],
    seq_lens: list[int],
    nh: int,
    nkv: int,
    d: int,
    block: int,
    seed: int,
    q_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int, torch.Tensor]:
    """q, a layer view of a two-layer cache (blocks shuffled, garbage in unowned slots), the
    metadata, the scores count and the fp32 reference [T, nh, d]."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block) for s in seq_lens) + 2
    cache = allocate_kv_cache(num_blocks, 2, block, nkv, d, BF16)
    cache.copy_(torch.randn(cache.shape, generator=gen) * 100)  # every unowned slot: large garbage
    layer = cache[:, 1]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-s // block))] for s in seq_lens]
    q = (torch.randn(sum(query_lens), nh, d, generator=gen) * q_scale).to(BF16)
    want = []
    row = 0
    for n, s, table in zip(query_lens, seq_lens, tables, strict=True):
        kv = torch.randn(2, s, nkv, d, generator=gen).to(BF16)
        for pos in range(s):
            layer[table[pos // block], :, pos % block] = kv[:, pos]
        for t in range(n):
            keys = s - n + t + 1
            want.append(_reference(q[row].float(), kv[0, :keys].float(), kv[1, :keys].float(), d**-0.5))
            row += 1
    meta = build_metadata(query_lens, seq_lens, tables, block)
    return q, layer, meta, cpu_native_attention.attention_scores(query_lens, seq_lens, nh), torch.stack(want)


def _run(
    q: torch.Tensor, layer: torch.Tensor, meta: AttentionMetadata, scores: int, on: bool
) -> torch.Tensor:
    assert cpu_native_attention.attention_simd(on) is on
    got = cpu_native_attention.attention(
        q, layer, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.max_seq_len, q.shape[-1] ** -0.5,
        scores,
    )  # fmt: skip
    assert got is not None and got.dtype == BF16 and got.shape == q.shape
    return got


DECODE_LENS = [1, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 151]  # across 8-key chunks and 16-key blocks


@pytest.mark.usefixtures("simd")
@pytest.mark.parametrize(
    ("nh", "nkv", "d", "block"),
    [(9, 3, 64, 16), (9, 3, 128, 16), (9, 3, 64, 4), (8, 2, 64, 16), (6, 1, 48, 16), (4, 4, 32, 1)],
    ids=["smollm2", "smollm2-d128", "block4", "group4", "group6-d48", "mha-block1"],
)
def test_decode_rows_match_the_reference_and_the_scalar_loop(nh: int, nkv: int, d: int, block: int) -> None:
    """Many requests of different lengths, one query each: grouped query heads 3:1 (9 heads),
    4:1, 6:1 (a 4-head tile and a 2-head one) and 1:1, head_dim 32-128, blocks of 1, 4 and 16 keys
    (an 8-key chunk spans blocks below 8)."""
    q, layer, meta, scores, want = _case([1] * len(DECODE_LENS), DECODE_LENS, nh, nkv, d, block, seed=nh * d)
    got = _run(q, layer, meta, scores, True)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    scalar = _run(q, layer, meta, scores, False)
    torch.testing.assert_close(got.float(), scalar.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.usefixtures("simd")
def test_prefill_chunks_beside_decode_rows_match_the_reference() -> None:
    """A fresh prompt, a chunk after cached context and decode rows in one call: every token sees
    its own causal prefix (lengths 1 .. 40 inside one call)."""
    q, layer, meta, scores, want = _case([1, 23, 9, 1], [5, 23, 40, 130], 9, 3, 64, 16, seed=3)
    got = _run(q, layer, meta, scores, True)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.usefixtures("simd")
def test_a_head_dim_not_a_multiple_of_16_takes_the_scalar_loop() -> None:
    q, layer, meta, scores, want = _case([1, 1], [9, 20], 4, 2, 40, 16, seed=5)
    on, off = _run(q, layer, meta, scores, True), _run(q, layer, meta, scores, False)
    assert torch.equal(on, off)
    torch.testing.assert_close(on.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.usefixtures("simd")
def test_a_nan_query_gives_nan_in_its_own_head_only_as_the_scalar_loop() -> None:
    q, layer, meta, scores, _ = _case([1, 1], [19, 40], 9, 3, 64, 16, seed=9)
    q[1, 4, 7] = float("nan")
    on, off = _run(q, layer, meta, scores, True), _run(q, layer, meta, scores, False)
    nan_rows = on.isnan().any(-1)
    assert nan_rows.tolist() == off.isnan().any(-1).tolist()
    assert nan_rows.nonzero().tolist() == [[1, 4]] and on[1, 4].isnan().all()


@pytest.mark.usefixtures("simd")
def test_large_scores_stay_finite() -> None:
    """Scores in the hundreds: exp of the max-subtracted scores stays in 0 .. 1, no overflow."""
    q, layer, meta, scores, want = _case([1, 1, 1], [3, 17, 70], 9, 3, 64, 16, seed=11, q_scale=30.0)
    got = _run(q, layer, meta, scores, True)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_the_switch_reports_the_cpu() -> None:
    if not cpu_native.available():
        pytest.skip(f"native CPU kernels unavailable here: {cpu_native.unavailable_reason()}")
    try:
        assert cpu_native_attention.attention_simd(False) is False
        assert cpu_native_attention.attention_simd(True) is _cpu_has_avx2_fma()
        assert cpu_native_attention.attention_simd() is _cpu_has_avx2_fma()
    finally:
        cpu_native_attention.attention_simd(True)
