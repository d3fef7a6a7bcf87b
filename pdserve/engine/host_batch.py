"""One step's inputs, built on the host, and their way to the device.

Built in ``array`` buffers (C ints): a 64-request decode step costs tens of microseconds, where
nested lists through ``torch.tensor`` cost hundreds. On CUDA every copy between host and device
goes through pinned memory (``PinnedStaging``), so it is queued on the stream behind the work
already there; a pageable source can make the driver wait for that work, which would undo
asynchronous scheduling.

Fed tokens (asynchronous scheduling): a decode row whose input is the token the previous step
sampled has no value on the host yet. Its id is a placeholder 0 here; ``apply_feed`` writes the
real one from the previous step's sampled-token tensor, on the device, before the forward:

    rows of this step     | r0 | r1 | r2 | r3 |      feed_dst = [0, 1, 3]
    previous samples      | s(r1) | s(r0) | s(r3) |  feed_src = [1, 0, 2]
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.errors import EngineStalledError
from pdserve.models.attention import AttentionBackend, AttentionMetadata


def extend_slots(slots: array, block_ids: Sequence[int], start: int, end: int, block_size: int) -> None:
    """Append the KV slots of positions [start, end): one range per block touched, not per token."""
    pos = start
    while pos < end:
        b = pos // block_size
        stop = min(end, (b + 1) * block_size)
        base = block_ids[b] * block_size - b * block_size  # slot = block_ids[b] * bs + (pos - b * bs)
        slots.extend(range(base + pos, base + stop))
        pos = stop


@dataclass
class HostBatch:
    """One step's inputs on the host, request after request (see pdserve.models.attention)."""

    token_ids: array  # 'q' [num_tokens]; fed rows hold 0 until apply_feed
    positions: array  # 'q' [num_tokens]
    slots: array  # 'q' [num_tokens] block_id * block_size + offset
    query_lens: list[int]  # [num_seqs]
    seq_lens: list[int]  # [num_seqs] context length after this step
    block_table_flat: array  # 'i' [num_seqs * width], each row padded with block 0
    width: int  # blocks per block-table row: the step's longest block list
    sample_idx: list[int]  # token rows whose hidden state is sampled
    feed_dst: list[int] = field(default_factory=list)  # token rows fed from the previous samples
    feed_src: list[int] = field(default_factory=list)  # their rows in the previous sampled tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        """Every request computes exactly one token (the CUDA-graph case)."""
        return len(self.token_ids) == len(self.seq_lens)


def build_host_batch(
    sched: SchedulerOutput, block_size: int, prev_rows: dict[str, int], table_width: int | None = None
) -> HostBatch:
    """The step's inputs (the only per-token Python work of a step).

    ``prev_rows``: request id -> row in the previous step's sampled tokens, for requests whose
    input token is still a placeholder (``Request.num_output_placeholders``). ``table_width``:
    pad block-table rows to this many entries (the CUDA graphs' static width) instead of the
    step's longest row.
    """
    bs = block_size
    token_ids, positions, slots = array("q"), array("q"), array("q")
    query_lens: list[int] = []
    seq_lens: list[int] = []
    sample_idx: list[int] = []
    feed_dst: list[int] = []
    feed_src: list[int] = []
    chunks = sched.chunks
    width = table_width if table_width is not None else max(len(c.block_ids) for c in chunks)
    table = array("i")
    zero_bytes = bytes(4 * width)
    for c in chunks:
        start, n, blocks, req = c.start_pos, c.num_tokens, c.block_ids, c.request
        prompt, output = req.prompt_token_ids, req.output_token_ids
        if n == 1:  # decode: no slices, no ranges
            num_prompt = len(prompt)
            if start == num_prompt + len(output):  # the token at `start` is in flight: fed on the device
                feed_dst.append(len(token_ids))
                feed_src.append(prev_rows[req.request_id])
                token_ids.append(0)
            else:
                token_ids.append(prompt[start] if start < num_prompt else output[start - num_prompt])
            positions.append(start)
            b = start // bs
            slots.append(blocks[b] * bs + start - b * bs)
        else:
            drafts = c.spec_token_ids  # speculative decoding: verified rows after the last known token
            assert start + n - len(drafts) <= req.num_tokens, (
                "only a single-token chunk can start at a fed token"
            )
            token_ids.extend(req.token_ids_slice(start, start + n - len(drafts)))
            token_ids.extend(drafts)
            positions.extend(range(start, start + n))
            extend_slots(slots, blocks, start, start + n, bs)
        query_lens.append(n)
        seq_lens.append(start + n)
        if c.sample:
            sample_idx.extend(range(len(token_ids) - 1 - len(c.spec_token_ids), len(token_ids)))
        table.extend(blocks)
        table.frombytes(zero_bytes[4 * len(blocks) :])
    return HostBatch(
        token_ids, positions, slots, query_lens, seq_lens, table, width, sample_idx, feed_dst, feed_src
    )


