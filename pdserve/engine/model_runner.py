"""Turns a SchedulerOutput into tensors, runs the model (or one pipeline stage), samples.

The only engine module that makes tensors. Owns the KV cache tensor of its stage:

    kv_cache: [num_blocks, num_local_layers, 2, block_size, num_kv_heads / tp, head_dim]

and exposes each local layer's slice of it as a registrable memory region for KV transfer.

With tensor parallelism every TP rank runs one runner on its share of the heads (see
``pdserve.models.llama``); all ranks agree on the number of KV blocks (the smallest budget).

On CUDA, pure-decode steps replay captured CUDA graphs (``pdserve.engine.cuda_graphs``, off with
``enforce_eager``); other steps run eagerly. The attention path (torch or Triton) is chosen once
here, by ``select_attention_backend``, and carried in every step's ``AttentionMetadata``.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import mmap
from array import array
from typing import TYPE_CHECKING

import torch

from pdserve import kernels
from pdserve.config.engine import CacheSizes, EngineConfig
from pdserve.distributed.parallel_state import min_over_ranks, tp_rank, tp_size
from pdserve.engine.cuda_graphs import CudaGraphRunner
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
from pdserve.engine.kv_sizing import (
    GpuMemory,
    cpu_kv_budget_bytes,
    gpu_kv_budget_bytes,
    mem_available_bytes,
)
from pdserve.engine.mm_inputs import needs_mm_embeds, substitute_mm_embeds
from pdserve.engine.pending_step import PendingStep, RunnerOutput, SampleJob
from pdserve.engine.profile_memory import profile_activation_bytes
from pdserve.engine.prompt_logprobs import compute_prompt_logprobs, prompt_logprob_spans
from pdserve.engine.request import Request
from pdserve.engine.sampler import SampledTensors, Sampler, SamplerInput, argmax_only, draw_
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pdserve.engine.structured import usable_cpus
from pdserve.errors import ConfigError
from pdserve.lora.manager import LoRAManager
from pdserve.models.attention import AttentionMetadata
from pdserve.models.attention_backend import select_attention_backend
from pdserve.models.config import IntermediateTensors
from pdserve.models.loader import load_model

if TYPE_CHECKING:
    from pdserve.pcp.step import ContextParallel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def set_intra_op_threads(config: EngineConfig, processes: int = 1) -> None:
    """Apply ``config.cpu_threads`` (auto: see ``EngineConfig.intra_op_threads``) to this
    process, one of the engine's ``processes`` on the host."""
    n = config.intra_op_threads(resolve_device(config.device).type == "cpu", processes)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)


