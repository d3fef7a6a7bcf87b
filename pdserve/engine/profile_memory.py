"""One step's activation memory, measured: a dummy forward at the largest step the scheduler can
schedule, the way the KV budget on a GPU is taken from the device (engine/kv_sizing.py).

The dummy step is one sequence of ``min(max_num_batched_tokens, max_model_len)`` prompt tokens
(the widest attention a step can hold) over a temporary KV cache just large enough for it, then
the float32 logits of ``min(max_num_seqs, tokens)`` sampled rows and the sampler's copy of them
(softmax / the penalties write one more of that size). On CUDA the peak of the caching
allocator's allocated bytes above what was allocated before is the step's activation bytes;
the temporary cache's own bytes are taken out (the real cache is budgeted separately).

Any device runs the same dummy forward (the CPU test runs it); only CUDA reports a peak.

``gpu_memory`` is what the GPU budget starts from (``ModelRunner.determine_cache_sizes``): the
device's memory now and that peak, or an estimate where the dummy step cannot measure one.
"""

from __future__ import annotations

import logging
import math
from array import array
from typing import TYPE_CHECKING

import torch

from pdserve.engine.host_batch import HostBatch, batch_to_device
from pdserve.engine.kv_sizing import GpuMemory
from pdserve.models.config import IntermediateTensors

if TYPE_CHECKING:
    from pdserve.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Layers whose state is only the paged KV the dummy step gives them.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def dummy_prefill_batch(num_tokens: int, block_size: int) -> HostBatch:
    """One sequence of ``num_tokens`` tokens (id 0) at positions 0.., in blocks 0.. of a cache
    of ``ceil(num_tokens / block_size)`` blocks; its last row is sampled."""
    num_blocks = math.ceil(num_tokens / block_size)
    return HostBatch(
        token_ids=array("q", [0] * num_tokens),
        positions=array("q", range(num_tokens)),
        slots=array("q", range(num_tokens)),  # block b, offset o: b * block_size + o
        query_lens=[num_tokens],
        seq_lens=[num_tokens],
        block_table_flat=array("i", range(num_blocks)),
        width=num_blocks,
        sample_idx=[num_tokens - 1],
    )


@torch.inference_mode()
def run_dummy_step(runner: ModelRunner, num_tokens: int, num_sampled_rows: int) -> int:
    """The dummy step on ``runner``'s model and device; returns the temporary cache's bytes."""
    a, bs = runner.arch, runner.block_size
    batch = dummy_prefill_batch(num_tokens, bs)
    shape = (batch.width, runner.num_local_layers, 2, bs, runner.num_kv_heads, a.head_dim)
    cache = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
    layer_caches = [cache[:, i] for i in range(runner.num_local_layers)]
    runner.staging.begin_step()
    input_ids, positions, meta = batch_to_device(batch, runner.staging, bs, runner.attn_backend)
    model = runner.model
    if runner.lora is not None:  # base-model rows: the adapters' step state says so
        runner.lora.begin_step([("", num_tokens)], runner.device)
    intermediate = None
    if not model.is_first_stage:  # a later pipeline stage starts from the residual stream
        h = torch.zeros(num_tokens, a.hidden_size, dtype=runner.dtype, device=runner.device)
        intermediate = IntermediateTensors(h, h.clone())
    out = model(input_ids, positions, layer_caches, meta, intermediate=intermediate)
    if model.is_last_stage:
        assert isinstance(out, torch.Tensor)
        rows = out[:1].expand(num_sampled_rows, -1).contiguous()
        logits = model.compute_logits(rows, upcast=True)
        torch.softmax(logits, dim=-1)  # the sampler's copy of the logits
    runner.staging.end_step()
    return cache.numel() * cache.element_size()


def profile_activation_bytes(runner: ModelRunner) -> int | None:
    """The measured activation bytes of the largest step on CUDA; None elsewhere (or where the
    dummy step cannot run: the caller keeps its estimate, with a log line saying why)."""
    if runner.device.type != "cuda":
        return None
    other = sorted(set(runner.arch.layer_types or ()) - ATTENTION_LAYER_TYPES)
    if other:  # the dummy step has no state for them: the caller's estimate serves
        logger.info("one step's activations estimated, not profiled: layer types %s", other)
        return None
    sc = runner.config.scheduler
    tokens = min(sc.max_num_batched_tokens, runner.max_model_len)
    rows = min(sc.max_num_seqs, tokens)
    torch.cuda.synchronize(runner.device)
    torch.cuda.reset_peak_memory_stats(runner.device)
    before = torch.cuda.memory_allocated(runner.device)
    try:
        cache_bytes = run_dummy_step(runner, tokens, rows)
    except torch.OutOfMemoryError as e:
        # The weights leave less than one step's activations: nothing a KV budget can fix.
        raise RuntimeError(
            f"one step of {tokens} tokens does not fit on {runner.device} next to the weights "
            f"({torch.cuda.memory_allocated(runner.device)} bytes allocated): lower "
            f"max_num_batched_tokens ({e})"
        ) from e
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device) - before - cache_bytes
    torch.cuda.empty_cache()
    logger.info(
        "profiled one step of %d tokens (%d sampled rows): %.1f MiB of activations",
        tokens,
        rows,
        peak / 2**20,
    )
    return max(0, peak)


def gpu_memory(runner: ModelRunner) -> GpuMemory:
    """The device's memory now (weights loaded), with one step's activations: measured by the
    dummy step above, else estimated from the residual stream, q/k/v, the MLP's gate/up and the
    fp32 logits of that budget."""
    a, sc = runner.arch, runner.config.scheduler
    measured = profile_activation_bytes(runner)
    free, total = torch.cuda.mem_get_info(runner.device)
    elem = torch.empty((), dtype=runner.dtype).element_size()
    tokens = min(sc.max_num_batched_tokens, runner.max_model_len)
    qkv = (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim
    per_token = (4 * a.hidden_size + qkv + 3 * a.intermediate_size) * elem
    logits = min(sc.max_num_seqs, tokens) * a.vocab_size * 4 * 2  # logits + sampler's copy
    estimate = tokens * per_token + logits
    activation = estimate if measured is None else measured
    return GpuMemory(total, free, torch.cuda.memory_reserved(runner.device), activation)
