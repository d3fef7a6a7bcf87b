"""The native CPU kernels (pdserve/kernels/cpu_native.c) against their torch twins and fp32
references, the cases they leave to the twins, and the PDSERVE_CPU_KERNELS setting."""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve import kernels
from pdserve.errors import ConfigError
from pdserve.kernels import cpu_native, cpu_native_attention, cpu_native_rowwise
from pdserve.kernels.activation import silu_and_mul_torch
from pdserve.kernels.rmsnorm import fused_add_rms_norm_torch, rms_norm_torch
from pdserve.kernels.rotary import apply_rotary_torch, rotary_cos_sin_cache
from pdserve.models.kv_store import write_kv_cache
from tests.models.helpers import allocate_kv_cache, build_metadata

BF16 = torch.bfloat16
BLOCK = 4
HEAD_DIM = 32


@pytest.fixture
def native() -> None:
    if not cpu_native.available():
        pytest.skip(f"native CPU kernels unavailable here: {cpu_native.unavailable_reason()}")


@pytest.fixture
def fresh_native(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """An unloaded module state and an empty cache directory; the real state comes back after."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    cpu_native._reset_for_tests()
    yield tmp_path
    monkeypatch.undo()
    cpu_native._reset_for_tests()


def _within_one_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 results that may differ from the twin by one rounding step (a sum in another order)."""
    assert got.dtype == want.dtype == BF16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize(("rows", "width"), [(1, 128), (16, 128), (5, 4096)])
@pytest.mark.parametrize("strided", [False, True])
def test_the_norms_and_silu_match_their_twins(
    rows: int, width: int, strided: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The silu kernel (the AVX2 loop where the CPU has it) past the size it is used at
    (``silu_cap``, raised here), too."""
    gen = torch.Generator().manual_seed(rows * width)

    def make(cols: int, scale: float = 3.0) -> torch.Tensor:
        t = (torch.randn(rows, cols + (7 if strided else 0), generator=gen) * scale).to(BF16)
        return t[:, :cols] if strided else t  # a strided view: rows further apart than their width

    x, residual, gate_up = make(width), make(width), make(2 * width, 4.0)
    weight = torch.randn(width, generator=gen).to(BF16)
    got = cpu_native_rowwise.rms_norm(x, weight, 1e-6)
    assert got is not None
    _within_one_step(got, rms_norm_torch(x, weight, 1e-6))
    pair = cpu_native_rowwise.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert pair is not None
    normed, new_residual = pair
    want_normed, want_residual = fused_add_rms_norm_torch(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, want_residual)  # one elementwise add: the same bits
    _within_one_step(normed, want_normed)
    lib = cpu_native.library()
    assert lib is not None
    if gate_up.numel() > cpu_native_rowwise.silu_cap(lib):
        assert cpu_native_rowwise.silu_and_mul(gate_up) is None  # torch's vectorised kernel is faster there
    monkeypatch.setattr(cpu_native_rowwise, "MAX_SILU_ELEMENTS", 1 << 20)
    monkeypatch.setattr(cpu_native_rowwise, "MAX_SILU_ELEMENTS_SIMD", 1 << 20)
    act = cpu_native_rowwise.silu_and_mul(gate_up)
    assert act is not None
    _within_one_step(act, silu_and_mul_torch(gate_up))
    if width == 128:  # one 16-lane pass covers the row: the same sum as torch's, the same bits
        assert torch.equal(got, rms_norm_torch(x, weight, 1e-6))
    # the dispatchers take the native kernel on the default backend and the twin on "torch"
    assert torch.equal(kernels.rms_norm(x, weight, 1e-6), got)
    with kernels.use_backend("torch"):
        assert torch.equal(kernels.rms_norm(x, weight, 1e-6), rms_norm_torch(x, weight, 1e-6))


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize("inter", [1, 15, 17, 40, 1536])
def test_silu_rows_of_any_width_and_special_values_match_the_twin(inter: int) -> None:
    """The vector loop's 16-element steps and its scalar tail; +-inf, NaN, large negatives (exp
    past its range) in the gate give what the twin gives."""
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(3, 2 * inter + 5, generator=gen) * 4).to(BF16)[:, : 2 * inter]
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), -100.0, 100.0, -88.5, 0.0])
    k = min(inter, len(specials))
    gate_up[1, :k] = specials[:k].to(BF16)
    got = cpu_native_rowwise.silu_and_mul(gate_up)
    assert got is not None
    want = silu_and_mul_torch(gate_up)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    _within_one_step(torch.where(finite, got, 0), torch.where(finite, want, 0))


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_the_small_layer_gemm_matches_the_fp32_route(rows: int, bias: bool) -> None:
    """models.linear's fp32 route (x widened, fp32 GEMM, one rounding) against the native call on
    the transposed fp32 copy; a strided input; more rows than MAX_LINEAR_ROWS go back to torch."""
    from pdserve.models.linear import Linear, prepare_small_gemms

    gen = torch.Generator().manual_seed(rows)
    layer = Linear(96, 200, bias=bias).to(BF16)
    assert prepare_small_gemms(layer) == 1 and layer.weight_fp32_t is not None
    assert layer.weight_fp32 is not None and layer.weight_fp32_t.is_contiguous()
    x = torch.randn(rows, 96 + 5, generator=gen).to(BF16)[:, :96]  # rows 101 apart
    with torch.inference_mode():
        got = cpu_native_rowwise.linear(x, layer.weight_fp32_t, layer.bias_fp32)
        want = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
        assert got is not None
        _within_one_step(got, want.to(BF16))
        assert torch.equal(layer(x), got)  # the layer's forward takes it
        many = torch.randn(cpu_native_rowwise.MAX_LINEAR_ROWS + 1, 96).to(BF16)
        assert cpu_native_rowwise.linear(many, layer.weight_fp32_t, layer.bias_fp32) is None


@pytest.mark.usefixtures("native")
def test_a_three_dimensional_input_keeps_its_shape() -> None:
    x = torch.randn(2, 3, 64).to(BF16)
    weight = torch.randn(64).to(BF16)
    got = cpu_native_rowwise.rms_norm(x, weight, 1e-5)
    assert got is not None and got.shape == x.shape
    _within_one_step(got, rms_norm_torch(x, weight, 1e-5))
    act = cpu_native_rowwise.silu_and_mul(x)
    assert act is not None and act.shape == (2, 3, 32)


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize("tokens", [1, 5])
def test_rotary_and_kv_store_give_the_twins_bits(tokens: int) -> None:
    """q rotated into a new tensor, k rotated and v stored into a layer view of a two-layer cache
    (block stride larger than a block); a padding slot (-1) stores nothing."""
    gen = torch.Generator().manual_seed(tokens)
    nh, nkv = 4, 2
    qkv = torch.randn(tokens, (nh + 2 * nkv) * HEAD_DIM, generator=gen).to(BF16).view(tokens, -1, HEAD_DIM)
    q, k, v = qkv[:, :nh], qkv[:, nh : nh + nkv], qkv[:, nh + nkv :]
    positions = torch.randint(0, 60, (tokens,), generator=gen)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    cos_sin = rotary_cos_sin_cache(inv_freq, 64)
    slots = torch.randperm(6 * BLOCK, generator=gen)[:tokens]
    if tokens > 1:
        slots[1] = -1
    cache = torch.randn(6, 2, 2, BLOCK, nkv, HEAD_DIM, generator=gen).to(BF16)
    want_cache = cache.clone()
    got = cpu_native_attention.rotary_store_kv(q, k, v, positions, cos_sin, cache[:, 1], slots)
    assert got is not None and got.is_contiguous()
    q_ref, k_ref = apply_rotary_torch(q, k, positions, cos_sin)
    write_kv_cache(k_ref, v, want_cache[:, 1], slots)
    assert torch.equal(got, q_ref)
    assert torch.equal(cache, want_cache)  # layer 0 untouched, layer 1 as the twin wrote it


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Naive fp32 attention of one query per head over all keys: q [H, D], k / v [S, Hkv, D]."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [S, H, D]
    scores = torch.einsum("hd,shd->hs", q, k) * scale
    return torch.einsum("hs,shd->hd", scores.softmax(-1), v)


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [([1, 1, 1, 1], [1, 9, 30, 16]), ([1, 9, 5, 16], [12, 9, 30, 16])],
    ids=["decode", "mixed"],
)
def test_attention_matches_the_fp32_reference_and_the_twin(
    query_lens: list[int], seq_lens: list[int]
) -> None:
    """Decode rows, a fresh prompt, a chunk after cached context and a decode beside them, over
    shuffled blocks of a layer view, grouped query heads, huge garbage in every slot no request
    owns: causal attention against a naive fp32 reference and the twin."""
    from pdserve.models.paged_attention import attend_cached

    gen = torch.Generator().manual_seed(7)
    nh, nkv = 8, 2
    num_blocks = sum(-(-s // BLOCK) for s in seq_lens) + 3
    cache = allocate_kv_cache(num_blocks, 2, BLOCK, nkv, HEAD_DIM, BF16)
    layer = cache[:, 1]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-s // BLOCK))] for s in seq_lens]
    q = torch.randn(sum(query_lens), nh, HEAD_DIM, generator=gen).to(BF16)
    want, row = [], 0
    for n, s, table in zip(query_lens, seq_lens, tables, strict=True):
        kv = torch.randn(2, s, nkv, HEAD_DIM, generator=gen).to(BF16)
        for pos in range(s):
            layer[table[pos // BLOCK], :, pos % BLOCK] = kv[:, pos]
        for t in range(n):  # token t of the request's n sees keys 0 .. s - n + t
            keys = s - n + t + 1
            want.append(
                _reference_attention(
                    q[row].float(), kv[0, :keys].float(), kv[1, :keys].float(), HEAD_DIM**-0.5
                )
            )
            row += 1
    meta = build_metadata(query_lens, seq_lens, tables, BLOCK)
    scores = cpu_native_attention.attention_scores(query_lens, seq_lens, nh)
    assert scores == nh * sum(
        s - n + t + 1 for n, s in zip(query_lens, seq_lens, strict=True) for t in range(n)
    )
    got = cpu_native_attention.attention(
        q,
        layer,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        meta.max_seq_len,
        HEAD_DIM**-0.5,
        scores,
    )
    assert got is not None and got.dtype == BF16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), torch.stack(want), rtol=1e-2, atol=1e-2)
    assert torch.equal(attend_cached(q, layer, meta, HEAD_DIM**-0.5), got)  # the default path
    with kernels.use_backend("torch"):
        twin = attend_cached(q, layer, meta, HEAD_DIM**-0.5)
    torch.testing.assert_close(got.float(), twin.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.usefixtures("native")
def test_cases_not_for_the_native_kernels_get_none() -> None:
    x = torch.randn(2, 64)
    w = torch.randn(64)
    assert cpu_native_rowwise.rms_norm(x, w, 1e-6) is None  # fp32
    assert cpu_native_rowwise.rms_norm(x.to(BF16), w, 1e-6) is None  # weight of another dtype
    assert cpu_native_rowwise.rms_norm(x.to(BF16)[:, ::2], w[:32].to(BF16), 1e-6) is None  # strided columns
    assert cpu_native_rowwise.rms_norm(x.to(BF16).requires_grad_(), w.to(BF16), 1e-6) is None
    assert cpu_native_rowwise.silu_and_mul(torch.randn(2, 7).to(BF16)) is None  # odd width
    lib = cpu_native.library()
    assert lib is not None
    assert (
        cpu_native_rowwise.silu_and_mul(torch.zeros(1, cpu_native_rowwise.silu_cap(lib) + 2, dtype=BF16))
        is None
    )
    qkv = torch.randn(3, 8, HEAD_DIM).to(BF16)
    cache = torch.zeros(4, 2, BLOCK, 2, HEAD_DIM, dtype=BF16)
    cos_sin = rotary_cos_sin_cache(1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM), 16)
    pos, slots = torch.arange(3), torch.arange(3)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    assert cpu_native_attention.rotary_store_kv(q, k, v, pos, cos_sin, cache, slots) is not None
    assert (
        cpu_native_attention.rotary_store_kv(q, k.clone(), v, pos, cos_sin, cache, slots) is None
    )  # not adjacent
    assert (
        cpu_native_attention.rotary_store_kv(q, k, v, pos.int(), cos_sin, cache, slots) is None
    )  # int32 positions
    meta = build_metadata([1], [40], [list(range(10))], BLOCK)
    one = torch.randn(1, 2, HEAD_DIM).to(BF16)
    cache1 = torch.zeros(10, 2, BLOCK, 1, HEAD_DIM, dtype=BF16)
    args = (cache1, meta.block_tables, meta.query_start_loc, meta.seq_lens, 40, 0.1)
    assert (
        cpu_native_attention.attention(one, *args, cpu_native_attention.attention_scores([1], [40], 2))
        is not None
    )
    over = cpu_native_attention.score_cap(decode=True) + 1
    assert cpu_native_attention.attention(one, *args, over) is None  # over the cap


def test_indices_that_leave_the_buffers_fail_the_step_check() -> None:
    meta = build_metadata([1, 1], [5, 3], [[2, 1], [0]], BLOCK)
    ok = (meta.slot_mapping, meta.seq_lens, meta.block_tables, meta.max_seq_len)
    assert cpu_native_attention.kv_indices_ok(*ok, num_blocks=3, block_size=BLOCK)
    assert cpu_native_attention.kv_indices_ok(*ok, 3, BLOCK, meta.query_start_loc)
    for bad_starts in ([0, 1, 3], [1, 1, 2], [0, 2, 1]):  # past the tokens, not from 0, decreasing
        assert not cpu_native_attention.kv_indices_ok(
            *ok, 3, BLOCK, torch.tensor(bad_starts, dtype=torch.int32)
        )
    long_query = build_metadata([5, 1], [5, 3], [[2, 1], [0]], BLOCK)
    starts = torch.tensor([0, 4, 6], dtype=torch.int32)  # request 1: 2 queries, 3 keys: fine
    assert cpu_native_attention.kv_indices_ok(
        long_query.slot_mapping, long_query.seq_lens, long_query.block_tables, 5, 3, BLOCK, starts
    )
    starts = torch.tensor([0, 0, 6], dtype=torch.int32)  # request 1: 6 queries over 3 keys
    assert not cpu_native_attention.kv_indices_ok(
        long_query.slot_mapping, long_query.seq_lens, long_query.block_tables, 5, 3, BLOCK, starts
    )
    assert not cpu_native_attention.kv_indices_ok(*ok, num_blocks=2, block_size=BLOCK)  # block 2 is out
    bad_len = meta.seq_lens.clone()
    bad_len[1] = 99
    assert not cpu_native_attention.kv_indices_ok(meta.slot_mapping, bad_len, meta.block_tables, 5, 3, BLOCK)
    assert cpu_native_attention.positions_ok(torch.tensor([0, 15]), 16)
    assert not cpu_native_attention.positions_ok(torch.tensor([0, 16]), 16)
    assert not cpu_native_attention.positions_ok(torch.tensor([-1]), 16)


@pytest.mark.usefixtures("native")
def test_a_bf16_model_step_takes_the_native_kernels_and_stays_close_to_the_twins_and_fp32(
    tiny_models: Mapping[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests' prompts, then three decode steps of both, through the Llama model in bf16:
    the prompts and the decode steps run the native rotary + store and attention in every layer,
    and the decode steps' logits
    stay as close to the fp32 model's as the torch twins' do."""
    from pdserve.models.loader import load_model

    calls = {"rotary_store_kv": 0, "attention": 0}
    for name in calls:
        real = getattr(cpu_native_attention, name)

        def spy(*a: object, _real=real, _name=name) -> object:  # type: ignore[no-untyped-def]
            out = _real(*a)
            calls[_name] += out is not None
            return out

        monkeypatch.setattr(cpu_native_attention, name, spy)
    model16, cfg = load_model(tiny_models["llama"], BF16, "cpu")
    model32, _ = load_model(tiny_models["llama"], torch.float32, "cpu")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (7, 11)]
    tables = [[3, 0, 5, 8], [1, 6, 2, 7]]
    n_layers = cfg.num_hidden_layers

    def run(model: torch.nn.Module, dtype: torch.dtype) -> list[torch.Tensor]:
        cache = allocate_kv_cache(9, n_layers, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype)
        views = [cache[:, i] for i in range(n_layers)]
        logits, lens = [], [len(p) for p in prompts]
        with torch.inference_mode():
            for p, table in zip(prompts, tables, strict=True):
                meta = build_metadata([len(p)], [len(p)], [table], BLOCK)
                model(p, torch.arange(len(p)), views, meta)
            for step in range(3):
                ids = torch.tensor([(step * 31 + i * 7) % cfg.vocab_size for i in range(2)])
                meta = build_metadata([1, 1], [n + 1 for n in lens], tables, BLOCK)
                positions = torch.tensor(lens)
                logits.append(model.compute_logits(model(ids, positions, views, meta)).float())
                lens = [n + 1 for n in lens]
        return logits

    ref = run(model32, torch.float32)
    native = run(model16, BF16)
    want_calls = {"rotary_store_kv": (2 + 3) * n_layers, "attention": (2 + 3) * n_layers}
    assert calls == want_calls
    with kernels.use_backend("torch"):
        twin = run(model16, BF16)
    assert calls == want_calls  # the torch backend made none
    for got, tw, want in zip(native, twin, ref, strict=True):
        err_native = float((got - want).norm() / want.norm())
        err_twin = float((tw - want).norm() / want.norm())
        assert err_native < 0.05 and err_native < 1.5 * err_twin + 1e-3, (err_native, err_twin)


