"""Turns a SchedulerOutput into tensors, runs the model (or one pipeline stage), samples.

The only engine module that makes tensors. Owns the KV cache tensor of its stage:

    kv_cache: [num_blocks, num_local_layers, 2, block_size, num_kv_heads, head_dim]

and exposes each local layer's slice of it as a registrable memory region for KV transfer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.config.engine import CacheSizes, EngineConfig
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampler import Sampler, SamplerInput
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.errors import ConfigError
from pdserve.models.attention import AttentionMetadata
from pdserve.models.config import IntermediateTensors, ModelArchConfig
from pdserve.models.loader import load_model

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_BYTES = 256 << 20


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available; use device='cpu'")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request id -> sampled token (chunks with sample=True)
    logprobs: dict[str, TokenLogprob]  # for requests that asked for logprobs
    intermediate: IntermediateTensors | None = None  # non-last pipeline stages


class ModelRunner:
    def __init__(self, config: EngineConfig, layer_start: int = 0, layer_end: int | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model, self.arch = load_model(config.model, self.dtype, self.device, layer_start, layer_end)
        self.model.eval()
        self.block_size = config.cache.block_size
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self.kv_cache: torch.Tensor | None = None
        self.layer_caches: list[torch.Tensor] = []

    # -- KV cache ----------------------------------------------------------------------------
    @property
    def arch_config(self) -> ModelArchConfig:
        return self.arch

    @property
    def num_local_layers(self) -> int:
        return len(self.model.layer_names)

    def bytes_per_block(self) -> int:
        a = self.arch
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_local_layers * 2 * self.block_size * a.num_key_value_heads * a.head_dim * elem

    def determine_cache_sizes(self) -> CacheSizes:
        cc = self.config.cache
        per_block = self.bytes_per_block()
        if cc.num_blocks_override is not None:
            num_blocks = cc.num_blocks_override
        elif cc.kv_cache_memory_bytes is not None:
            num_blocks = cc.kv_cache_memory_bytes // per_block
        elif self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations: the budget is a share of what is free after weights.
            num_blocks = int(free * cc.gpu_memory_utilization) // per_block
        else:
            num_blocks = CPU_DEFAULT_KV_BYTES // per_block
        if num_blocks < 1:
            raise ConfigError(
                f"the KV cache budget holds no block ({per_block} bytes each); raise kv_cache_memory_bytes"
            )
        return CacheSizes(num_blocks=num_blocks, block_size=self.block_size, bytes_per_block=per_block)

    def init_kv_cache(self, num_blocks: int) -> None:
        a = self.arch
        self.kv_cache = torch.zeros(
            (num_blocks, self.num_local_layers, 2, self.block_size, a.num_key_value_heads, a.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        # [num_blocks, 2, block_size, num_kv_heads, head_dim] views, one per local layer
        self.layer_caches = [self.kv_cache[:, i] for i in range(self.num_local_layers)]

    # -- one step ----------------------------------------------------------------------------
    def _prepare(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_idx: list[int] = []
        max_blocks = 0
        for c in sched.chunks:
            token_ids.extend(c.request.token_ids_slice(c.start_pos, c.start_pos + c.num_tokens))
            positions.extend(range(c.start_pos, c.start_pos + c.num_tokens))
            query_lens.append(c.num_tokens)
            seq_lens.append(c.start_pos + c.num_tokens)
            if c.sample:
                sample_idx.append(len(token_ids) - 1)
            max_blocks = max(max_blocks, len(c.block_ids))
        table = [c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in sched.chunks]
        dev = self.device
        pos_t = torch.tensor(positions, dtype=torch.long)
        bt = torch.tensor(table, dtype=torch.int32)
        qlens_t = torch.tensor(query_lens, dtype=torch.int32)
        req_idx = torch.repeat_interleave(torch.arange(len(query_lens)), qlens_t)
        slots = bt[req_idx, pos_t // bs].long() * bs + pos_t % bs
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        torch.cumsum(qlens_t, 0, out=qsl[1:])
        meta = AttentionMetadata(
            num_tokens=len(token_ids),
            slot_mapping=slots.to(dev, non_blocking=True),
            query_start_loc=qsl.to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=bt.to(dev, non_blocking=True),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=bs,
        )
        ids_t = torch.tensor(token_ids, dtype=torch.long).to(dev, non_blocking=True)
        return ids_t, pos_t.to(dev, non_blocking=True), meta, sample_idx

    def _generator(self, req_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = self._generators.get(req_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self._generators[req_id] = g
        return g

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, intermediate: IntermediateTensors | None = None
    ) -> RunnerOutput:
        for rid in sched.finished_req_ids:
            self._generators.pop(rid, None)
        if sched.is_empty:
            return RunnerOutput({}, {})
        input_ids, positions, meta, sample_idx = self._prepare(sched)
        out = self.model(input_ids, positions, self.layer_caches, meta, intermediate=intermediate)
        if not self.model.is_last_stage:
            return RunnerOutput({}, {}, intermediate=out)
        if not sample_idx:
            return RunnerOutput({}, {})
        logits = self.model.compute_logits(out[sample_idx])  # [num_sampled, vocab] fp32
        sampling_chunks = [c for c in sched.chunks if c.sample]
        inputs = [
            SamplerInput(
                params=c.request.sampling_params,
                prompt_token_ids=c.request.prompt_token_ids,
                output_token_ids=c.request.output_token_ids,
                generator=self._generator(c.request.request_id, c.request.sampling_params.seed),
                eos_token_ids=c.request.eos_token_ids,
            )
            for c in sampling_chunks
        ]
        res = self.sampler(logits, inputs)
        sampled = {c.request.request_id: t for c, t in zip(sampling_chunks, res.token_ids, strict=True)}
        logprobs = {
            c.request.request_id: lp
            for c, lp in zip(sampling_chunks, res.logprobs, strict=True)
            if lp is not None
        }
        return RunnerOutput(sampled, logprobs)
