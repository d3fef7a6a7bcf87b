"""The engine's KV layout, decided once at start: the cache groups of the model's layers, whether
they share one block table, the blocks each group gets from the budget, the context length that
fits, the runner's KV tensors and the block manager over them.

    runner.determine_cache_sizes()         the byte budget and group 0's block size
    groups_of_model / tables_off_reason    full / sliding / conv layers; one table or one per group
    split_kv_budget                        blocks per group (None: one table for all of them)
    fit_max_model_len                      the longest context the blocks hold
    runner.init_kv_cache / init_group_kv_cache, KVCacheManager
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config.engine import CacheSizes, EngineConfig
from pdserve.engine.executor import ModelExecutor
from pdserve.engine.kv_cache_groups import groups_of_model
from pdserve.engine.kv_cache_manager import KVCacheManager, StepFence
from pdserve.engine.kv_group_tables import split_kv_budget, tables_off_reason
from pdserve.engine.kv_sizing import fit_max_model_len
from pdserve.engine.model_runner import ModelRunner
from pdserve.errors import ConfigError


@dataclass
class KVLayout:
    cache_sizes: CacheSizes  # group 0's pool where the groups have tables of their own
    max_model_len: int
    fence: StepFence
    kv: KVCacheManager


def build_kv_layout(config: EngineConfig, runner: ModelExecutor, shared_reason: str | None) -> KVLayout:
    """Size and allocate the KV cache on ``runner`` and build its block manager.
    ``shared_reason``: why the node keeps every group on one block table (its KV transfer
    settings); None: the engine decides (engine/kv_group_tables.py)."""
    arch = runner.arch
    max_model_len = config.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ConfigError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{arch.max_position_embeddings}"
        )
    cache_sizes = runner.determine_cache_sizes()
    groups = groups_of_model(
        [f"model.layers.{i}.self_attn" for i in range(arch.num_hidden_layers)],
        arch.layer_types,
        arch.sliding_window,
        cache_sizes.block_size,
        arch.conv_kernel_size,
    )
    reason = tables_off_reason(
        groups,
        single_runner=isinstance(runner, ModelRunner),
        kv_offload=config.kv_offload is not None,
        shared_reason=shared_reason,
    )
    group_blocks = split_kv_budget(
        groups,
        reason,
        cache_sizes.budget_bytes,
        lambda: runner.group_layer_block_bytes(groups),  # type: ignore[attr-defined]
        config.scheduler,
        arch.architecture,
    )
    if group_blocks is not None:  # group 0's pool: what the other groups leave of the budget
        cs = cache_sizes
        cache_sizes = CacheSizes(
            group_blocks[0], cs.block_size, cs.bytes_per_block, budget_bytes=cs.budget_bytes
        )
    max_model_len = fit_max_model_len(
        cache_sizes.num_tokens, max_model_len, config.max_model_len, cache_sizes.budget_bytes
    )
    if isinstance(runner, ModelRunner):  # its CUDA graphs are captured for this length
        runner.max_model_len = max_model_len
    if group_blocks is None:
        runner.init_kv_cache(cache_sizes.num_blocks)
    else:
        assert isinstance(runner, ModelRunner)
        runner.init_group_kv_cache(groups, group_blocks)
    fence = StepFence()
    kv = KVCacheManager(
        cache_sizes.num_blocks,
        cache_sizes.block_size,
        config.cache.enable_prefix_caching,
        fence,
        groups,
        group_blocks[1:] if group_blocks is not None else None,
    )
    return KVLayout(cache_sizes, max_model_len, fence, kv)
