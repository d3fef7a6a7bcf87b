"""CUDA graphs for pure-decode steps: capture the model forward once per batch size, replay it.

    step                                             runs
    ---------------------------------------------    ----------------------------------------
    every request computes 1 token, n <= max size    pad n up to the next captured size, replay
    anything else (prefill, mixed, n > max size)     the eager forward (ModelRunner)

A runner captures no graphs where ``cuda_graphs_off_reason`` names why (CPU, enforce_eager, LoRA,
the torch attention path, a pipeline stage, tensor parallelism): all its steps run eagerly.

Static buffers, sized for the largest captured batch and shared by every graph; the first three
are views of one device byte buffer, so a step's inputs arrive with a single host-to-device copy
(of everything up to the last table row the step's padded size reads):

    ids_pos_slots    [3, max_bs]                     int64   rows: input ids, positions, slots
    seq_lens         [max_bs]                        int32
    block_tables     [max_bs, max_blocks_per_seq]    int32   max_blocks_per_seq =
                                                             ceil(max_model_len / block_size)
    query_start_loc  arange(max_bs + 1)              int32   (one token per request, constant)

Padding rows (n <= i < captured size) get token 0 at position 0, slot -1 (their K/V is not
stored) and seq_len 0 (they attend to nothing); their outputs are dropped. Block-table entries
past a request's seq_len may be stale from earlier steps; nothing reads them.

The captured attention metadata holds static bounds only (max_seq_len = max_model_len, query
lens 1, ``static_bounds=True``): the Triton attention reads every per-step value from the device
buffers, and its launch shape depends only on the batch size, so one capture serves every step.
The context bound is max_model_len because the scheduler never lets a request grow past it.

One graph per step, not a chain of per-layer pieces: launching the whole Llama-1B-shaped step
(~425 kernels) costs 8-30 us of host time on the H200 machine (docs/benchmarks.md); a chain of
2-layer pieces measured no faster. (torch.profiler inflates graph launches to ~0.4 ms: time
launches without it.)
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from array import array
from typing import TYPE_CHECKING

import torch

from pdserve.distributed.parallel_state import tp_size
from pdserve.engine.host_batch import PinnedStaging, apply_feed
from pdserve.models.attention import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from pdserve.config.engine import EngineConfig
    from pdserve.engine.host_batch import HostBatch
    from pdserve.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: powers of two below ``max_num_seqs``, then ``max_num_seqs``.

    Powers of two keep the Triton KV-split choice (made on next_power_of_2(batch)) the same for a
    padded batch as for the same batch run eagerly.
    """
    assert max_num_seqs >= 1, max_num_seqs
    sizes = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    sizes.append(max_num_seqs)
    return sizes


def cuda_graphs_off_reason(
    config: EngineConfig, device: torch.device, attn_backend: AttentionBackend, model: LlamaForCausalLM
) -> str | None:
    """Why a runner's steps all run eagerly (ModelRunner.init_kv_cache logs it); None: its
    pure-decode steps replay graphs."""
    if device.type != "cuda":
        return f"device {device}"
    if config.enforce_eager:
        return "enforce_eager=True"
    if config.lora is not None:
        return "LoRA adapters run eagerly (a step's adapter rows vary)"
    if attn_backend != "triton":
        return f"attention backend {attn_backend!r} writes KV with data-dependent shapes"
    if not (model.is_first_stage and model.is_last_stage):
        return "pipeline stages run eagerly"
    if tp_size() > 1:
        return "tensor parallel all-reduces are not captured yet (untested on GPUs)"
    return None


