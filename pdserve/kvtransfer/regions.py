"""KV memory regions and their alignment between prefill and decode.

A region is one layer's slice of a registered KV cache tensor. The engine keeps one tensor per
pipeline stage shaped ``[num_blocks, num_local_layers, 2, block_size, num_kv_heads, head_dim]``,
so one block holds every local layer's K and V and a run of consecutive blocks is one contiguous
byte range across all layers:

    byte offset in the tensor (L local layers, S = 2*block_size*Hkv*D*elem_bytes)
    +-------------------- block 0 ---------------------+-------------------- block 1 ----...
    | layer 0 K,V | layer 1 K,V | ... | layer L-1 K,V  | layer 0 K,V | ...
    0             S             2S    (L-1)S           L*S           L*S+S

    region of layer i:  base = tensor_base + i*S,  block_stride_bytes = L*S,  block_bytes = S

The transfer descriptors of aligned regions (``DescriptorPlan``, merging, batches) live in
``descriptors`` and are importable from here too. No torch, so the prefill service and the
tests can use it without the engine.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeAlias

from pdserve.errors import PdserveError
from pdserve.kvtransfer.descriptors import (
    MAX_DESCRIPTORS_PER_BATCH,
    BlockIdError,
    Descriptor,
    DescriptorPlan,
    Descriptors,
    DescriptorTable,
    Spans,
    check_block_ids,
    descriptor_list,
    descriptor_table,
    merge_adjacent,
    merge_adjacent_columns,
    split_batches,
)

__all__ = [
    "MAX_DESCRIPTORS_PER_BATCH",
    "BlockIdError",
    "Descriptor",
    "DescriptorPlan",
    "DescriptorTable",
    "Descriptors",
    "Region",
    "RegionMismatchError",
    "Spans",
    "align_regions",
    "build_descriptors",
    "check_block_ids",
    "descriptor_list",
    "descriptor_table",
    "layout_key",
    "merge_adjacent",
    "merge_adjacent_columns",
    "regions_for_kv_cache",
    "split_batches",
]


class RegionMismatchError(PdserveError, ValueError):
    """Prefill and decode disagree on a layer both hold (a missing occurrence or a size)."""

    def __init__(self, layer_name: str, occurrence: int, field: str, src_value: Any, dst_value: Any) -> None:
        super().__init__(
            f"KV region mismatch for layer {layer_name!r} occurrence {occurrence}: {field} is "
            f"{src_value!r} on the sender (prefill) but {dst_value!r} on the receiver (decode); "
            f"both sides must run the same model with the same dtype, block size and KV layout"
        )
        self.layer_name = layer_name
        self.occurrence = occurrence
        self.field = field
        self.src_value = src_value
        self.dst_value = dst_value


@dataclass(frozen=True)
class Region:
    """One layer's KV slice of a registered tensor; block ``b`` lives at ``base_addr + b * block_stride_bytes``."""

    layer_name: str  # the model's module name, e.g. "model.layers.3.self_attn"
    occurrence: int  # >0 only when one layer name owns several KV tensors (shared / hybrid layers)
    base_addr: int  # address of block 0 of this layer
    block_stride_bytes: int  # distance between block b and block b+1 of this layer
    block_bytes: int  # bytes of one block of this layer (K and V together)
    num_blocks: int | None = None  # blocks in the tensor, for bounds checks; None = unchecked

    def __post_init__(self) -> None:
        if self.occurrence < 0 or self.base_addr < 0 or self.block_bytes <= 0:
            raise ValueError(f"invalid region {self}: occurrence/base_addr >= 0 and block_bytes > 0 required")
        if self.block_stride_bytes < self.block_bytes:
            raise ValueError(
                f"invalid region {self}: block_stride_bytes {self.block_stride_bytes} < block_bytes "
                f"{self.block_bytes} would make blocks overlap"
            )
        if self.num_blocks is not None and self.num_blocks < 0:
            raise ValueError(f"invalid region {self}: num_blocks must be >= 0")
        if self.base_addr >= 1 << 63 or self.block_stride_bytes >= 1 << 63:
            raise ValueError(f"invalid region {self}: addresses and strides must be below 2**63 (int64)")

    @property
    def key(self) -> tuple[str, int]:
        return (self.layer_name, self.occurrence)

    def block_addr(self, block_id: int) -> int:
        return self.base_addr + block_id * self.block_stride_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Region:
        num_blocks = d.get("num_blocks")
        return cls(
            layer_name=str(d["layer_name"]),
            occurrence=int(d["occurrence"]),
            base_addr=int(d["base_addr"]),
            block_stride_bytes=int(d["block_stride_bytes"]),
            block_bytes=int(d["block_bytes"]),
            num_blocks=None if num_blocks is None else int(num_blocks),
        )