def test_the_setting_torch_never_builds(fresh_native: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_native.ENV, "torch")
    assert cpu_native.library() is None
    assert cpu_native.unavailable_reason() == f"{cpu_native.ENV}=torch"
    assert not any(fresh_native.iterdir())


def test_an_unknown_setting_is_refused_by_name(fresh_native: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_native.ENV, "fast")
    with pytest.raises(ConfigError, match=r"PDSERVE_CPU_KERNELS='fast' is not one of auto, torch, native"):
        cpu_native.library()


def test_without_a_compiler_auto_warns_and_native_raises(
    fresh_native: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(fresh_native / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels.cpu_native"):
        assert cpu_native.library() is None
    assert "native CPU kernels unavailable" in caplog.text and "no-such-cc" in caplog.text
    x = torch.randn(2, 64).to(BF16)
    w = torch.randn(64).to(BF16)
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6))  # the twin ran
    cpu_native._reset_for_tests()
    monkeypatch.setenv(cpu_native.ENV, "native")
    with pytest.raises(RuntimeError, match=r"PDSERVE_CPU_KERNELS=native but .*no-such-cc"):
        cpu_native.library()


@pytest.mark.usefixtures("native")
def test_a_build_is_cached_and_reused(fresh_native: Path) -> None:
    assert cpu_native.library() is not None
    (built,) = fresh_native.iterdir()
    stamp = built.stat().st_mtime_ns
    cpu_native._reset_for_tests()
    assert cpu_native.library() is not None
    assert [p.name for p in fresh_native.iterdir()] == [built.name] and built.stat().st_mtime_ns == stamp


