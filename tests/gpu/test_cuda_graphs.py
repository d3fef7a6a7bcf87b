"""Decode CUDA graphs: padding and static buffers (also on CPU, uncaptured), and on CUDA the
captured graphs give the same greedy tokens as the eager engine."""

from __future__ import annotations

import os
import random

import pytest
import torch

from pdserve.engine.cuda_graphs import CudaGraphRunner, capture_sizes
from pdserve.engine.sampling_params import SamplingParams

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
KV_BYTES = 64 << 20


def _workload(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """11 prompts whose max_tokens differ, so the decode batch shrinks through 11..1 (padded)."""
    rng = random.Random(seed)
    lengths = [1, 3, 9, 16, 17, 30, 33, 47, 64, 70, 95]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(len(lengths))
    ]
    return prompts, params


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_padded_static_decode_equals_eager_on_cpu(async_scheduling, tiny_models, make_llm) -> None:
    """The static-buffer path (padding rows: slot -1, seq_len 0; block tables at the max_model_len
    bound; async: input tokens fed into the static buffer from the previous step's samples) run
    eagerly on CPU gives the eager engine's tokens."""
    model_dir = tiny_models["llama"]
    kw = dict(
        device="cpu", dtype="float32", max_model_len=256, max_num_seqs=16, kv_cache_memory_bytes=KV_BYTES
    )
    eager = make_llm(model_dir, **kw)
    static = make_llm(model_dir, async_scheduling=async_scheduling, **kw)
    runner = static.engine.runner
    runner.cuda_graphs = CudaGraphRunner(
        runner.model,
        runner.layer_caches,
        max_num_seqs=16,
        max_model_len=256,
        block_size=runner.block_size,
        attn_backend=runner.attn_backend,
    )
    prompts, params = _workload(eager.engine.arch.vocab_size)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in static.generate(prompts, params)]
    assert got == want
    assert runner.cuda_graphs.num_runs > 20


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("arch", "num_layers"), [("llama", 2), ("qwen3", 2), ("llama", 5)])
def test_cuda_graphs_equal_eager(
    arch: str, num_layers: int, dtype: str, tiny_model_factory, make_llm
) -> None:
    """Captured decode (padded batches 11..1) gives the eager engine's tokens."""
    model_dir = tiny_model_factory(arch, num_layers=num_layers)
    kw = dict(device="cuda", dtype=dtype, max_num_seqs=16, kv_cache_memory_bytes=KV_BYTES, max_model_len=512)
    eager = make_llm(model_dir, enforce_eager=True, **kw)
    graphs = make_llm(model_dir, enforce_eager=False, **kw)
    assert eager.engine.runner.cuda_graphs is None
    runner = graphs.engine.runner
    assert runner.cuda_graphs is not None and runner.cuda_graphs.sizes == [1, 2, 4, 8, 16]
    prompts, params = _workload(eager.engine.arch.vocab_size, seed=len(arch))
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
    assert got == want
    assert runner.cuda_graphs.num_runs > 20


@pytest.mark.skipif(CUDA, reason="the CUDA tests above cover this with real kernels")
@pytest.mark.skipif(
    not os.environ.get("PDSERVE_FULL_TESTS"),
    reason="~20 s on 2 cores: PDSERVE_FULL_TESTS=1 runs it; on a GPU (bench/h200.sh pytest) the "
    "tests above run these paths with real kernels",
)
def test_triton_path_and_padding_under_interpreter(tiny_models, make_llm) -> None:
    """CPU, TRITON_INTERPRET=1: the Triton attention/norm path, eager and through the padded static
    buffers, gives the torch path's tokens (prefill chunks, decodes, padding rows)."""
    pytest.importorskip("triton")
    from pdserve import kernels

    model_dir = tiny_models["qwen3"]
    prompts, params = _workload(512, seed=3)
    prompts, params = (
        prompts[1:4],
        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 5, 6)],
    )
    kw = dict(
        device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4, kv_cache_memory_bytes=KV_BYTES
    )
    want = [o.outputs[0].token_ids for o in make_llm(model_dir, **kw).generate(prompts, params)]
    with kernels.use_backend("triton"):
        llm = make_llm(model_dir, max_num_batched_tokens=16, **kw)  # chunked prefill beside decodes
        runner = llm.engine.runner
        assert runner.attn_backend == "triton"
        eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        runner.cuda_graphs = CudaGraphRunner(
            runner.model,
            runner.layer_caches,
            max_num_seqs=4,
            max_model_len=128,
            block_size=runner.block_size,
            attn_backend="triton",
        )
        static = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert eager == want and static == want
    assert runner.cuda_graphs.num_runs >= 5
