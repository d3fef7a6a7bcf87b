"""The batched apply of a step's adapters on one layer (torch path: CPU, and CUDA without Triton).

Each LoRA-capable ``Linear`` holds a ``LoRASlots``: every slot's A and B for all of the layer's
shards (a fused qkv_proj has three: q, k, v), the shards' ranks side by side:

    a      [max_loras, R', in]    R' = num_shards * max_lora_rank; shard i owns columns [i*R, (i+1)*R)
    b_t    [max_loras, R', out]   shard i's rows write only its output slice (block-diagonal)
    scale  [max_loras, R']        each column's stored scale (LoRAModuleWeights.scale), 0 where unused

A step's rows name their slot (``LoRAStep.row_slots``, -1 = base model). Two ways to apply:

    segmented  rows grouped by slot (index lists made once per step); per slot present
               y[rows] += ((x[rows] @ a[s].T) * scale[s]) @ b_t[s]
    dense      one GEMM over every slot: xa = x @ a.view(S*R', in).T, masked to each row's slot and
               scaled, then y += xa @ b_t.view(S*R', out) (the BGMV shape without gathers)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.kernels.backend import host_to_device, small_to_device
from pdserve.lora.peft import LoRAModuleWeights


@dataclass
class LoRAStep:
    """One step's per-row adapter slots (the same for every layer of the step)."""

    row_slots: torch.Tensor  # [n] int64, -1 = base model
    mode: str  # "segmented" | "dense" | "bgmv"
    num_slots: int
    # segmented: (slot, rows) per slot present; rows a slice when contiguous, else an index tensor
    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)
    onehot: torch.Tensor | None = None  # dense: [n, S, 1] in the compute dtype
    slots_present: frozenset[int] = frozenset()  # the slots some row uses (host side, every mode)

    @classmethod
    def build(
        cls,
        slots_per_chunk: list[tuple[int, int]],
        num_slots: int,
        mode: str,
        dtype: torch.dtype,
        device: torch.device,
    ) -> LoRAStep:
        """From (slot, num_tokens) per chunk in batch order."""
        row_list: list[int] = []
        for slot, n in slots_per_chunk:
            row_list.extend([slot] * n)
        # Queued copies (kernels.backend.host_to_device): a pageable copy would wait for the
        # device, i.e. for the previous step, and undo asynchronous scheduling.
        rows = torch.tensor(row_list, dtype=torch.int64)
        step = cls(host_to_device(rows, device), mode, num_slots)
        step.slots_present = frozenset(slot for slot, n in slots_per_chunk if slot >= 0 and n)
        if mode == "bgmv":
            return step
        if mode == "dense":
            onehot = torch.zeros(len(row_list), num_slots, 1, dtype=dtype)
            used = rows >= 0
            onehot[used.nonzero(as_tuple=True)[0], rows[used], 0] = 1
            step.onehot = host_to_device(onehot, device)
            return step
        starts: dict[int, list[int]] = {}
        pos = 0
        for slot, n in slots_per_chunk:
            if slot >= 0:
                starts.setdefault(slot, []).extend(range(pos, pos + n))
            pos += n
        for slot, idx in starts.items():
            lo, hi = idx[0], idx[-1] + 1
            if hi - lo == len(idx):
                step.groups.append((slot, slice(lo, hi)))
            else:
                step.groups.append((slot, small_to_device(idx, torch.int64, device)))
        return step

    @property
    def any_adapter(self) -> bool:
        return bool(self.slots_present)  # host side: no wait for the device


class LoRASlots:
    """A layer's slot stacks; ``shards`` are (HF module suffix, output offset, output size)."""

    def __init__(
        self,
        in_features: int,
        shards: list[tuple[str, int, int]],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shards = shards
        self.max_rank = max_rank
        out_features = sum(size for _, _, size in shards)
        width = len(shards) * max_rank
        self.a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.b_t = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)
        self.scale = torch.zeros(max_loras, width, dtype=dtype, device=device)
        self.step: LoRAStep | None = None  # set by the manager around each forward

    def set_slot(self, slot: int, shard_weights: list[LoRAModuleWeights | None]) -> None:
        """Write one adapter's modules into ``slot`` (None: the adapter leaves that shard alone)."""
        self.a[slot].zero_()
        self.b_t[slot].zero_()
        self.scale[slot].zero_()
        for i, ((_, offset, size), w) in enumerate(zip(self.shards, shard_weights, strict=True)):
            if w is None:
                continue
            assert w.rank <= self.max_rank and w.b.shape[0] == size, (w.rank, tuple(w.b.shape), size)
            col = i * self.max_rank
            self.a[slot, col : col + w.rank] = w.a.to(self.a.dtype)
            self.b_t[slot, col : col + w.rank, offset : offset + size] = w.b.T.to(self.b_t.dtype)
            self.scale[slot, col : col + w.rank] = w.scale  # the stored value, never re-derived

    def clear_slot(self, slot: int) -> None:
        self.set_slot(slot, [None] * len(self.shards))

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus each row's adapter delta; ``x`` [n, in], ``y`` [n, out]."""
        step = self.step
        if step is None or x.dim() != 2:
            return y
        assert x.shape[0] == step.row_slots.shape[0], (tuple(x.shape), tuple(step.row_slots.shape))
        if step.mode == "bgmv":  # CUDA (or the Triton interpreter): pdserve/lora/triton_bgmv.py
            from pdserve.lora.triton_bgmv import bgmv_add

            return bgmv_add(x.contiguous(), y.contiguous(), self.a, self.b_t, self.scale, step.row_slots)
        xc = x.to(self.a.dtype)
        if step.mode == "dense":
            if step.onehot is None:
                return y
            n, (s, w, i) = x.shape[0], self.a.shape
            xa = (xc @ self.a.view(s * w, i).T).view(n, s, w)  # [n, S, R']
            xa = xa * (step.onehot * self.scale)  # each row keeps its own slot's columns, scaled
            return y + (xa.view(n, s * w) @ self.b_t.view(s * w, -1)).to(y.dtype)
        if not step.groups:
            return y
        for slot, rows in step.groups:
            delta = ((xc[rows] @ self.a[slot].T) * self.scale[slot]) @ self.b_t[slot]  # [m, out]
            if isinstance(rows, slice):
                y[rows] += delta.to(y.dtype)
            else:
                y.index_add_(0, rows, delta.to(y.dtype))
        return y