@pytest.mark.usefixtures("native")
def test_a_portable_build_in_the_cache_serves_a_host_without_a_compiler(
    fresh_native: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the container image does: build the portable module at image build time (the
    module's command line), then load it where no compiler is."""
    import subprocess
    import sys

    env = {**os.environ, "PDSERVE_CACHE_DIR": str(fresh_native)}
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.kernels.cpu_native_build", "--portable"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()
    built = Path(out)
    assert built.parent == fresh_native and built.exists()
    monkeypatch.setenv("CC", str(fresh_native / "no-such-cc"))
    lib = cpu_native.library()
    assert lib is not None and Path(lib.__file__) == built
    x = torch.randn(3, 64).to(BF16)
    w = torch.randn(64).to(BF16)
    got = cpu_native_rowwise.rms_norm(x, w, 1e-6)
    assert got is not None
    _within_one_step(got, rms_norm_torch(x, w, 1e-6))
    # the AVX2 attention is in the portable build too, behind its cpuid check
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    has_avx2_fma = any(
        ln.startswith("flags") and {"avx2", "fma"} <= set(ln.split()) for ln in flags.splitlines()
    )
    assert cpu_native_attention.attention_simd() is (
        platform.machine() in ("x86_64", "AMD64") and has_avx2_fma
    )
    # and the packed GEMM's vector kernel, behind the same check: the portable module runs it
    simd = platform.machine() in ("x86_64", "AMD64") and has_avx2_fma
    assert bool(lib.gemm_simd()) is simd
    if simd:
        from pdserve.kernels import cpu_gemm

        xg, wg = torch.randn(5, 96).to(BF16), torch.randn(40, 96).to(BF16)
        packed = cpu_gemm.pack(wg)
        assert packed is not None
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the kernel is taken at one torch thread (models/linear.py)
        try:
            got_mm = cpu_gemm.linear(xg, packed, None)
        finally:
            torch.set_num_threads(threads)
        assert got_mm is not None
        want_mm = (xg.float() @ wg.float().T).to(BF16)
        torch.testing.assert_close(got_mm.float(), want_mm.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float16])
@pytest.mark.parametrize(("vocab", "words"), [(4096, 128), (4100, 129), (4096, 100)])
@pytest.mark.parametrize("named_rows", [False, True])
def test_the_grammar_mask_equals_the_twin(
    dtype: torch.dtype, vocab: int, words: int, named_rows: bool
) -> None:
    """Random bitmask words, a row of all-allowed and one of all-banned, a bitmask narrower than
    the vocabulary (its tail banned) and one whose last word is partly past it; the constrained
    rows named (others untouched) or the first k."""
    from pdserve.kernels.bitmask import apply_token_bitmask_torch

    gen = torch.Generator().manual_seed(vocab + words)
    logits = torch.randn(20, vocab, generator=gen).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (16, words), generator=gen, dtype=torch.int64).to(
        torch.int32
    )
    bitmask[3], bitmask[5] = -1, 0
    rows = torch.tensor([0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 19]) if named_rows else None
    got, want = logits.clone(), logits.clone()
    assert cpu_native_rowwise.apply_bitmask_(got, bitmask, rows)
    apply_token_bitmask_torch(want, bitmask, rows)
    assert torch.equal(got, want)
    assert int(torch.isinf(got).sum()) > 0
    again = logits.clone()
    kernels.apply_token_bitmask_(again, bitmask, rows)  # the dispatcher on the CPU: the same
    assert torch.equal(again, want)


