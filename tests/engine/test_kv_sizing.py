"""KV budget defaults and max_model_len fitting (engine/kv_sizing.py), and the engine acting on them."""

from __future__ import annotations

import logging

import pytest

from pdserve.engine import kv_sizing
from pdserve.engine.kv_sizing import GpuMemory, cpu_kv_budget_bytes, fit_max_model_len, gpu_kv_budget_bytes
from pdserve.errors import ConfigError

GiB = 1 << 30
# The tiny llama's KV block: 2 layers x (k, v) x 16 slots x 2 KV heads x 16 dims x 4 bytes.
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def test_mem_available_is_read_from_meminfo(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree: 1000 kB\nMemAvailable:    3000000 kB\n")
    assert kv_sizing.mem_available_bytes(meminfo) == 3000000 * 1024
    meminfo.write_text("MemTotal: 1 kB\n")
    assert kv_sizing.mem_available_bytes(meminfo) is None
    assert kv_sizing.mem_available_bytes(tmp_path / "absent") is None


def test_cpu_budget_is_4_gib_capped_by_free_ram() -> None:
    assert cpu_kv_budget_bytes(64 * GiB) == 4 * GiB
    assert cpu_kv_budget_bytes(2 * GiB) == int(2 * GiB * kv_sizing.CPU_FREE_RAM_FRACTION)
    assert cpu_kv_budget_bytes(None) == 4 * GiB


def test_gpu_budget_leaves_weights_activations_and_others() -> None:
    # 80 GiB device: 2 GiB of weights in torch's pool, 1 GiB held by the CUDA context and others,
    # 3 GiB of activations: 0.9 * 80 - 2 - 1 - 3 = 66 GiB
    mem = GpuMemory(80 * GiB, 77 * GiB, 2 * GiB, 3 * GiB)
    assert gpu_kv_budget_bytes(mem, 0.9) == int(0.9 * 80 * GiB) - 6 * GiB
    # never more than is free now, less the activations
    assert gpu_kv_budget_bytes(GpuMemory(80 * GiB, 10 * GiB, 2 * GiB, 3 * GiB), 1.0) == 7 * GiB
    assert gpu_kv_budget_bytes(GpuMemory(80 * GiB, 1 * GiB, 2 * GiB, 3 * GiB), 0.9) == 0


def test_fit_max_model_len(caplog) -> None:
    assert fit_max_model_len(10_000, 8192, None, GiB) == 8192  # fits
    assert fit_max_model_len(10_000, 8192, 4096, GiB) == 4096  # explicit, fits
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.kv_sizing"):
        assert fit_max_model_len(5824, 8192, None, 256 << 20) == 5824  # default lowered
    assert len(caplog.records) == 1 and "lowered from 8192" in caplog.text and "to 5824" in caplog.text
    with pytest.raises(ConfigError, match=r"max_model_len=8192 does not fit: the KV cache holds 5824 tokens"):
        fit_max_model_len(5824, 8192, 8192, 256 << 20)


def test_the_engine_lowers_a_default_that_does_not_fit(make_llm, tiny_models) -> None:
    # 64 blocks of 16 = 1,024 tokens, under the checkpoint's max_position_embeddings of 2,048
    llm = make_llm(tiny_models["llama"], kv_cache_memory_bytes=64 * TINY_BLOCK_BYTES)
    assert llm.engine.cache_sizes.bytes_per_block == TINY_BLOCK_BYTES
    assert (llm.engine.cache_sizes.num_blocks, llm.engine.max_model_len) == (64, 1024)
    assert llm.engine.cache_sizes.budget_bytes == 64 * TINY_BLOCK_BYTES
    assert llm.engine.admission.max_model_len == 1024


def test_an_explicit_max_model_len_that_does_not_fit_is_refused(make_llm, tiny_models) -> None:
    with pytest.raises(ConfigError, match=r"max_model_len=2048 does not fit: the KV cache holds 1024 tokens"):
        make_llm(tiny_models["llama"], kv_cache_memory_bytes=64 * TINY_BLOCK_BYTES, max_model_len=2048)


def test_the_cpu_default_budget_sizes_the_cache(make_llm, tiny_models, monkeypatch) -> None:
    monkeypatch.setattr(kv_sizing, "mem_available_bytes", lambda: 2 * GiB)
    monkeypatch.setattr("pdserve.engine.kv_tensors.mem_available_bytes", lambda: 2 * GiB)
    llm = make_llm(tiny_models["llama"], device="cpu")
    budget = int(2 * GiB * kv_sizing.CPU_FREE_RAM_FRACTION)
    assert llm.engine.cache_sizes.budget_bytes == budget
    assert llm.engine.cache_sizes.num_blocks == budget // TINY_BLOCK_BYTES
    assert llm.engine.max_model_len == 2048


def test_gpu_memory_utilization_reaches_the_engine_and_is_refused_where_unused() -> None:
    from pdserve.config.cluster import ClusterConfig
    from pdserve.config.resolver import resolve_node_settings

    def cluster(**node: object) -> ClusterConfig:
        n = {"name": "c", "role": "colocated", "host": "127.0.0.1", "grpc_port": 1, "metrics_port": 2}
        return ClusterConfig.from_dict({"model": "/ckpt/m", "nodes": [n | node]})

    c = cluster(device="cuda", gpu_memory_utilization=0.5)
    e = resolve_node_settings(c, "c", is_multimodal=lambda m: False).engine_config()
    assert e.cache.gpu_memory_utilization == 0.5
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization 0\.5 is not used \(device is cpu\)"):
        cluster(device="cpu", gpu_memory_utilization=0.5)
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes sizes the KV cache"):
        cluster(gpu_memory_utilization=0.5, kv_cache_memory_bytes=1 << 20)


def test_the_dummy_step_that_measures_activations_runs_and_leaves_generation_alone(
    make_llm, tiny_models
) -> None:
    # On CUDA the GPU budget takes its activation bytes from this step's peak (engine/profile_memory.py);
    # here it runs on the CPU: the step must run on a first and a later pipeline stage, and change nothing.
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.profile_memory import dummy_prefill_batch, profile_activation_bytes, run_dummy_step
    from pdserve.engine.sampling_params import SamplingParams

    batch = dummy_prefill_batch(40, 16)
    assert (batch.width, list(batch.block_table_flat), batch.sample_idx) == (3, [0, 1, 2], [39])
    llm = make_llm(tiny_models["llama"], device="cpu")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    before = llm.generate(["a b c d e"], params)[0].outputs[0].token_ids
    runner = llm.engine.runner
    assert isinstance(runner, ModelRunner)
    assert run_dummy_step(runner, 40, 4) == 3 * TINY_BLOCK_BYTES
    assert profile_activation_bytes(runner) is None  # no allocator peak to read off a CPU
    assert llm.generate(["a b c d e"], params)[0].outputs[0].token_ids == before
    later_stage = ModelRunner(runner.config, layer_start=1)
    assert run_dummy_step(later_stage, 17, 2) == 2 * TINY_BLOCK_BYTES // 2  # one local layer
