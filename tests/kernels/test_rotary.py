"""Triton rotary kernel vs its torch twin, the twin vs the former llama.py formula, and dispatch.

Without a GPU the kernel runs under TRITON_INTERPRET=1 (see conftest.py), so shapes stay tiny;
the CUDA-only tests at the bottom sweep realistic sizes and capture the kernel in a CUDA graph.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdserve import kernels
from pdserve.errors import UnsupportedError
from pdserve.kernels import apply_rotary, apply_rotary_torch, rms_norm, rotary_cos_sin_cache
from pdserve.models.config import RopeConfig

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROPES = {
    "default": RopeConfig("default", 10000.0),
    "linear": RopeConfig("linear", 500000.0, factor=4.0),
    "llama3": RopeConfig(
        "llama3",
        500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
}


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _qk_views(
    n: int, heads: int, kv_heads: int, dim: int, device: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D] and k [n, Hkv, D] as views of one fused qkv row, as the model makes them."""
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, device=device, dtype=dtype)
    q = qkv[:, : heads * dim].view(n, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim)
    return q, k


def _cache(rope: str, dim: int, max_positions: int, device: str) -> torch.Tensor:
    return rotary_cos_sin_cache(ROPES[rope].inv_freq(dim).to(device), max_positions)


# ----------------------------------------------------------------------------- Triton vs twin

