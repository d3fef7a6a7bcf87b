"""Engine settings: frozen dataclasses (mini-sglang style).

Sizes found at run time (how many KV blocks fit) live in :class:`CacheSizes`, not here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from pdserve.config.kv_offload import KVOffloadConfig
from pdserve.config.lora import LoRAConfig
from pdserve.config.speculative import SpeculativeConfig
from pdserve.errors import ConfigError


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Memory for KV: an absolute byte budget wins; otherwise gpu_memory_utilization of the GPU
    # less weights and activations, or on a CPU min(4 GiB, half of MemAvailable) (engine/kv_sizing.py).
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two > 0, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # token budget of one step
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"
    # Overload: a request arriving while this many wait (admitted, never scheduled)
    # is refused (CapacityError -> RESOURCE_EXHAUSTED -> the router's 503); one waiting longer
    # than max_queue_wait_s without being scheduled is dropped the same way. None: unbounded.
    max_queue_len: int | None = None
    max_queue_wait_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_queue_len is not None and self.max_queue_len < 1:
            raise ConfigError(f"max_queue_len must be >= 1 or None, got {self.max_queue_len}")
        if self.max_queue_wait_s is not None and not self.max_queue_wait_s > 0:
            raise ConfigError(f"max_queue_wait_s must be > 0 or None, got {self.max_queue_wait_s}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass(frozen=True)
class ParallelConfig:
    pipeline_parallel_size: int = 1
    pipeline_rank: int = 0
    tensor_parallel_size: int = 1
    # Layers per pipeline stage (len = pipeline_parallel_size, sums to the model's layers);
    # None: even split, the first stages one layer more (pdserve.kvtransfer.topology.split_layers)
    pp_layer_split: tuple[int, ...] | None = None
    # Prefill context parallelism (pdserve/pcp): ranks that split a long prompt chunk's prefill
    prefill_context_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.pipeline_rank < self.pipeline_parallel_size:
            raise ConfigError(
                f"pipeline_rank must be in [0, {self.pipeline_parallel_size}), got {self.pipeline_rank}"
            )
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        split = self.pp_layer_split
        if split is not None and (len(split) != self.pipeline_parallel_size or min(split) < 1):
            raise ConfigError(
                f"pp_layer_split {list(split)} must hold {self.pipeline_parallel_size} positive layer "
                f"counts (one per pipeline stage, pp={self.pipeline_parallel_size})"
            )
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ConfigError(
                "tensor_parallel_size > 1 with pipeline_parallel_size > 1 is not supported yet; "
                "use one of them"
            )
        pcp = self.prefill_context_parallel_size
        if pcp < 1:
            raise ConfigError(f"prefill_context_parallel_size (pcp) must be >= 1, got {pcp}")
        if pcp > 1 and (self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1):
            raise ConfigError(
                f"prefill_context_parallel_size (pcp) {pcp} with tensor_parallel_size "
                f"{self.tensor_parallel_size} and pipeline_parallel_size {self.pipeline_parallel_size} "
                "is not supported; use pcp with tp 1 and pp 1"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: str  # Hugging Face checkpoint folder (models/resolve.py turns a .gguf or an HF id into one)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16 on CUDA)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # None: the checkpoint's max_position_embeddings, lowered to what the KV cache holds
    max_model_len: int | None = None
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    enforce_eager: bool = False  # CUDA: no CUDA graphs
    # Schedule step N+1 while step N runs on the device (its tokens fed on the device); the
    # host's scheduling, input building and output processing then hide behind the GPU. None:
    # on for one CUDA device, off with TP ranks or pipeline stages (there it runs when set: it is
    # tested on CPU ranks only) and off on the CPU (the forward itself blocks the host, so there
    # is nothing to hide).
    async_scheduling: bool | None = None
    # Longest a step's device work may take before the engine gives up on it (a hung kernel or
    # device then fails the requests with an error instead of blocking the node forever).
    step_timeout_s: float = 300.0
    # Structured outputs (pdserve.engine.grammar_compile): a constraint's spec past
    # max_grammar_bytes is refused at admission; a grammar that does not compile within
    # grammar_compile_timeout_s is cancelled (its worker process killed) and its request ends
    # with an error while the others keep stepping; the worker process must start within
    # grammar_worker_start_timeout_s.
    max_grammar_bytes: int = 65536
    grammar_compile_timeout_s: float = 10.0
    grammar_worker_start_timeout_s: float = 60.0
    # torch's intra-op CPU threads in each of the engine's processes. None: on a CPU device half
    # the host's usable cores (at least one), split between the engine's processes (TP ranks,
    # pipeline stages), leaving the rest to the node's other processes (front end, router,
    # clients): on a 2-core host one thread made the tiny model's engine 10-15% faster than two
    # (docs/benchmarks.md, "CPU threads"); on other devices torch's default. A number: that
    # many threads in each of the engine's processes, on any device.
    cpu_threads: int | None = None
    # Multi-LoRA serving (pdserve/lora): None serves the base model only
    lora: LoRAConfig | None = None
    # Speculative decoding (pdserve.spec_decode): None off; a mapping is read as SpeculativeConfig.
    speculative: SpeculativeConfig | None = None
    # Evicted prefix-cache blocks kept in host memory and/or on disk (pdserve/kvoffload/); None: off.
    kv_offload: KVOffloadConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", SpeculativeConfig.from_value(self.speculative))
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.step_timeout_s <= 0:
            raise ConfigError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")
        for name in ("grammar_compile_timeout_s", "grammar_worker_start_timeout_s", "max_grammar_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.lora is not None and (
            self.parallel.tensor_parallel_size > 1 or self.parallel.pipeline_parallel_size > 1
        ):
            raise ConfigError(
                "lora: adapters are served with tensor_parallel_size=1 and pipeline_parallel_size=1 "
                f"only, got {self.parallel.tensor_parallel_size} / {self.parallel.pipeline_parallel_size}"
            )
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"cpu_threads must be >= 1 (or unset for auto), got {self.cpu_threads}")

    def intra_op_threads(self, cpu_device: bool, processes: int = 1) -> int | None:
        """torch's intra-op threads for one of the engine's ``processes`` (``cpu_threads``);
        None: leave torch's default (auto on a device other than the CPU)."""
        if self.cpu_threads is not None:
            return self.cpu_threads
        if not cpu_device:
            return None
        return max(1, usable_cpus() // (2 * processes))


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; a container's cgroup limit may be less)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CacheSizes:
    """Found at start-up from the memory budget."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    budget_bytes: int = 0  # what the blocks were cut from (kv_cache_memory_bytes or the default)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size