def batch_to_device(
    batch: HostBatch, staging: PinnedStaging, block_size: int, attn_backend: AttentionBackend
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Eager inputs: two host-to-device copies (int64 per token, int32 per request)."""
    n, b = batch.num_tokens, batch.num_seqs
    qsl = array("i", [0])
    for q in batch.query_lens:
        qsl.append(qsl[-1] + q)
    put = staging.to_device
    i64_d = put(batch.token_ids + batch.positions + batch.slots, torch.int64).view(3, n)
    # [b seq_lens | b + 1 query_start_loc | b * width table]
    i32_d = put(array("i", batch.seq_lens) + qsl + batch.block_table_flat, torch.int32)
    meta = AttentionMetadata(
        num_tokens=n,
        slot_mapping=i64_d[2],
        query_start_loc=i32_d[b : 2 * b + 1],
        seq_lens=i32_d[:b],
        block_tables=i32_d[2 * b + 1 :].view(b, batch.width),
        query_lens_cpu=batch.query_lens,
        seq_lens_cpu=batch.seq_lens,
        max_query_len=max(batch.query_lens),
        max_seq_len=max(batch.seq_lens),
        block_size=block_size,
        backend=attn_backend,
    )
    return i64_d[0], i64_d[1], meta


def wait_event(event: torch.cuda.Event, timeout_s: float, what: str) -> None:
    """Block until ``event`` passed, at most ``timeout_s``; EngineStalledError after that.

    Polls (the other threads of the process keep the interpreter meanwhile) rather than
    ``event.synchronize()``, which could block forever behind a hung kernel.
    """
    if event.query():
        return
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise EngineStalledError(
                f"{what} did not complete within step_timeout_s={timeout_s:g} s: the device is hung "
                "or the step is far larger than expected (raise EngineConfig.step_timeout_s)"
            )
        time.sleep(0)


class PinnedStaging:
    """Pinned host memory for the copies of a step, allocated once and reused round-robin.

    Each step takes one slot (``begin_step``): its host-to-device sources are written there
    (``stage``) and its samples copied back into it (``host_like``); ``end_step`` records an
    event behind the step's copies. A slot is written again ``num_slots`` steps later, only
    after its event passed, so a copy still queued never reads overwritten bytes. Whoever reads
    a slot's samples must do so before then (``generation`` tells whether it was reused).
    A pinned allocation per copy, the simpler way, costs ~16 microseconds of
    host time each, four a step (docs/benchmarks.md, "GPU decode throughput").

    On a CPU device nothing is pinned and nothing is copied: ``stage`` shares the array.
    """

    ALIGN = 64

    def __init__(
        self,
        device: torch.device,
        num_slots: int = 4,
        slot_bytes: int = 1 << 20,
        timeout_s: float = 300.0,
    ) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self.pinned = device.type == "cuda"
        self._slots = [self._alloc(slot_bytes) for _ in range(num_slots)] if self.pinned else []
        self._events: list[torch.cuda.Event | None] = [None] * num_slots
        self._generations = [0] * num_slots
        self._slot = 0
        self._used = 0

    @staticmethod
    def _alloc(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    @property
    def slot(self) -> int:
        return self._slot

    def generation(self, slot: int) -> int:
        return self._generations[slot]

    def begin_step(self) -> None:
        if not self.pinned:
            return
        self._slot = (self._slot + 1) % len(self._slots)
        ev = self._events[self._slot]
        if ev is not None:  # the copies of this slot's last step (long done in steady state)
            wait_event(ev, self.timeout_s, f"the step that last used staging slot {self._slot}")
        self._generations[self._slot] += 1
        self._used = 0

    def end_step(self) -> torch.cuda.Event | None:
        """Record the event behind this step's copies; returns it (None on CPU)."""
        if not self.pinned:
            return None
        ev = torch.cuda.Event()
        ev.record()
        self._events[self._slot] = ev
        return ev

    def _take(self, nbytes: int) -> torch.Tensor:
        start = -(-self._used // self.ALIGN) * self.ALIGN
        buf = self._slots[self._slot]
        if start + nbytes > buf.numel():
            # Grow this slot. Earlier views of this step keep the old buffer alive; torch's
            # host allocator frees it only after the copies that read it.
            buf = self._slots[self._slot] = self._alloc(max(2 * buf.numel(), nbytes + self.ALIGN))
            start = 0
        self._used = start + nbytes
        return buf[start : start + nbytes]

    def stage(self, values: array, dtype: torch.dtype) -> torch.Tensor:
        """``values`` as a 1-D host tensor to copy from (pinned on CUDA)."""
        if not self.pinned or not len(values):
            return torch.frombuffer(values, dtype=dtype) if len(values) else torch.empty(0, dtype=dtype)
        return self.stage_arrays(values).view(dtype)

    def stage_arrays(self, *parts: array) -> torch.Tensor:
        """The arrays' bytes back to back, as one 1-D uint8 host tensor (pinned on CUDA), for a
        single copy; plain memcpy, no torch call per part. Each part's length in bytes must keep
        the next part aligned to its item size."""
        total = sum(len(p) * p.itemsize for p in parts)
        if not self.pinned:
            buf = bytearray(total)
            out = torch.frombuffer(buf, dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
        else:
            out = self._take(total)
        view = out.numpy().data if total else memoryview(bytearray())
        off = 0
        for p in parts:
            raw = memoryview(p).cast("B")
            view[off : off + len(raw)] = raw
            off += len(raw)
        return out

    def stage_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU tensor's values in this step's pinned slot (itself on CPU devices)."""
        if not self.pinned or t.numel() == 0:
            return t
        out = self._take(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
        out.copy_(t)
        return out

    def host_like(self, t: torch.Tensor) -> torch.Tensor:
        """An uninitialised pinned host tensor shaped like device tensor ``t``, in this slot."""
        assert self.pinned, "host_like is for device-to-host copies on CUDA"
        if t.numel() == 0:
            return torch.empty(t.shape, dtype=t.dtype)
        return self._take(t.numel() * t.element_size()).view(t.dtype).view(t.shape)

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor for the host to fill and then copy to the device: in this
        step's pinned slot on CUDA (a plain tensor on CPU devices)."""
        if not self.pinned:
            return torch.empty(shape, dtype=dtype)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return self._take(nbytes).view(dtype).view(shape)

    def to_device(self, values: array, dtype: torch.dtype) -> torch.Tensor:
        """``values`` on the device (1-D), queued without waiting for the device."""
        return self.stage(values, dtype).to(self.device, non_blocking=True)

    def list_to_device(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        """A small tensor made from Python values, on the device without waiting for it
        (``torch.tensor(data, device="cuda")`` copies from pageable memory and synchronises)."""
        t = torch.tensor(data, dtype=dtype)
        return self.stage_tensor(t).to(self.device, non_blocking=True)


def apply_feed(
    input_ids: torch.Tensor, batch: HostBatch, prev_sampled: torch.Tensor | None, staging: PinnedStaging
) -> None:
    """Write the previous step's sampled tokens into the rows that wait for them (device work)."""
    dst, src = batch.feed_dst, batch.feed_src
    if not dst:
        return
    assert prev_sampled is not None, "fed rows but no previous step sampled"
    k = len(dst)
    if dst[-1] == k - 1 and src == dst:  # rows strictly increase: dst == src == 0..k-1
        input_ids[:k].copy_(prev_sampled[:k])
        return
    idx = staging.to_device(array("q", dst + src), torch.int64)
    input_ids.index_copy_(0, idx[:k], prev_sampled.index_select(0, idx[k:]))


def copy_to_host(
    t: torch.Tensor | None, host_like: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor | None:
    """``t`` copied into a host tensor made by ``host_like`` (pinned on CUDA: the copy is queued
    behind the step's work and does not block the host; read it once the step's event passed)."""
    if t is None:
        return None
    h = host_like(t)
    h.copy_(t, non_blocking=True)
    return h
