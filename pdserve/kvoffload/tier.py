"""The offload tier of one engine: its settings turned into a manager and a copier, and the
per-step call the engine makes (``execute``, before the step's forward and before remote KV
pulls start, so no write reaches an evicted block before its bytes are copied out)."""

from __future__ import annotations

from pdserve.config.engine import EngineConfig
from pdserve.config.kv_offload import KVOffloadConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_runner import ModelRunner
from pdserve.errors import ConfigError
from pdserve.kvoffload.copier import KVOffloadCopier
from pdserve.kvoffload.disk import DiskTier
from pdserve.kvoffload.host import HostTier
from pdserve.kvoffload.manager import KVOffloadManager
from pdserve.kvoffload.shared_pool import pool_buffer
from pdserve.kvoffload.spec import KVOffloadSpec
from pdserve.kvoffload.stages import StageGroup, open_stage_pool


def staging_slots(config: EngineConfig, num_device_blocks: int) -> int:
    """Host slots of a disk-only tier: enough for the blocks one step can evict (its token budget
    in blocks plus one partial block per running request)."""
    sc = config.scheduler
    per_step = -(-sc.max_num_batched_tokens // config.cache.block_size) + sc.max_num_seqs
    return max(1, min(num_device_blocks, per_step))


class KVOffloadTier:
    """Owns the manager (scheduler side) and the copier (worker side) of one engine."""

    def __init__(self, config: EngineConfig, runner: object, kv: KVCacheManager) -> None:
        oc = config.kv_offload
        assert oc is not None
        par = config.parallel
        stages: StageGroup | None = None
        if par.pipeline_parallel_size > 1 or par.tensor_parallel_size > 1:
            from pdserve.engine.pipeline import PipelineExecutor
            from pdserve.engine.tensor_parallel import TPModelRunner

            assert isinstance(runner, (PipelineExecutor, TPModelRunner)), type(runner)
            stages = runner
            block_bytes = sum(runner.offload_widths())  # a host slot holds every process's share
            kv_cache = runner.offload_runner().kv_cache
        else:
            assert isinstance(runner, ModelRunner), type(runner)
            block_bytes = runner.bytes_per_block()
            kv_cache = runner.kv_cache
        assert kv_cache is not None
        self.config: KVOffloadConfig = oc
        self.stages = stages
        num_device_blocks = kv_cache.shape[0]
        if oc.cpu_bytes:
            num_slots = oc.cpu_bytes // block_bytes
            if num_slots < 1:
                raise ConfigError(
                    f"kv_offload.cpu_bytes {oc.cpu_bytes} holds no KV block ({block_bytes} bytes each); "
                    "raise it or set it to 0 for a disk-only tier"
                )
        else:
            # stages: a staged store goes to disk once its step completed, up to two steps later
            num_slots = staging_slots(config, num_device_blocks) * (2 if stages is not None else 1)
        if stages is None:
            self.copier = KVOffloadCopier(kv_cache, num_slots, config.step_timeout_s)
            buffer = self.copier.buffer()
        else:
            pool, self.copier = open_stage_pool(stages, num_slots, config.step_timeout_s)
            buffer = pool_buffer(pool)
        disk = None
        if oc.disk_path is not None:
            disk = DiskTier(oc.disk_path, oc.disk_bytes, block_bytes)
            if disk.capacity_blocks < 1:
                disk.close()
                raise ConfigError(
                    f"kv_offload.disk_bytes {oc.disk_bytes} holds no KV block ({block_bytes} bytes "
                    "plus a 48-byte header each); raise it"
                )
        host = HostTier(buffer, block_bytes, num_slots)
        self.manager = KVOffloadManager(
            host,
            disk,
            kv.block_size,
            host_serves_hits=oc.cpu_bytes > 0,
            wait_stores=self.copier.wait_stores,
            stores_complete_with_step=stages is not None,
        )
        kv.offload = self.manager
        kv.pool.on_evict = self.manager.on_evict

    def execute(self, spec: KVOffloadSpec | None, before_remote_writes: bool) -> None:
        """Queue a step's copies; ``before_remote_writes``: remote KV pulls start next and write
        outside the device's stream order, so the stores must be on the host first."""
        if not spec:
            return
        load_s = self.copier.execute(spec)
        if spec.loads:
            self.manager.record_load(spec.read_s + load_s)
        if before_remote_writes and spec.stores:
            self.copier.wait_stores()
            if self.stages is not None:  # every stage's stores, before remote writes reach its blocks
                self.stages.store_on_stages(spec)
                spec.stores = []  # done: the spec travels on to the stages with the step

    def close(self) -> None:
        self.manager.close()