class CudaGraphRunner:
    """Owns the static decode buffers and one captured graph per batch size.

    ``run`` overwrites the static buffers and replays; the returned tensor is a view of the
    graph's output buffer, valid until the next ``run``. Before ``capture`` (and on CPU, where
    tests use it) ``run`` executes the same padded static forward eagerly.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        layer_caches: list[torch.Tensor],
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        attn_backend: AttentionBackend,
        staging: PinnedStaging | None = None,
    ) -> None:
        """``staging``: the runner's pinned buffers (a private one when None)."""
        assert layer_caches, "no KV cache layers"
        assert model.is_first_stage and model.is_last_stage, "graphs capture whole models only"
        self.model = model
        self.layer_caches = layer_caches
        self.device = layer_caches[0].device
        self.staging = staging if staging is not None else PinnedStaging(self.device)
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch_size = self.sizes[-1]
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.attn_backend = attn_backend
        max_bs, dev, width = self.max_batch_size, self.device, self.max_blocks_per_seq
        i64_bytes, lens_bytes = 3 * max_bs * 8, max_bs * 4
        self._inputs = torch.zeros(i64_bytes + lens_bytes + max_bs * width * 4, dtype=torch.uint8, device=dev)
        self.ids_pos_slots = self._inputs[:i64_bytes].view(torch.int64).view(3, max_bs)
        self.ids_pos_slots[2].fill_(-1)
        self.seq_lens = self._inputs[i64_bytes : i64_bytes + lens_bytes].view(torch.int32)
        self.block_tables = self._inputs[i64_bytes + lens_bytes :].view(torch.int32).view(max_bs, width)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self._metas = {bs: self._metadata(bs) for bs in self.sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.num_runs = 0  # decode steps served (replayed, or run eagerly before capture)

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_tokens=bs,
            slot_mapping=self.ids_pos_slots[2, :bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[self.max_model_len] * bs,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            backend=self.attn_backend,
            static_bounds=True,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        out = self.model(
            self.ids_pos_slots[0, :bs], self.ids_pos_slots[1, :bs], self.layer_caches, self._metas[bs]
        )
        assert isinstance(out, torch.Tensor)
        return out  # [bs, hidden]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size (largest first, one shared memory pool). The static buffers hold
        padding (slot -1, seq_len 0) meanwhile, so capture writes nothing to the KV cache."""
        assert self.device.type == "cuda", f"CUDA graphs need a CUDA device, not {self.device}"
        t0 = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info(self.device)
        with torch.cuda.device(self.device):
            # Warm up off the capture: Triton compiles (it specialises on sizes), cuBLAS picks kernels.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for bs in self.sizes:
                    self._forward(bs)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream()
            # No garbage collection inside a capture: a collection there can free another
            # engine's CUDA graphs or tensors (a reference cycle), whose destruction is not
            # permitted while a stream captures, and the capture fails (as torch.cuda.graph does:
            # collect first; and none during it).
            gc.collect()
            was_enabled = gc.isenabled()
            gc.disable()
            try:
                for bs in reversed(self.sizes):  # largest first: smaller ones reuse its memory
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.stream(stream):
                        graph.capture_begin(pool=pool)
                        self._outputs[bs] = self._forward(bs)
                        graph.capture_end()
                    self._graphs[bs] = graph
            finally:
                if was_enabled:
                    gc.enable()
            torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info(self.device)
        logger.info(
            "captured decode CUDA graphs for batch sizes %s in %.2f s (%.0f MiB)",
            self.sizes,
            time.perf_counter() - t0,
            (free_before - free_after) / 2**20,
        )

    def replay(self, bs: int) -> None:
        """Launch the captured graph of batch size ``bs`` (benchmarks time this alone)."""
        self._graphs[bs].replay()

    def padded_size(self, num_seqs: int) -> int:
        """The smallest captured size >= num_seqs."""
        assert 1 <= num_seqs <= self.max_batch_size, num_seqs
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def can_run(self, batch: HostBatch) -> bool:
        return (
            batch.is_decode
            and batch.num_seqs <= self.max_batch_size
            and batch.width == self.max_blocks_per_seq  # built at the static width (the runner)
        )

    def run(self, batch: HostBatch, prev_sampled: torch.Tensor | None = None) -> torch.Tensor:
        """Forward one decode batch through the graph of its padded size -> [num_seqs, hidden].

        Rows listed in ``batch.feed_dst`` take their input token from ``prev_sampled`` (the
        previous step's samples, on the device). The copies into the static buffers are queued
        on the stream, so they wait for a replay still reading them.
        """
        assert self.can_run(batch), (batch.num_tokens, batch.num_seqs, batch.width)
        n = batch.num_seqs
        bs = self.padded_size(n)
        pad = self.max_batch_size - n  # every row up to max_bs: the copy is one contiguous prefix
        zeros = array("q", bytes(8 * pad))
        # One copy: ids | positions | slots (padding: token 0, position 0, slot -1, each row
        # max_bs long) | seq_lens (padding 0) | block-table rows 0..n-1 at the static width.
        staged = self.staging.stage_arrays(
            batch.token_ids,
            zeros,
            batch.positions,
            zeros,
            batch.slots,
            array("q", [-1]) * pad,
            array("i", batch.seq_lens),
            array("i", bytes(4 * pad)),
            batch.block_table_flat,
        )
        self._inputs[: staged.numel()].copy_(staged, non_blocking=True)
        apply_feed(self.ids_pos_slots[0], batch, prev_sampled, self.staging)
        self._metas[bs].refilled()
        self.num_runs += 1
        if bs not in self._graphs:
            return self._forward(bs)[:n]
        self.replay(bs)
        return self._outputs[bs][:n]