_REGION_FIELDS = operator.attrgetter(
    "layer_name", "occurrence", "base_addr", "block_stride_bytes", "block_bytes", "num_blocks"
)
# A layout's regions as plain tuples of their fields
LayoutKey: TypeAlias = tuple[tuple[str, int, int, int, int, int | None], ...]


def layout_key(regions: Iterable[Region]) -> LayoutKey:
    """The regions' fields as one tuple: a dict key that hashes and compares in C (a tuple of
    ``Region`` calls the dataclass's ``__hash__`` and ``__eq__`` once per region: 16 layers of
    a decode's layout cost half again as much to look up)."""
    return tuple(map(_REGION_FIELDS, regions))


def regions_for_kv_cache(
    base_addr: int,
    num_blocks: int,
    layer_names: Sequence[str],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    elem_bytes: int,
) -> list[Region]:
    """Regions of a ``[num_blocks, L, 2, block_size, Hkv, D]`` tensor; layer i is ``layer_names[i]``.

    A name listed twice gets occurrences 0, 1, ... in list order.
    """
    layer_bytes = 2 * block_size * num_kv_heads * head_dim * elem_bytes
    stride = len(layer_names) * layer_bytes
    seen: dict[str, int] = {}
    regions = []
    for i, name in enumerate(layer_names):
        occ = seen.get(name, 0)
        seen[name] = occ + 1
        regions.append(Region(name, occ, base_addr + i * layer_bytes, stride, layer_bytes, num_blocks))
    return regions


def _by_key(regions: Iterable[Region], side: str) -> dict[tuple[str, int], Region]:
    out: dict[tuple[str, int], Region] = {}
    for r in regions:
        if r.key in out:
            raise ValueError(f"{side} lists KV region {r.key} twice")
        out[r.key] = r
    return out


def align_regions(
    src: Sequence[Region], dst: Sequence[Region], *, same_size: bool = True
) -> list[tuple[Region, Region]]:
    """Pair sender and receiver regions by ``(layer_name, occurrence)``, never by list position.

    A layer the receiver does not hold at all (no ``(name, 0)``) is skipped: that decode stage
    gets it from no one here. For a layer both hold, the occurrence sets and (``same_size``)
    ``block_bytes`` must agree, else RegionMismatchError; TP ranks holding different head counts
    pass ``same_size=False`` (``head_slices.HeadSlicePlan`` checks their sizes). Pairs come back
    in ``src`` order.
    """
    src_map, dst_map = _by_key(src, "sender"), _by_key(dst, "receiver")
    dst_names = {name for name, _ in dst_map}
    src_names = {name for name, _ in src_map}
    pairs = []
    for s in src:
        if s.layer_name not in dst_names:
            continue
        d = dst_map.get(s.key)
        if d is None:
            raise RegionMismatchError(s.layer_name, s.occurrence, "presence", "present", "missing")
        if same_size and d.block_bytes != s.block_bytes:
            raise RegionMismatchError(s.layer_name, s.occurrence, "block_bytes", s.block_bytes, d.block_bytes)
        pairs.append((s, d))
    # The receiver expecting an occurrence the sender lacks, for a layer the sender holds, is the
    # same mismatch seen from the other side: the receiver would wait for KV nobody sends.
    for key, d in dst_map.items():
        if d.layer_name in src_names and key not in src_map:
            raise RegionMismatchError(d.layer_name, d.occurrence, "presence", "missing", "present")
    return pairs


def build_descriptors(
    pairs: Sequence[tuple[Region, Region]],
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
) -> list[Descriptor]:
    """Descriptors copying ``src_block_ids[i]`` to ``dst_block_ids[i]`` for every region pair,
    as tuples of Python ints (``DescriptorPlan.descriptors`` gives the same rows as a table).

    Adjacent ranges are merged whenever both the source and the destination are contiguous,
    so with the layout above and consecutive block runs on both sides, a whole run across all
    layers becomes one descriptor. Block ids are bounds-checked against each region's num_blocks.
    """
    return descriptor_list(DescriptorPlan(pairs).descriptors(src_block_ids, dst_block_ids))