@pytest.mark.usefixtures("native")
def test_grammar_masks_it_does_not_take_write_nothing() -> None:
    logits = torch.randn(4, 64)
    before = logits.clone()
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    assert not cpu_native_rowwise.apply_bitmask_(logits.to(torch.float64), bitmask, None)  # dtype
    assert not cpu_native_rowwise.apply_bitmask_(logits.t().contiguous().t(), bitmask, None)  # column stride
    assert not cpu_native_rowwise.apply_bitmask_(logits, bitmask, torch.tensor([0, 1], dtype=torch.int32))
    assert not cpu_native_rowwise.apply_bitmask_(logits, bitmask, torch.tensor([0, 4]))  # row 4 of 4
    assert not cpu_native_rowwise.apply_bitmask_(
        logits, torch.zeros(5, 2, dtype=torch.int32), None
    )  # 5 rows of 4
    assert torch.equal(logits, before)


@pytest.mark.usefixtures("native")
def test_empty_inputs_are_no_work() -> None:
    none = torch.empty(0, 64, dtype=BF16)
    w = torch.randn(64).to(BF16)
    got = cpu_native_rowwise.rms_norm(none, w, 1e-6)
    assert got is not None and got.shape == (0, 64)
    pair = cpu_native_rowwise.fused_add_rms_norm(none, none, w, 1e-6)
    assert pair is not None and pair[0].shape == pair[1].shape == (0, 64)
    act = cpu_native_rowwise.silu_and_mul(none)
    assert act is not None and act.shape == (0, 32)
    logits = torch.zeros(2, 40)
    assert cpu_native_rowwise.apply_bitmask_(
        logits, torch.zeros(0, 2, dtype=torch.int32), torch.empty(0, dtype=torch.long)
    )
    assert torch.equal(logits, torch.zeros(2, 40))