# (tokens, q heads, kv heads, head_dim): GQA, MHA, MQA, odd half (D/2 = 17), one token.
SHAPES = [(1, 4, 2, 64), (5, 3, 1, 34), (3, 6, 6, 16), (4, 8, 2, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rotary_matches_twin(force_triton, device, shape, dtype):
    torch.manual_seed(0)
    n, heads, kv_heads, dim = shape
    q, k = _qk_views(n, heads, kv_heads, dim, device, dtype)
    assert n == 1 or not q.is_contiguous()
    cache = _cache("default", dim, 100, device)
    positions = torch.randint(0, 100, (n,), device=device)
    q_before, k_before = q.clone(), k.clone()
    q_out, k_out = apply_rotary(q, k, positions, cache)
    assert torch.equal(q, q_before) and torch.equal(k, k_before), "inputs were written"
    assert q_out.is_contiguous() and k_out.is_contiguous()
    q_ref, k_ref = apply_rotary_torch(q, k, positions, cache)
    _close(q_out, q_ref)
    _close(k_out, k_ref)


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_rotary_rope_types_and_position_dtypes(force_triton, device, rope, pos_dtype):
    torch.manual_seed(0)
    q, k = _qk_views(6, 4, 2, 32, device, torch.float32)
    cache = _cache(rope, 32, 300, device)
    positions = torch.tensor([0, 299, 5, 5, 128, 64], device=device, dtype=pos_dtype)
    q_out, k_out = apply_rotary(q, k, positions, cache)
    q_ref, k_ref = apply_rotary_torch(q, k, positions.long(), cache)
    _close(q_out, q_ref)
    _close(k_out, k_ref)


def test_rotary_many_heads_loop_over_head_blocks(force_triton, device):
    """More heads than one block holds (4096 lanes / 64 per head = 64 heads per block)."""
    torch.manual_seed(0)
    q, k = _qk_views(2, 130, 65, 128, device, torch.float32)
    cache = _cache("default", 128, 16, device)
    positions = torch.tensor([3, 15], device=device)
    q_out, k_out = apply_rotary(q, k, positions, cache)
    q_ref, k_ref = apply_rotary_torch(q, k, positions, cache)
    _close(q_out, q_ref)
    _close(k_out, k_ref)


def test_rotary_column_strided_input_is_copied(force_triton, device):
    torch.manual_seed(0)
    q = torch.randn(3, 32, 2, device=device).transpose(1, 2)  # [3, 2, 32], last-dim stride 2
    k = torch.randn(3, 1, 32, device=device)
    cache = _cache("default", 32, 8, device)
    positions = torch.tensor([1, 2, 7], device=device)
    q_out, k_out = apply_rotary(q, k, positions, cache)
    q_ref, k_ref = apply_rotary_torch(q, k, positions, cache)
    _close(q_out, q_ref)
    _close(k_out, k_ref)


def test_rotary_zero_tokens(force_triton, device):
    q, k = _qk_views(0, 4, 2, 16, device, torch.float32)
    q_out, k_out = apply_rotary(
        q, k, torch.empty(0, dtype=torch.long, device=device), _cache("default", 16, 4, device)
    )
    assert q_out.shape == (0, 4, 16) and k_out.shape == (0, 2, 16)


def test_qwen3_order_norm_then_rope(force_triton, device):
    """Per-head RMSNorm then RoPE (Qwen3) through the Triton kernels equals the twins' chain."""
    torch.manual_seed(0)
    q, k = _qk_views(5, 4, 2, 64, device, torch.float32)
    wq, wk = (1 + 0.1 * torch.randn(64, device=device) for _ in range(2))
    cache = _cache("default", 64, 50, device)
    positions = torch.arange(5, device=device) * 7
    q_out, k_out = apply_rotary(rms_norm(q, wq, 1e-6), rms_norm(k, wk, 1e-6), positions, cache)
    with kernels.use_backend("torch"):
        q_ref, k_ref = apply_rotary(rms_norm(q, wq, 1e-6), rms_norm(k, wk, 1e-6), positions, cache)
    _close(q_out, q_ref)
    _close(k_out, k_ref)


# ----------------------------------------------------------------------------- the twin


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_twin_equals_former_formula_bitwise(rope):
    """The twin reproduces llama.py's former per-step path exactly in fp32: cos/sin of
    position * inv_freq, then x * cos + rotate_half(x) * sin."""
    torch.manual_seed(0)
    dim, max_pos = 64, 200
    q, k = _qk_views(7, 4, 2, dim, "cpu", torch.float32)
    positions = torch.tensor([0, 1, 17, 63, 64, 150, 199])
    inv_freq = ROPES[rope].inv_freq(dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]

    def former(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    q_out, k_out = apply_rotary_torch(q, k, positions, rotary_cos_sin_cache(inv_freq, max_pos))
    assert torch.equal(q_out, former(q)) and torch.equal(k_out, former(k))


def test_twin_rotation_preserves_norm_and_position_zero_is_identity():
    torch.manual_seed(0)
    q, k = _qk_views(3, 2, 1, 16, "cpu", torch.float64)
    cache = rotary_cos_sin_cache(ROPES["default"].inv_freq(16).double(), 10).double()
    q_out, k_out = apply_rotary_torch(q, k, torch.tensor([0, 4, 9]), cache)
    torch.testing.assert_close(q_out[0], q[0])
    torch.testing.assert_close(q_out.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(k_out.norm(dim=-1), k.norm(dim=-1))


# ----------------------------------------------------------------------------- dispatch


def test_cpu_defaults_to_torch_without_importing_triton():
    code = (
        "import sys, torch; from pdserve import kernels as k\n"
        "q = torch.randn(2, 4, 8); c = k.rotary_cos_sin_cache(torch.ones(4), 4)\n"
        "k.apply_rotary(q, q[:, :2], torch.tensor([0, 3]), c); k.silu_and_mul(torch.randn(2, 8))\n"
        "assert 'triton' not in sys.modules, 'CPU path imported triton'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_predicate(monkeypatch):
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    pos, cache = torch.tensor([0, 1]), rotary_cos_sin_cache(torch.ones(8), 4)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET" in kernels.rotary_unsupported_reason(q, k, pos, cache)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.rotary_can_run(q, k, pos, cache)
    assert kernels.rotary_can_run(q.bfloat16(), k.bfloat16(), pos.int(), cache)
    assert not kernels.rotary_can_run(q.double(), k.double(), pos, cache)
    assert not kernels.rotary_can_run(q, k.half(), pos, cache)
    assert not kernels.rotary_can_run(q, k, pos.float(), cache)
    assert not kernels.rotary_can_run(q, k, pos[:1], cache)
    assert not kernels.rotary_can_run(q, k, pos, cache.half())
    assert not kernels.rotary_can_run(q, k, pos, cache[:, :8])
    assert not kernels.rotary_can_run(q[..., :15], k[..., :15], pos, cache[:, :15])  # odd head_dim
    assert not kernels.rotary_can_run(q, k[:1], pos, cache)


def test_forced_triton_unsupported_raises(force_triton, device):
    q, k = _qk_views(2, 2, 1, 16, device, torch.float64)
    cache = _cache("default", 16, 4, device)
    with pytest.raises(UnsupportedError, match="float64"):
        apply_rotary(q, k, torch.tensor([0, 1], device=device), cache)
    q, k = _qk_views(2, 2, 1, 16, device, torch.float32)
    with pytest.raises(UnsupportedError, match="cos_sin_cache"):
        apply_rotary(q, k, torch.tensor([0, 1], device=device), cache.bfloat16())


def test_forced_triton_on_cpu_without_interpreter_raises(force_triton, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("only meaningful without CUDA")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k = _qk_views(2, 2, 1, 16, "cpu", torch.float32)
    with pytest.raises(UnsupportedError, match="TRITON_INTERPRET"):
        apply_rotary(q, k, torch.tensor([0, 1]), _cache("default", 16, 4, "cpu"))


def test_forced_triton_calls_the_kernel_wrapper(force_triton, device, monkeypatch):
    from pdserve.kernels import triton_rotary

    calls = []
    real = triton_rotary.rotary_fwd

    def spy(*args):
        calls.append((tuple(args[0].shape), tuple(args[1].shape)))
        return real(*args)

    monkeypatch.setattr(triton_rotary, "rotary_fwd", spy)
    q, k = _qk_views(3, 4, 2, 16, device, torch.float32)
    apply_rotary(q, k, torch.tensor([0, 1, 2], device=device), _cache("default", 16, 4, device))
    assert calls == [((3, 4, 16), (3, 2, 16))]


# ----------------------------------------------------------------------------- CUDA only


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_size_sweep(dtype):
    torch.manual_seed(0)
    for heads, kv_heads, dim in [
        (32, 8, 64),
        (32, 8, 128),
        (16, 2, 128),
        (64, 8, 128),
        (40, 8, 128),
        (14, 2, 64),
    ]:
        cache = _cache("llama3", dim, 8192, "cuda")
        for n in (1, 7, 256, 4096):
            q, k = _qk_views(n, heads, kv_heads, dim, "cuda", dtype)
            positions = torch.randint(0, 8192, (n,), device="cuda")
            q_out, k_out = apply_rotary(q, k, positions, cache)
            q_ref, k_ref = apply_rotary_torch(q, k, positions, cache)
            _close(q_out, q_ref)
            _close(k_out, k_ref)


@pytest.mark.gpu
@gpu
def test_cuda_auto_picks_triton_and_raises_on_unsupported():
    q, k = _qk_views(4, 8, 2, 64, "cuda", torch.bfloat16)
    pos, cache = torch.arange(4, device="cuda"), _cache("default", 64, 16, "cuda")
    assert kernels.rotary_can_run(q, k, pos, cache)
    with pytest.raises(UnsupportedError, match="float64"):
        apply_rotary(q.double(), k.double(), pos, cache)
    with kernels.use_backend("torch"):
        q_ref, _ = apply_rotary(q.double(), k.double(), pos, cache)
    assert q_ref.dtype == torch.float64


@pytest.mark.gpu
@gpu
def test_cuda_graph_replays_with_new_positions_and_inputs():
    """Captured once, replayed on new positions and q/k written in place: no host sync inside."""
    torch.manual_seed(0)
    n, heads, kv_heads, dim = 16, 32, 8, 128
    q, k = _qk_views(n, heads, kv_heads, dim, "cuda", torch.bfloat16)
    pos = torch.zeros(n, dtype=torch.long, device="cuda")
    cache = _cache("default", dim, 4096, "cuda")
    apply_rotary(q, k, pos, cache)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, k_out = apply_rotary(q, k, pos, cache)
    for _ in range(2):
        pos.copy_(torch.randint(0, 4096, (n,), device="cuda"))
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        graph.replay()
        q_ref, k_ref = apply_rotary_torch(q, k, pos, cache)
        _close(q_out, q_ref)
        _close(k_out, k_ref)


@pytest.mark.parametrize("n", [1, 5])
def test_q_and_k_of_one_fused_projection_rotate_as_one_tensor_bit_identically(n) -> None:
    """q and k sliced from one qkv output take the one-tensor path (fewer ops on CPU decode):
    the same bits as rotating each alone, contiguous outputs, inputs untouched; q and k from
    separate tensors (or not adjacent) take the two-call path."""
    from pdserve.kernels import rotary

    H, Hkv, D = 4, 2, 16
    torch.manual_seed(0)
    cache = rotary_cos_sin_cache(1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)), 64)
    qkv = torch.randn(n, (H + 2 * Hkv) * D).bfloat16()
    before = qkv.clone()
    q = qkv[:, : H * D].view(n, H, D)
    k = qkv[:, H * D : (H + Hkv) * D].view(n, Hkv, D)
    v = qkv[:, (H + Hkv) * D :].view(n, Hkv, D)
    pos = torch.arange(n) + 7
    assert rotary._adjacent_heads(q, k) is not None
    assert rotary._adjacent_heads(q, v) is None  # v does not follow q
    assert rotary._adjacent_heads(q.clone(), k.clone()) is None  # separate storages
    got_q, got_k = apply_rotary_torch(q, k, pos, cache)
    cos, sin = cache.index_select(0, pos).chunk(2, dim=-1)
    want_q = rotary._rotate_torch(q, cos[:, None], sin[:, None])
    want_k = rotary._rotate_torch(k, cos[:, None], sin[:, None])
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert got_q.shape == (n, H, D) and got_k.shape == (n, Hkv, D)
    assert torch.equal(qkv, before)
