"""KV memory regions, their alignment between prefill and decode, and transfer descriptors.

A region is one layer's slice of a registered KV cache tensor. The engine keeps one tensor per
pipeline stage shaped ``[num_blocks, num_local_layers, 2, block_size, num_kv_heads, head_dim]``,
so one block holds every local layer's K and V and a run of consecutive blocks is one contiguous
byte range across all layers:

    byte offset in the tensor (L local layers, S = 2*block_size*Hkv*D*elem_bytes)
    +-------------------- block 0 ---------------------+-------------------- block 1 ----...
    | layer 0 K,V | layer 1 K,V | ... | layer L-1 K,V  | layer 0 K,V | ...
    0             S             2S    (L-1)S           L*S           L*S+S

    region of layer i:  base = tensor_base + i*S,  block_stride_bytes = L*S,  block_bytes = S

Pure Python: no torch, so the prefill service and the tests can use it without the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.errors import PdserveError

# Mooncake's batch calls take at most this many descriptors; 2,049 returns -1 and moves nothing.
MAX_DESCRIPTORS_PER_BATCH = 2048

# (src_addr, dst_addr, length_bytes)
Descriptor = tuple[int, int, int]


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


class BlockIdError(PdserveError, ValueError):
    """A block id list is out of range, has duplicates, or does not pair up with its peer list."""


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


def check_block_ids(block_ids: Sequence[int], num_blocks: int | None, *, what: str = "block ids") -> None:
    """Raise BlockIdError unless every id is in ``[0, num_blocks)`` (only ``>= 0`` when num_blocks is None)."""
    for b in block_ids:
        if b < 0 or (num_blocks is not None and b >= num_blocks):
            bound = "" if num_blocks is None else f", {num_blocks}"
            raise BlockIdError(f"{what}: block id {b} is outside [0{bound})")


def build_descriptors(
    pairs: Sequence[tuple[Region, Region]],
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
) -> list[Descriptor]:
    """Descriptors copying ``src_block_ids[i]`` to ``dst_block_ids[i]`` for every region pair.

    Adjacent ranges are merged whenever both the source and the destination are contiguous,
    so with the layout above and consecutive block runs on both sides, a whole run across all
    layers becomes one descriptor. Block ids are bounds-checked against each region's num_blocks.
    ``DescriptorPlan`` is the same with the per-pair work done once.
    """
    return DescriptorPlan(pairs).descriptors(src_block_ids, dst_block_ids)


class DescriptorPlan:
    """The per-(sender, receiver) part of ``build_descriptors``, done once: layers fused into
    groups (side by side on both ends with equal strides: per block one range) and the block
    bounds. ``descriptors()`` then costs one pass over the block ids (a producer reuses the plan
    for every push to the same decode layout)."""

    def __init__(self, pairs: Sequence[tuple[Region, Region]]) -> None:
        self.pairs = list(pairs)
        groups: list[
            tuple[int, int, int, int, int]
        ] = []  # (src_base, dst_base, src_stride, dst_stride, nbytes)
        for s, d in sorted(self.pairs, key=lambda p: p[0].base_addr):
            if groups:
                sb, db, ss, ds, n = groups[-1]
                if (ss, ds) == (s.block_stride_bytes, d.block_stride_bytes) and (sb + n, db + n) == (
                    s.base_addr,
                    d.base_addr,
                ):
                    groups[-1] = (sb, db, ss, ds, n + s.block_bytes)
                    continue
            groups.append(
                (s.base_addr, d.base_addr, s.block_stride_bytes, d.block_stride_bytes, s.block_bytes)
            )
        self.groups = groups
        s_lim = [s.num_blocks for s, _ in self.pairs if s.num_blocks is not None]
        d_lim = [d.num_blocks for _, d in self.pairs if d.num_blocks is not None]
        self._src_limit = min(s_lim) if s_lim else None
        self._dst_limit = min(d_lim) if d_lim else None

    def _check(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> None:
        if len(src_block_ids) != len(dst_block_ids):
            raise BlockIdError(
                f"sender has {len(src_block_ids)} block ids but receiver has {len(dst_block_ids)}; they pair 1:1"
            )
        if len(set(dst_block_ids)) != len(dst_block_ids):
            raise BlockIdError(f"receiver block ids repeat (two writes to one block): {list(dst_block_ids)}")
        if not src_block_ids or not self.pairs:
            return
        # The id lists are the same for every layer, so their extremes decide; the per-layer scan
        # (which names the layer and the id) runs only when they fail.
        s_lo, s_hi, d_lo, d_hi = (
            min(src_block_ids),
            max(src_block_ids),
            min(dst_block_ids),
            max(dst_block_ids),
        )
        if s_lo < 0 or (self._src_limit is not None and s_hi >= self._src_limit):
            for s, _ in self.pairs:
                check_block_ids(src_block_ids, s.num_blocks, what=f"sender layer {s.layer_name!r}")
        if d_lo < 0 or (self._dst_limit is not None and d_hi >= self._dst_limit):
            for _, d in self.pairs:
                check_block_ids(dst_block_ids, d.num_blocks, what=f"receiver layer {d.layer_name!r}")

    def descriptors(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[Descriptor]:
        self._check(src_block_ids, dst_block_ids)
        # Runs of blocks consecutive on both ends, in the given order: (src id, dst id, count).
        runs: list[list[int]] = []
        k = len(src_block_ids)
        if (
            k
            and list(src_block_ids) == list(range(src_block_ids[0], src_block_ids[0] + k))
            and list(dst_block_ids) == list(range(dst_block_ids[0], dst_block_ids[0] + k))
        ):  # the common fresh-pool case, without a Python loop over the ids
            runs.append([src_block_ids[0], dst_block_ids[0], k])
            src_block_ids = dst_block_ids = ()
        for sbid, dbid in zip(src_block_ids, dst_block_ids, strict=True):
            if runs:
                last = runs[-1]
                if last[0] + last[2] == sbid and last[1] + last[2] == dbid:
                    last[2] += 1
                    continue
            runs.append([sbid, dbid, 1])
        raw: list[Descriptor] = []
        for sb, db, ss, ds, n in self.groups:
            if ss == n and ds == n:  # the group fills the block stride: a run is one range
                raw += [(sb + r[0] * ss, db + r[1] * ds, n * r[2]) for r in runs]
            else:
                raw += [(sb + (r[0] + i) * ss, db + (r[1] + i) * ds, n) for r in runs for i in range(r[2])]
        return merge_adjacent(raw)


def merge_adjacent(raw: list[Descriptor]) -> list[Descriptor]:
    """``raw`` sorted, with ranges contiguous on both ends merged into one (sorts in place)."""
    raw.sort()
    merged: list[Descriptor] = []
    for src_addr, dst_addr, n in raw:
        if merged:
            ps, pd, pn = merged[-1]
            if ps + pn == src_addr and pd + pn == dst_addr:
                merged[-1] = (ps, pd, pn + n)
                continue
        merged.append((src_addr, dst_addr, n))
    return merged


def split_batches(
    descs: Sequence[Descriptor], max_per_batch: int = MAX_DESCRIPTORS_PER_BATCH
) -> list[list[Descriptor]]:
    """Chunk descriptors into batches the engine accepts (at most ``max_per_batch`` each)."""
    if max_per_batch <= 0:
        raise ValueError(f"max_per_batch must be > 0, got {max_per_batch}")
    return [list(descs[i : i + max_per_batch]) for i in range(0, len(descs), max_per_batch)]
