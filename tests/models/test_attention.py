"""paged_attention against a naive per-request reference (fp32, shuffled blocks, GQA)."""

from __future__ import annotations

import pytest
import torch

from pdserve.models.paged_attention import paged_attention
from tests.models.helpers import build_metadata

BLOCK_SIZE = 4
HEAD_DIM = 8


def _reference(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [q_len, H, D]; k_ctx, v_ctx: [seq_len, Hkv, D] -> [q_len, H, D]."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k_ctx.shape
    group = num_heads // num_kv_heads
    k = k_ctx.repeat_interleave(group, dim=1)  # [seq_len, H, D]
    v = v_ctx.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, q_len, seq_len]
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [
        ([5, 1, 17, 3, 1], [5, 9, 40, 20, 1]),  # mixed: full prefill, decode, chunks with a prefix
        ([1, 1, 1], [7, 1, 30]),  # pure decode (fast path)
        ([23], [23]),  # one fresh prompt
    ],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (4, 4), (6, 1)])
def test_paged_attention_matches_reference(
    query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-s // BLOCK_SIZE) for s in seq_lens) + 3
    # Stage cache with 2 layers; attention runs on layer 1's non-contiguous view. Huge finite
    # garbage everywhere that is never written (stale KV of earlier requests) proves padded and
    # stale slots cannot leak into the outputs. (The runner zero-initialises its cache, so slots
    # are always finite; masked slots are excluded by the mask, not zeroed.)
    cache = torch.full((num_blocks, 2, 2, BLOCK_SIZE, num_kv_heads, HEAD_DIM), 1e4)
    cache += torch.randn(cache.shape, generator=gen) * 1e3
    untouched = cache[:, 0].clone()
    layer_cache = cache[:, 1]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = [[free.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in seq_lens]

    qs, ks, vs, expected, k_ctxs, v_ctxs = [], [], [], [], [], []
    scale = HEAD_DIM**-0.5
    for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        k_ctx = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        v_ctx = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        for pos in range(seq_len - q_len):  # earlier tokens: already in the cache
            layer_cache[table[pos // BLOCK_SIZE], 0, pos % BLOCK_SIZE] = k_ctx[pos]
            layer_cache[table[pos // BLOCK_SIZE], 1, pos % BLOCK_SIZE] = v_ctx[pos]
        q = torch.randn(q_len, num_heads, HEAD_DIM, generator=gen)
        qs.append(q)
        ks.append(k_ctx[seq_len - q_len :])
        vs.append(v_ctx[seq_len - q_len :])
        k_ctxs.append(k_ctx)
        v_ctxs.append(v_ctx)
        expected.append(_reference(q, k_ctx, v_ctx, scale))

    meta = build_metadata(query_lens, seq_lens, block_tables, BLOCK_SIZE)
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), layer_cache, meta, scale)

    assert out.shape == (sum(query_lens), num_heads, HEAD_DIM)
    torch.testing.assert_close(out, torch.cat(expected), rtol=1e-5, atol=1e-5)
    # The new tokens' K/V landed in their slots, and layer 0 was not touched.
    for seq_len, table, k_ctx, v_ctx in zip(seq_lens, block_tables, k_ctxs, v_ctxs, strict=True):
        pos = torch.arange(seq_len)
        blocks = torch.tensor(table)[pos // BLOCK_SIZE]
        torch.testing.assert_close(layer_cache[blocks, 0, pos % BLOCK_SIZE], k_ctx)
        torch.testing.assert_close(layer_cache[blocks, 1, pos % BLOCK_SIZE], v_ctx)
    assert torch.equal(cache[:, 0], untouched)


def test_paged_attention_keeps_dtype() -> None:
    meta = build_metadata([3, 1], [3, 2], [[1], [2]], BLOCK_SIZE)
    cache = torch.zeros(3, 2, BLOCK_SIZE, 2, HEAD_DIM, dtype=torch.bfloat16)
    q = torch.randn(4, 4, HEAD_DIM, dtype=torch.bfloat16)
    k = torch.randn(4, 2, HEAD_DIM, dtype=torch.bfloat16)
    out = paged_attention(q, k, k.clone(), cache, meta, HEAD_DIM**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape


@pytest.mark.parametrize("eager", [True, False])
def test_cpu_bf16_decode_matches_reference(monkeypatch: pytest.MonkeyPatch, eager: bool) -> None:
    """The CPU bf16 decode path (transformers' eager attention when there are enough rows, else
    SDPA) against the fp32 reference, stale garbage in the unused slots."""
    from pdserve.models import attention_torch

    monkeypatch.setattr(attention_torch, "EAGER_BF16_MIN_ROWS", 1 if eager else 10**9)
    gen = torch.Generator().manual_seed(1)
    seq_lens = [7, 1, 30, 12, 5, 9]
    num_heads, num_kv_heads = 4, 2
    num_blocks = sum(-(-s // BLOCK_SIZE) for s in seq_lens) + 2
    cache = torch.full((num_blocks, 2, BLOCK_SIZE, num_kv_heads, HEAD_DIM), 1e4)
    cache += torch.randn(cache.shape, generator=gen) * 1e3
    cache = cache.to(torch.bfloat16)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in seq_lens]
    qs, ks, vs, want = [], [], [], []
    for seq_len, table in zip(seq_lens, tables, strict=True):
        k_ctx = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
        v_ctx = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
        for pos in range(seq_len - 1):
            cache[table[pos // BLOCK_SIZE], 0, pos % BLOCK_SIZE] = k_ctx[pos]
            cache[table[pos // BLOCK_SIZE], 1, pos % BLOCK_SIZE] = v_ctx[pos]
        q = torch.randn(1, num_heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
        qs.append(q)
        ks.append(k_ctx[-1:])
        vs.append(v_ctx[-1:])
        want.append(_reference(q.float(), k_ctx.float(), v_ctx.float(), HEAD_DIM**-0.5))
    meta = build_metadata([1] * len(seq_lens), seq_lens, tables, BLOCK_SIZE)
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, HEAD_DIM**-0.5)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), torch.cat(want), rtol=2e-2, atol=2e-2)


def test_the_step_shared_rotation_and_store_index_serve_every_layer_and_are_dropped_on_refill() -> None:
    """rotary_and_store_kv (torch path) computes the cos / sin rows and the KV slots once per step
    and reuses them in every layer; a padding slot (< 0) is skipped; refilled() or a new
    positions tensor makes them be computed again."""
    from pdserve.kernels import apply_rotary_torch, rotary_cos_sin_cache
    from pdserve.models.kv_store import rotary_and_store_kv, write_kv_cache

    gen = torch.Generator().manual_seed(3)
    meta = build_metadata([2, 1], [6, 3], [[1, 0], [2]], BLOCK_SIZE)
    meta.slot_mapping[1] = -1  # the first request's second token is padding
    cache = rotary_cos_sin_cache(1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM), 64)
    kv = torch.zeros(3, 2, 2, BLOCK_SIZE, 2, HEAD_DIM)  # [blocks, layers, K|V, block, Hkv, D]
    ref = torch.zeros_like(kv)

    def step(positions: torch.Tensor) -> None:
        for layer in range(2):
            qkv = torch.randn(3, 4 + 2 + 2, HEAD_DIM, generator=gen)
            q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
            q_rot = rotary_and_store_kv(q, k, v, positions, cache, kv[:, layer], meta)
            q_ref, k_ref = apply_rotary_torch(q, k, positions, cache)
            write_kv_cache(k_ref, v, ref[:, layer], meta.slot_mapping)
            assert torch.equal(q_rot, q_ref)
            assert torch.equal(kv, ref)

    positions = torch.tensor([4, 5, 2])
    step(positions)
    assert meta._rotary is not None and meta._rotary[0] is positions and meta._store_index is not None
    assert int((kv != 0).any(-1).any(-1).sum()) == 2 * 2 * 2  # 2 tokens x K, V x 2 layers
    step(torch.tensor([3, 9, 1]))  # new positions: new rows
    meta.slot_mapping[1] = 5  # refilled in place for a new step, padding gone
    meta.refilled()
    assert meta._rotary is None and meta._store_index is None
    step(positions)
    assert int((kv != 0).any(-1).any(-1).sum()) == 3 * 2 * 2


@pytest.mark.parametrize(("query_len", "seq_len", "taken"), [(1, 37, True), (29, 29, True), (5, 23, False)])
@pytest.mark.parametrize("num_kv_heads", [2, 8])
def test_one_request_in_half_precision_takes_the_short_path_with_the_same_attention(
    monkeypatch: pytest.MonkeyPatch, query_len: int, seq_len: int, taken: bool, num_kv_heads: int
) -> None:
    """CPU bf16, one request: a fresh prompt, and a decode step of few KV heads, take
    _one_request_attention (keys cut to the request's length, one causal call); a chunk after
    cached context and a decode of many KV heads (the eager form) do not. Same attention as the
    general path within bf16 rounding. The native kernels are kept out: a decode step would take
    cpu_native_attention.attention first (tests/kernels/test_cpu_native.py)."""
    from pdserve.models import attention_torch as at
    from pdserve.models.paged_attention import attend_cached

    monkeypatch.setattr(at.kernels, "wants_native", lambda x: False)

    gen = torch.Generator().manual_seed(seq_len)
    num_heads = 2 * num_kv_heads
    table = [2, 0, 5, 1, 3, 4, 6, 7, 8, 9][: -(-seq_len // BLOCK_SIZE)]
    cache = torch.randn(10, 2, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
    q = torch.randn(query_len, num_heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
    calls: list[bool] = []
    short = at._one_request_attention

    def spy(*a: object) -> torch.Tensor | None:
        out = short(*a)  # type: ignore[arg-type]
        calls.append(out is not None)
        return out

    monkeypatch.setattr(at, "_one_request_attention", spy)
    got = attend_cached(q, cache, build_metadata([query_len], [seq_len], [table], BLOCK_SIZE), 0.125)
    assert calls == [taken and (query_len > 1 or num_kv_heads < at.EAGER_BF16_MIN_ROWS)]
    monkeypatch.setattr(at, "_one_request_attention", lambda *a: None)
    want = attend_cached(q, cache, build_metadata([query_len], [seq_len], [table], BLOCK_SIZE), 0.125)
    assert got.shape == want.shape == (query_len, num_heads, HEAD_DIM)
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1.6e-2)
    ctx = cache[torch.tensor(table)].float()  # [nb, 2, block, Hkv, D], the request's blocks in order
    k_ctx = ctx[:, 0].reshape(-1, num_kv_heads, HEAD_DIM)[:seq_len]
    v_ctx = ctx[:, 1].reshape(-1, num_kv_heads, HEAD_DIM)[:seq_len]
    ref = _reference(q.float(), k_ctx, v_ctx, 0.125)  # naive fp32, from the same bf16 inputs
    torch.testing.assert_close(got.float(), ref, rtol=3e-2, atol=3e-2)