def resolve_device(device: str) -> torch.device:
    """The device of this process; TP rank r on CUDA takes GPU r (``cuda:N``: GPU N + r)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available; use device='cpu'")
    if dev.type == "cuda" and tp_size() > 1:
        index = (dev.index or 0) + tp_rank()
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"TP rank {tp_rank()} needs GPU {index} but {torch.cuda.device_count()} are visible; "
                "lower tensor_parallel_size or expose more GPUs"
            )
        dev = torch.device("cuda", index)
        torch.cuda.set_device(dev)
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


class _ZeroRows(dict[str, int]):
    """Row 0 for every request: the token ids of a non-first pipeline stage are not read."""

    def __missing__(self, key: str) -> int:
        return 0


_NO_FEED = _ZeroRows()


def lazily_zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor on an anonymous memory mapping: the kernel hands out zero pages
    on first touch, so a 4 GiB KV cache costs RAM only for the blocks requests use (torch.zeros
    writes every page up front: ~4 GiB resident and seconds of start-up)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor keeps ``buf`` alive (frombuffer holds a reference to the buffer's owner)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def zeroed_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV cache tensor: lazily zeroed pages on the CPU, ``torch.zeros`` elsewhere."""
    if device.type == "cpu":
        return lazily_zeroed_cpu_tensor(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


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
        self._generators: dict[str, torch.Generator] = {}
        # Seeded rows on CUDA draw from a counter-based stream, all in one launch
        # (kernels/triton_seeded_draw.py); on the CPU, or without Triton, a generator per request.
        self._counter_draws = (
            self.device.type == "cuda"
            and kernels.get_backend() != "torch"
            and importlib.util.find_spec("triton") is not None
        )
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
        cc = self.config.cache
        # A drafter's KV (spec_decode/drafter.py) shares our block ids: a block holds both.
        per_block = self.bytes_per_block() + (self.drafter.bytes_per_block() if self.drafter else 0)
        if cc.num_blocks_override is not None:
            budget = cc.num_blocks_override * per_block
        elif cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = gpu_kv_budget_bytes(self._gpu_memory(), cc.gpu_memory_utilization)
        else:
            budget = cpu_kv_budget_bytes(mem_available_bytes())
        num_blocks = budget // per_block
        # Every TP rank must schedule the same blocks: free memory may differ between GPUs.
        num_blocks = min_over_ranks(num_blocks, self.device)
        if num_blocks < 1:
            raise ConfigError(
                f"the KV cache budget ({budget} bytes) holds no block ({per_block} bytes each); "
                "raise kv_cache_memory_bytes"
            )
        return CacheSizes(num_blocks, self.block_size, per_block, budget_bytes=budget)

    def _gpu_memory(self) -> GpuMemory:
        """The device's memory now (weights loaded), with one step's activations: measured by a
        dummy step at the full token budget (engine/profile_memory.py), else estimated from the
        residual stream, q/k/v, the MLP's gate/up and the fp32 logits of that budget."""
        a, sc = self.arch, self.config.scheduler
        measured = profile_activation_bytes(self)
        free, total = torch.cuda.mem_get_info(self.device)
        elem = torch.empty((), dtype=self.dtype).element_size()
        tokens = min(sc.max_num_batched_tokens, self.max_model_len)
        qkv = (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim
        per_token = (4 * a.hidden_size + qkv + 3 * a.intermediate_size) * elem
        logits = min(sc.max_num_seqs, tokens) * a.vocab_size * 4 * 2  # logits + sampler's copy
        estimate = tokens * per_token + logits
        activation = estimate if measured is None else measured
        return GpuMemory(total, free, torch.cuda.memory_reserved(self.device), activation)

    def init_kv_cache(self, num_blocks: int) -> None:
        a = self.arch
        shape = (num_blocks, self.num_local_layers, 2, self.block_size, self.num_kv_heads, a.head_dim)
        self.kv_cache = zeroed_kv_tensor(shape, self.dtype, self.device)
        # [num_blocks, 2, block_size, num_kv_heads, head_dim] views, one per local layer
        self.layer_caches = [self.kv_cache[:, i] for i in range(self.num_local_layers)]
        if self.drafter is not None:
            self.drafter.init_kv_cache(num_blocks)
        reason = self._cuda_graphs_off_reason()
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

        def make(shape: tuple[int, ...]) -> torch.Tensor:
            if self.device.type == "cpu":
                return lazily_zeroed_cpu_tensor(shape, self.dtype)
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

        shapes = group_block_shapes(specs, self.num_kv_heads, self.arch.head_dim, self.arch.hidden_size)
        self.group_kv = GroupKV(self.model.layer_names, specs, num_blocks, shapes, make)
        self.kv_cache = self.group_kv.tensors[0]
        self.layer_caches = self.group_kv.layer_caches
        logger.info("CUDA graphs off: KV cache groups with block tables of their own")

    def _cuda_graphs_off_reason(self) -> str | None:
        if self.device.type != "cuda":
            return f"device {self.device}"
        if self.config.enforce_eager:
            return "enforce_eager=True"
        if self.config.lora is not None:
            return "LoRA adapters run eagerly (a step's adapter rows vary)"
        if self.attn_backend != "triton":
            return f"attention backend {self.attn_backend!r} writes KV with data-dependent shapes"
        if not (self.model.is_first_stage and self.model.is_last_stage):
            return "pipeline stages run eagerly"
        if tp_size() > 1:
            return "tensor parallel all-reduces are not captured yet (untested on GPUs)"
        return None

    # -- one step ----------------------------------------------------------------------------
    def _to_device(self, batch: HostBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return batch_to_device(batch, self.staging, self.block_size, self.attn_backend)

    def _prompt_embeds(self, sched: SchedulerOutput, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Input embeddings for a step that computes prompt positions given as embeddings.

        Rows of other tokens come from the embedding table; a request's prompt rows from its
        ``prompt_embeds`` ([num_prompt_tokens, hidden]). None when no chunk needs them.
        """
        if not any(
            c.request.prompt_embeds is not None and c.start_pos < c.request.num_prompt_tokens
            for c in sched.chunks
        ):
            return None
        embed = self.model.model.embed_tokens
        assert embed is not None, "prompt embeddings reach the first pipeline stage only"
        out = embed(input_ids)  # [num_tokens, hidden]
        row = 0
        for c in sched.chunks:
            req = c.request
            if req.prompt_embeds is not None and c.start_pos < req.num_prompt_tokens:
                k = min(c.num_tokens, req.num_prompt_tokens - c.start_pos)
                out[row : row + k] = req.prompt_embeds[c.start_pos : c.start_pos + k].to(
                    out.device, out.dtype
                )
            row += c.num_tokens
        return out

    def _seed_draw(self, chunk: ScheduledChunk) -> tuple[int, int] | None:
        """(seed, k) of a seeded chunk whose first sampled row draws its k-th output token (the
        row after its last known token; drafts, when the chunk has them, come after it), where
        seeded rows draw from the counter-based stream (CUDA with Triton); None elsewhere
        (``_generator`` serves)."""
        seed = chunk.request.sampling_params.seed
        if seed is None or not self._counter_draws:
            return None
        last_known = chunk.start_pos + chunk.num_tokens - len(chunk.spec_token_ids)
        return seed, last_known - chunk.request.num_prompt_tokens

    def _generator(self, request: Request, vocab_size: int) -> torch.Generator | None:
        """The seeded request's generator (made on first use); None for unseeded requests, and on
        the counter-based path (``_seed_draw`` serves)."""
        seed = request.sampling_params.seed
        if seed is None or self._counter_draws:
            return None
        g = self._generators.get(request.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            # Tokens it already has were sampled elsewhere from the same seed (prefill's first
            # token on P/D, a recompute): skip their draws, one row of vocab_size per token as the
            # sampler draws them, so the stream goes on where that node left it, not from its start.
            skip = torch.empty(vocab_size, device=self.device)
            for _ in range(len(request.output_token_ids)):
                draw_(skip, g)
            self._generators[request.request_id] = g
        return g

    @property
    def num_generators(self) -> int:
        """Seeded requests' generators kept now (0 once every request finished)."""
        return len(self._generators)

    def drop_finished(self, request_ids: list[str]) -> None:
        """Forget per-request state (seeded generators, grammar matchers) of finished requests."""
        self._forget(request_ids)

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)
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
            embeds = self._prompt_embeds(sched, input_ids) if intermediate is None else None
            if intermediate is None:  # image embeddings enter the first stage only
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
        spans = prompt_logprob_spans(sched)
        prompt = (
            compute_prompt_logprobs(out, spans, self.model.compute_logits, self.staging) if spans else None
        )
        if prompt is not None and self.staging.pinned:
            prompt = prompt.copy_to_host(self.staging.host_like)  # read after the step's event
        sample_idx = batch.sample_idx
        if sample_idx and any(c.spec_token_ids for c in sched.chunks):
            from pdserve.spec_decode.runner import launch_verify

            return launch_verify(
                self, sched, out[self.staging.to_device(array("q", sample_idx), torch.int64)], prompt
            )
        if not sample_idx:
            self._prev_sampled, self._prev_rows = None, {}
            return PendingStep(
                [], None, self.staging.end_step(), timeout_s=self.config.step_timeout_s, prompt=prompt
            )
        if len(sample_idx) == batch.num_tokens:  # every token samples (decode): no gather
            hidden = out
        else:
            hidden = out[self.staging.to_device(array("q", sample_idx), torch.int64)]
        sampling_chunks = (
            [c for c in sched.chunks if c.sample] if len(sample_idx) < batch.num_seqs else sched.chunks
        )
        reqs = [c.request for c in sampling_chunks]
        argmax = all(argmax_only(r.sampling_params, len(r.output_token_ids)) for r in reqs)
        # bf16 -> fp32 is exact: the argmax (first maximum on ties) and the one-pass race are the same without it
        half = argmax or self.sampler.reads_half_logits(reqs, self._counter_draws)
        logits = self.model.compute_logits(hidden, upcast=not half)  # [num_sampled, vocab]
        grammar_rows = [i for i, r in enumerate(reqs) if r.sampling_params.structured is not None]
        pending = PendingStep(
            [r.request_id for r in reqs],
            None,
            None,
            timeout_s=self.config.step_timeout_s,
            prompt=prompt,
            deferred=SampleJob(logits, sampling_chunks, argmax, grammar_rows),
        )
        if not (defer_masks and grammar_rows):
            self.sample_deferred(pending)
        return pending

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
        masks = None
        if job.grammar_rows:
            # If this raises (a fill failed or timed out), ``deferred`` stays set: the step's
            # result() then waits for the fill and the device and raises (the fault path).
            masks = job.masks or self.grammar.start(
                job.chunks, job.grammar_rows, job.logits.shape[1], overlap=False
            )
        if job.argmax:
            # no SamplerInput rows; grammar rows: the mask fused with the argmax on CUDA
            token_ids = (
                kernels.argmax_rows(job.logits) if masks is None else self.grammar.argmax(job.logits, masks)
            )
            samples = SampledTensors(token_ids, [], [])
        else:
            if masks is not None:
                self.grammar.apply(job.logits, masks)
            inputs = [
                SamplerInput(
                    params=c.request.sampling_params,
                    prompt_token_ids=c.request.prompt_token_ids,
                    output_token_ids=c.request.output_token_ids,
                    generator=self._generator(c.request, job.logits.shape[1]),
                    eos_token_ids=c.request.eos_token_ids,
                    seed_draw=self._seed_draw(c),
                )
                for c in job.chunks
            ]
            samples = self.sampler.sample(job.logits, inputs)
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
