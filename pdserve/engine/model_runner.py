"""Turns a SchedulerOutput into tensors, runs the model (or one pipeline stage), samples.

The only engine module that makes tensors. Owns the KV cache tensor of its stage:

    kv_cache: [num_blocks, num_local_layers, 2, block_size, num_kv_heads / tp, head_dim]

and exposes each local layer's slice of it as a registrable memory region for KV transfer.

With tensor parallelism every TP rank runs one runner on its share of the heads (see
``pdserve.models.llama``); all ranks agree on the number of KV blocks (the smallest budget).

On CUDA, pure-decode steps replay captured CUDA graphs (``pdserve.engine.cuda_graphs``, off with
``enforce_eager``); other steps run eagerly. The attention path (torch or Triton) is chosen once
here, by ``select_attention_backend``, and carried in every step's ``AttentionMetadata``.

Next to it: engine/device.py (device, dtype), engine/kv_tensors.py (KV blocks from the budget,
zeroed tensors), engine/host_batch.py (a step's inputs), engine/step_sampling.py (what a step
does after the last stage's forward: logits, grammar masks, the sampler, seeded draws).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING

import torch

from pdserve.config.engine import CacheSizes, EngineConfig, usable_cpus
from pdserve.distributed.parallel_state import tp_size
from pdserve.engine.cuda_graphs import CudaGraphRunner, cuda_graphs_off_reason
from pdserve.engine.device import resolve_device, resolve_dtype
from pdserve.engine.grammar_masks import GrammarMasker
from pdserve.engine.group_kv import GroupKV, group_block_shapes
from pdserve.engine.host_batch import (
    HostBatch,
    PinnedStaging,
    apply_feed,
    batch_to_device,
    build_host_batch,
)
from pdserve.engine.kv_cache_groups import KVCacheGroupSpec
from pdserve.engine.kv_tensors import kv_cache_sizes, zeroed_kv_tensor
from pdserve.engine.mm_inputs import needs_mm_embeds, prompt_embeds, substitute_mm_embeds
from pdserve.engine.pending_step import PendingStep, RunnerOutput
from pdserve.engine.profile_memory import gpu_memory
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.step_sampling import SeededStreams, launch_sampler, sample_step
from pdserve.lora.manager import LoRAManager
from pdserve.models.attention import AttentionMetadata
from pdserve.models.attention_backend import select_attention_backend
from pdserve.models.config import IntermediateTensors
from pdserve.models.loader import load_model

if TYPE_CHECKING:
    from pdserve.pcp.step import ContextParallel

logger = logging.getLogger(__name__)


class _ZeroRows(dict[str, int]):
    """Row 0 for every request: the token ids of a non-first pipeline stage are not read."""

    def __missing__(self, key: str) -> int:
        return 0


_NO_FEED = _ZeroRows()


class ModelRunner:
    # A prefill-context-parallel rank (pdserve/pcp): set before __init__ (make_drafter reads it)
    pcp: ContextParallel | None = None

    def __init__(self, config: EngineConfig, layer_start: int = 0, layer_end: int | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model, self.arch = load_model(config.model, self.dtype, self.device, layer_start, layer_end)
        self.model.eval()
        self.block_size = config.cache.block_size
        # every host <-> device copy of a step
        self.staging = PinnedStaging(self.device, timeout_s=config.step_timeout_s)
        self.sampler = Sampler(self.staging)
        self.seeds = SeededStreams(self.device)  # seeded rows' generators or counter-based draws
        # Structured outputs: matchers, bitmask fills (on a thread of their own on CUDA hosts
        # with cores to spare), the masks' host buffers.
        self.grammar = GrammarMasker(
            config, self.device, self.staging, use_filler=self.device.type == "cuda" and usable_cpus() >= 4
        )
        self.kv_cache: torch.Tensor | None = None
        self.layer_caches: list[torch.Tensor] = []
        self.group_kv: GroupKV | None = None  # KV groups with tables of their own (init_group_kv_cache)
        a = self.arch
        self.max_model_len = config.max_model_len or a.max_position_embeddings  # as LLMEngine
        self.num_kv_heads = a.num_key_value_heads // tp_size()  # this TP rank's share
        self.attn_backend = select_attention_backend(
            self.device, self.dtype, a.num_attention_heads // tp_size(), self.num_kv_heads, a.head_dim
        )
        self.cuda_graphs: CudaGraphRunner | None = None  # set by init_kv_cache on CUDA
        # The last launched step's sampled tokens (device) and each request's row in them: the
        # next step feeds them to rows whose input token is still in flight.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        self.lora = (
            LoRAManager(self.model, config.lora, self.dtype, self.device) if config.lora is not None else None
        )
        # A speculative drafter with weights (draft_model, mtp): its model, its KV beside ours.
        from pdserve.spec_decode.drafter import make_drafter

        self.drafter = make_drafter(config, self)

    # -- KV cache ----------------------------------------------------------------------------
    @property
    def num_local_layers(self) -> int:
        return len(self.model.layer_names)

    def bytes_per_block(self) -> int:
        a = self.arch
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_local_layers * 2 * self.block_size * self.num_kv_heads * a.head_dim * elem

    def determine_cache_sizes(self) -> CacheSizes:
        """The KV budget (engine/kv_sizing.py) in blocks of this stage's layers."""
        # A drafter's KV (spec_decode/drafter.py) shares our block ids: a block holds both.
        per_block = self.bytes_per_block() + (self.drafter.bytes_per_block() if self.drafter else 0)
        return kv_cache_sizes(self.config.cache, per_block, self.device, lambda: gpu_memory(self))

    def init_kv_cache(self, num_blocks: int) -> None:
        a = self.arch
        shape = (num_blocks, self.num_local_layers, 2, self.block_size, self.num_kv_heads, a.head_dim)
        self.kv_cache = zeroed_kv_tensor(shape, self.dtype, self.device)
        # [num_blocks, 2, block_size, num_kv_heads, head_dim] views, one per local layer
        self.layer_caches = [self.kv_cache[:, i] for i in range(self.num_local_layers)]
        if self.drafter is not None:
            self.drafter.init_kv_cache(num_blocks)
        reason = cuda_graphs_off_reason(self.config, self.device, self.attn_backend, self.model)
        if reason is not None:
            logger.info("CUDA graphs off: %s", reason)
            return
        self.cuda_graphs = CudaGraphRunner(
            self.model,
            self.layer_caches,
            max_num_seqs=min(
                self.config.scheduler.max_num_seqs, self.config.scheduler.max_num_batched_tokens
            ),
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            attn_backend=self.attn_backend,
            staging=self.staging,
        )
        self.cuda_graphs.capture()

    def group_layer_block_bytes(self, specs: list[KVCacheGroupSpec]) -> tuple[int, ...]:
        """Bytes of one layer's block in each KV cache group (engine/group_kv.py's shapes)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        shapes = group_block_shapes(specs, self.num_kv_heads, self.arch.head_dim, self.arch.hidden_size)
        return tuple(math.prod(s) * elem for s in shapes)

    def init_group_kv_cache(self, specs: list[KVCacheGroupSpec], num_blocks: tuple[int, ...]) -> None:
        """One KV tensor per KV cache group (``num_blocks[g]`` blocks of group g's layers), for
        groups with block tables of their own (engine/group_kv.py); steps run eagerly."""
        make = functools.partial(zeroed_kv_tensor, dtype=self.dtype, device=self.device)
        shapes = group_block_shapes(specs, self.num_kv_heads, self.arch.head_dim, self.arch.hidden_size)
        self.group_kv = GroupKV(self.model.layer_names, specs, num_blocks, shapes, make)
        self.kv_cache = self.group_kv.tensors[0]
        self.layer_caches = self.group_kv.layer_caches
        logger.info("CUDA graphs off: KV cache groups with block tables of their own")

    # -- one step ----------------------------------------------------------------------------
    def _to_device(self, batch: HostBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return batch_to_device(batch, self.staging, self.block_size, self.attn_backend)

    @property
    def num_generators(self) -> int:
        """Seeded requests' generators kept now (0 once every request finished)."""
        return self.seeds.num_generators

    def drop_finished(self, request_ids: list[str]) -> None:
        """Forget per-request state (seeded generators, grammar matchers) of finished requests."""
        self._forget(request_ids)

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.seeds.drop(rid)
            self.grammar.drop(rid)
        if self.drafter is not None:
            self.drafter.drop(request_ids)

    def close(self) -> None:
        """Stop the bitmask filler thread, if one was started (idempotent)."""
        self.grammar.close()

    def execute(
        self, sched: SchedulerOutput, intermediate: IntermediateTensors | None = None
    ) -> RunnerOutput:
        """Run one step and wait for its samples (``launch(...).result()``)."""
        return self.launch(sched, intermediate).result()

    @torch.inference_mode()
    def launch(
        self,
        sched: SchedulerOutput,
        intermediate: IntermediateTensors | None = None,
        *,
        defer_masks: bool = False,
    ) -> PendingStep:
        """Queue one step's device work and the copy of its samples to the host; returns at once
        on CUDA (nothing here waits for the device, so the host can prepare the next step).

        ``defer_masks`` (asynchronous scheduling): when a sampling row has a grammar, stop after
        the logits and return a step whose ``deferred`` job ``sample_deferred`` finishes once the
        previous step's tokens are on the host (the forward runs on the device meanwhile)."""
        self._forget(sched.finished_req_ids)
        if sched.is_empty:
            return PendingStep([], None, None)
        self.staging.begin_step()
        graphs = self.cuda_graphs
        decode_only = sched.total_num_scheduled_tokens == len(sched.chunks)
        # Decode steps build their block table at the graphs' static width: copied as it is.
        width = (
            graphs.max_blocks_per_seq if graphs is not None and decode_only and intermediate is None else None
        )
        # Later pipeline stages take hidden states: a token in flight needs no feed there.
        prev_rows = self._prev_rows if intermediate is None else _NO_FEED
        batch = build_host_batch(sched, self.block_size, prev_rows, width)
        out: torch.Tensor | IntermediateTensors
        if (
            graphs is not None
            and intermediate is None
            and graphs.can_run(batch)
            and not needs_mm_embeds(sched)
        ):
            out = graphs.run(batch, self._prev_sampled)  # [num_tokens, hidden], the graph's output buffer
        else:
            input_ids, positions, meta = self._to_device(batch)
            if self.group_kv is not None:
                self.group_kv.attach(meta, sched, batch, self.staging)
            if intermediate is None:
                apply_feed(input_ids, batch, self._prev_sampled, self.staging)
            embeds = None
            if intermediate is None:  # prompt and image embeddings enter the first stage only
                embeds = prompt_embeds(sched, input_ids, self.model.model.embed_tokens)
                embeds = substitute_mm_embeds(sched, input_ids, embeds, self.model.model.embed_tokens)
            if self.lora is not None:
                self.lora.begin_step([(c.request.lora_name, c.num_tokens) for c in sched.chunks], self.device)
            if self.pcp is not None:  # this rank's rows of the step; the global rows come back
                out = self.pcp.forward(self, sched, batch, input_ids, positions, meta, embeds)
            else:
                out = self.model(
                    input_ids,
                    positions,
                    self.layer_caches,
                    meta,
                    intermediate=intermediate,
                    inputs_embeds=embeds,
                )
        if not self.model.is_last_stage:
            assert isinstance(out, IntermediateTensors)
            return PendingStep(
                [], None, self.staging.end_step(), intermediate=out, timeout_s=self.config.step_timeout_s
            )
        assert isinstance(out, torch.Tensor)
        if self.drafter is not None:  # MTP reads the target's hidden states of the step
            self.drafter.keep_hidden(out)
        return sample_step(self, sched, batch, out, defer_masks)

    def prepare_deferred_sampled(self, pending: PendingStep, sampled: dict[str, int]) -> None:
        """``prepare_deferred`` as soon as the previous step's ``sampled`` tokens are on the host,
        before they enter the histories: in steady decode with a filler thread the matchers'
        accept and the masks' fill start here (``GrammarMasker.start_sampled``); otherwise
        nothing happens and ``prepare_deferred`` does the work."""
        job = pending.deferred
        if job is not None and job.grammar_rows and job.masks is None:
            job.masks = self.grammar.start_sampled(job.chunks, job.grammar_rows, sampled)

    def prepare_deferred(self, pending: PendingStep) -> None:
        """Advance the grammar matchers of ``pending``'s deferred sampler and start filling its
        masks (the previous step's tokens are in the requests' histories); ``sample_deferred``
        finishes. The host work in between overlaps the fill when a filler thread runs it."""
        job = pending.deferred
        assert job is not None, "the step's sampler was already launched"
        if job.grammar_rows and job.masks is None:
            job.masks = self.grammar.start(job.chunks, job.grammar_rows, job.logits.shape[1], overlap=True)

    @torch.inference_mode()
    def sample_deferred(self, pending: PendingStep) -> None:
        """Launch ``pending``'s sampler: grammar masks (in place), argmax or the sampler, the
        copy of the samples to the host and the step's event. Nothing waits for the device."""
        job = pending.deferred
        assert job is not None, "the step's sampler was already launched"
        samples = launch_sampler(job, self.grammar, self.sampler, self.seeds)
        pending.deferred = None  # launched
        # The next step may feed these tokens to its rows before the host has read them.
        self._prev_sampled = samples.token_ids
        self._prev_rows = {rid: i for i, rid in enumerate(pending.req_ids)}
        if not self.staging.pinned:
            pending.samples = samples
            return
        pending.samples = samples.copy_to_host(self.staging.host_like)
        pending.event = self.staging.end_step()
        slot = self.staging.slot
        pending.staging = (self.staging, slot, self.staging.generation(slot))
