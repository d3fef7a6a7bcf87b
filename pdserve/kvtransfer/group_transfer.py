"""KV transfer of a model whose KV cache groups have block tables of their own
(engine/kv_group_tables.py): every group's tensor is registered, its layers' regions travel as
any region does, and a push moves each group's blocks with that group's ids.

    group 0 (full attention)   src ids = the held table's first need_blocks entries, as before
    group g >= 1               the receiver's table covers [0, num_tokens) with NULL entries
                               before its window; the blocks it does hold (its window at the
                               first position it computes) are written from the sender's table,
                               which must hold each of them (its window ended at or before it)

    receiver table (W = 32, bs 16, 150 tokens):  NULL NULL NULL NULL NULL NULL  8  9  11  10
    sender table (held after prefill):           NULL NULL NULL NULL NULL  3    4  7  6   12
    moved:                                                                     4->8 7->9 6->11 12->10

The group layout both sides run with travels in the handshake (``kv_groups`` of
``HandshakeInfo``): a node with tables per group and one with a shared table cannot trade
blocks. No torch.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from pdserve.errors import InvalidRequestError
from pdserve.kvtransfer.descriptors import BlockIdsLike
from pdserve.kvtransfer.regions import (
    DescriptorPlan,
    DescriptorTable,
    LayoutKey,
    Region,
    align_regions,
    layout_key,
    merge_adjacent,
)

# The block every group's pool takes at start and never frees (engine/kv_group_tables.py): a
# table entry of a block the group does not hold. Defined here, beneath the engine, so that this
# package imports nothing of it (tests/distributed/test_import_floors.py).
NULL_BLOCK_ID = 0


class GroupSpec(Protocol):
    """What the wire form reads of engine/kv_cache_groups.KVCacheGroupSpec."""

    @property
    def kind(self) -> str: ...
    @property
    def layer_names(self) -> tuple[str, ...]: ...
    @property
    def block_size(self) -> int: ...
    @property
    def sliding_window(self) -> int | None: ...


def shared_table_reason(moves_kv: bool, kv_checksum: bool, kv_transport: str) -> str | None:
    """Why a node's KV transfer settings keep every KV group on one block table (None: they
    do not): the checksum digests one tensor, cuda_ipc shares one tensor's handle."""
    if not moves_kv:
        return None
    if kv_checksum:
        return "kv_checksum digests one KV tensor"
    if kv_transport == "cuda_ipc":
        return "kv_transport cuda_ipc shares one KV tensor"
    return None


def kv_tensors_of(runner: Any) -> list[Any]:
    """The KV tensors a node registers with its transfer engine: each group's, or the one."""
    gkv = getattr(runner, "group_kv", None)
    return list(gkv.tensors) if gkv is not None else [runner.kv_cache]


def kv_groups_wire(specs: Sequence[GroupSpec], own_tables: bool) -> str:
    """The group layout a handshake compares: "" for one table shared by every layer."""
    if not own_tables:
        return ""
    return ";".join(f"{s.kind}:{s.block_size}:{s.sliding_window or 0}:{len(s.layer_names)}" for s in specs)


def group_tensor_regions(
    tensor_addr: int, shape: Sequence[int], elem_bytes: int, layer_names: Sequence[str]
) -> list[Region]:
    """Regions of one group's tensor ``[num_blocks, L, *block_shape]``; layer j is ``layer_names[j]``."""
    num_blocks, num_layers = shape[0], shape[1]
    assert num_layers == len(layer_names), (shape, layer_names)
    layer_bytes = math.prod(shape[2:]) * elem_bytes
    stride = num_layers * layer_bytes
    return [
        Region(name, 0, tensor_addr + j * layer_bytes, stride, layer_bytes, num_blocks)
        for j, name in enumerate(layer_names)
    ]


def group_kv_regions(runner: Any) -> list[Region]:
    """Every region of a runner whose groups have tensors of their own (``runner.group_kv``)."""
    gkv = runner.group_kv
    names = runner.model.layer_names
    out: list[Region] = []
    for g, t in enumerate(gkv.tensors):
        layers = [names[i] for i, grp in enumerate(gkv.layer_group) if grp == g]
        out += group_tensor_regions(t.data_ptr(), tuple(t.shape), t.element_size(), layers)
    return out


class GroupPlan:
    """A producer's descriptor plans toward one receiver layout, one per group."""

    def __init__(
        self, src: Sequence[Region], dst: Sequence[Region], layer_groups: Sequence[set[str]]
    ) -> None:
        self.plans = [
            DescriptorPlan(
                align_regions(
                    [r for r in src if r.layer_name in names], [r for r in dst if r.layer_name in names]
                )
            )
            for names in layer_groups
        ]

    def descriptors(
        self,
        src_ids: BlockIdsLike,
        dst_ids: Sequence[int],
        src_group_ids: Sequence[Sequence[int]],
        dst_group_ids: Sequence[Sequence[int]],
    ) -> DescriptorTable:
        """Group 0 from ``src_ids`` to ``dst_ids``; group g from the sender's table to every
        non-NULL entry of the receiver's (both tables cover the same positions from 0)."""
        if len(dst_group_ids) != len(self.plans) - 1 or len(src_group_ids) != len(self.plans) - 1:
            raise InvalidRequestError(
                f"{len(dst_group_ids)} destination group tables for {len(self.plans) - 1} KV groups "
                "after the first; prefill and decode must run the same KV group layout"
            )
        raw = [self.plans[0].descriptors(src_ids, dst_ids)]
        for g, (plan, src_t, dst_t) in enumerate(
            zip(self.plans[1:], src_group_ids, dst_group_ids, strict=True), 1
        ):
            if len(dst_t) != len(dst_ids):
                raise InvalidRequestError(f"group {g}: {len(dst_t)} table entries for {len(dst_ids)} blocks")
            src_sel, dst_sel = [], []
            for i, d in enumerate(dst_t):
                if d == NULL_BLOCK_ID:
                    continue
                s = src_t[i] if i < len(src_t) else NULL_BLOCK_ID
                if s == NULL_BLOCK_ID:
                    raise InvalidRequestError(
                        f"group {g}: block {i} is wanted by the receiver but no longer held here "
                        "(its window moved past it)"
                    )
                src_sel.append(s)
                dst_sel.append(d)
            raw.append(plan.descriptors(src_sel, dst_sel))
        return merge_adjacent(np.concatenate(raw))


class GroupPlans:
    """A producer's ``GroupPlan`` per receiver layout (the same on every push from one decode
    node; bounded against a churning fleet). Thread-safe."""

    def __init__(self, src: Sequence[Region], layer_groups: Sequence[set[str]]) -> None:
        self.src, self.layer_groups = list(src), list(layer_groups)
        self._plans: dict[LayoutKey, GroupPlan] = {}
        self._lock = threading.Lock()

    def get(self, dst: Sequence[Region]) -> GroupPlan:
        """Raises RegionMismatchError (not cached) when the layouts do not pair up."""
        key = layout_key(dst)
        with self._lock:
            plan = self._plans.get(key)
        if plan is None:
            plan = GroupPlan(self.src, dst, self.layer_groups)
            with self._lock:
                if len(self._plans) >= 64:
                    self._plans.clear()
                self._plans[key] = plan
        return plan
