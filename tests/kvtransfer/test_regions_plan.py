"""The numpy descriptor planning (regions.DescriptorPlan, merge_adjacent, head_slices.HeadSlicePlan)
against the pure-Python loops it replaced, kept here as the reference: the same rows in the same
order, and the same errors with the same messages, on random layouts and block id lists."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import numpy as np
import pytest

from pdserve.kvtransfer.head_slices import HeadLayout, HeadSlicePlan
from pdserve.kvtransfer.regions import (
    BlockIdError,
    Descriptor,
    DescriptorPlan,
    Region,
    align_regions,
    build_descriptors,
    check_block_ids,
    descriptor_list,
    merge_adjacent,
    regions_for_kv_cache,
)

# -- the reference: the Python implementation the numpy one replaced --------------------------------


def _ref_check_block_ids(block_ids: Sequence[int], num_blocks: int | None, *, what: str) -> None:
    for b in block_ids:
        if b < 0 or (num_blocks is not None and b >= num_blocks):
            bound = "" if num_blocks is None else f", {num_blocks}"
            raise BlockIdError(f"{what}: block id {b} is outside [0{bound})")


def _ref_merge(raw: list[Descriptor]) -> list[Descriptor]:
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


class _RefPlan:
    def __init__(self, pairs: Sequence[tuple[Region, Region]]) -> None:
        self.pairs = list(pairs)
        # the fused layer groups: built once per plan by the same Python code as before
        self.groups = DescriptorPlan(pairs).groups
        s_lim = [s.num_blocks for s, _ in self.pairs if s.num_blocks is not None]
        d_lim = [d.num_blocks for _, d in self.pairs if d.num_blocks is not None]
        self._src_limit = min(s_lim) if s_lim else None
        self._dst_limit = min(d_lim) if d_lim else None

    def check(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> None:
        if len(src_block_ids) != len(dst_block_ids):
            raise BlockIdError(
                f"sender has {len(src_block_ids)} block ids but receiver has {len(dst_block_ids)}; they pair 1:1"
            )
        if len(set(dst_block_ids)) != len(dst_block_ids):
            raise BlockIdError(f"receiver block ids repeat (two writes to one block): {list(dst_block_ids)}")
        if not src_block_ids or not self.pairs:
            return
        s_lo, s_hi = min(src_block_ids), max(src_block_ids)
        d_lo, d_hi = min(dst_block_ids), max(dst_block_ids)
        if s_lo < 0 or (self._src_limit is not None and s_hi >= self._src_limit):
            for s, _ in self.pairs:
                _ref_check_block_ids(src_block_ids, s.num_blocks, what=f"sender layer {s.layer_name!r}")
        if d_lo < 0 or (self._dst_limit is not None and d_hi >= self._dst_limit):
            for _, d in self.pairs:
                _ref_check_block_ids(dst_block_ids, d.num_blocks, what=f"receiver layer {d.layer_name!r}")

    def descriptors(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[Descriptor]:
        self.check(src_block_ids, dst_block_ids)
        runs: list[list[int]] = []
        for sbid, dbid in zip(src_block_ids, dst_block_ids, strict=True):
            if runs:
                last = runs[-1]
                if last[0] + last[2] == sbid and last[1] + last[2] == dbid:
                    last[2] += 1
                    continue
            runs.append([sbid, dbid, 1])
        raw: list[Descriptor] = []
        for sb, db, ss, ds, n in self.groups:
            if ss == n and ds == n:
                raw += [(sb + r[0] * ss, db + r[1] * ds, n * r[2]) for r in runs]
            else:
                raw += [(sb + (r[0] + i) * ss, db + (r[1] + i) * ds, n) for r in runs for i in range(r[2])]
        return _ref_merge(raw)


def _ref_head_slices(plan: HeadSlicePlan, src_ids: list[int], dst_ids: list[int]) -> list[Descriptor]:
    _RefPlan(plan.pairs).check(src_ids, dst_ids)
    raw: list[Descriptor] = []
    for s, d in plan.pairs:
        for sb, db in zip(src_ids, dst_ids, strict=True):
            s0, d0 = s.block_addr(sb), d.block_addr(db)
            raw += [(s0 + so, d0 + do, n) for so, do, n in plan.row_runs]
    return _ref_merge(raw)


# -- random layouts and id lists ------------------------------------------------------------------


def _side(
    rng: random.Random, base: int, names: list[str], num_blocks: int | None, layer: int
) -> list[Region]:
    """The engine's fused tensor, a tensor per layer, or K and V regions per layer apart."""
    kind = rng.choice(["fused", "fused", "per-layer", "kv-split"])
    if kind == "fused":
        fused = regions_for_kv_cache(base, 64, names, 1, 1, layer // 4, 2)  # ``layer`` bytes per layer
        return [dataclasses.replace(r, num_blocks=num_blocks) for r in fused]
    tensor = layer * 64 * 2
    if kind == "per-layer":
        return [Region(n, 0, base + i * tensor, layer, layer, num_blocks) for i, n in enumerate(names)]
    half = layer // 2  # [2, num_blocks, half]: K's blocks, then V's
    return [
        Region(n, occ, base + i * tensor + occ * 64 * half, half, half, num_blocks)
        for i, n in enumerate(names)
        for occ in (0, 1)
    ]


def _pairs(rng: random.Random) -> list[tuple[Region, Region]]:
    names = [f"layers.{i}" for i in range(rng.randint(1, 5))]
    nb_src, nb_dst, layer = rng.choice([None, 40, 64]), rng.choice([None, 40, 64]), 16 * rng.randint(1, 4)
    src = _side(rng, 0x10_0000, names, nb_src, layer)
    while True:  # the receiver: the same layers, a slice of them (a pipeline stage) or reordered
        held = rng.choice(
            [names, names[: max(1, len(names) // 2)], names[::-1], rng.sample(names, len(names))]
        )
        try:  # a K/V split on one side only does not align: draw again
            return align_regions(src, _side(rng, 0x90_0000, held, nb_dst, layer))
        except ValueError:
            pass


def _ids(rng: random.Random, bad: bool) -> tuple[list[int], list[int]]:
    """Runs consecutive on both ends, on one end only, repeats on the sender, scattered blocks."""
    if rng.random() < 0.2:  # one run on both ends (a fresh pool), at times past the end
        k = rng.randint(1, 12)
        s0, d0 = rng.randint(0, 45 - k), rng.randint(0, 45 - k)
        return list(range(s0, s0 + k)), list(range(d0, d0 + k))
    src: list[int] = []
    dst: list[int] = []
    free = list(range(40))
    rng.shuffle(free)
    for _ in range(rng.randint(0, 6)):
        n = rng.randint(1, 5)
        s0 = rng.randint(0, 40 - n)
        d0 = rng.choice([rng.randint(0, 40 - n), s0])
        step = rng.choice([1, 1, 0, 2])  # 0: the same sender block again (allowed), 2: gaps
        for i in range(n):
            d = d0 + i
            if d in dst:
                if not free:
                    break
                d = free.pop()
            src.append(s0 + i * step if s0 + i * step < 40 else s0)
            dst.append(d)
    if bad and src:
        what = rng.choice(["src-high", "dst-high", "neg", "repeat", "length"])
        i = rng.randrange(len(src))
        if what == "src-high":
            src[i] = rng.choice([40, 64, 1000])
        elif what == "dst-high":
            dst[i] = rng.choice([40, 64, 1000])
        elif what == "neg":
            (src if rng.random() < 0.5 else dst)[i] = -rng.randint(1, 3)
        elif what == "repeat":
            dst.append(dst[i])
            src.append(src[i])
        else:
            dst.append(rng.randint(0, 39))
    return src, dst


def _outcome(fn, *args):
    try:
        return [tuple(r) for r in descriptor_list(fn(*args))]
    except BlockIdError as e:
        return ("BlockIdError", str(e))


def test_plan_matches_the_python_reference_on_random_inputs():
    rng = random.Random(1234)
    seen_errors = seen_merges = 0
    for _ in range(300):
        pairs = _pairs(rng)
        new, ref = DescriptorPlan(pairs), _RefPlan(pairs)
        for bad in (False, True):
            src_ids, dst = _ids(rng, bad)
            # the producer's held ids are a tuple, the receiver's a list
            src: Sequence[int] = tuple(src_ids) if rng.random() < 0.5 else src_ids
            want = _outcome(ref.descriptors, src, dst)
            assert _outcome(new.descriptors, src, dst) == want, (pairs, src, dst)
            got = new.descriptors(src, dst) if isinstance(want, list) else None
            if got is not None:
                assert got.dtype == np.int64 and got.shape == (len(want), 3)
                assert build_descriptors(pairs, src, dst) == want  # tuples of Python ints
                seen_merges += len(want) < len(src) * len(ref.groups)
            seen_errors += not isinstance(want, list)
    assert seen_errors > 50 and seen_merges > 50  # the random inputs reach both paths


def test_merge_matches_the_python_reference_on_overlapping_rows():
    """Ties on the source, duplicates and chains of three or more: the order and merges hold."""
    rng = random.Random(7)
    for _ in range(300):
        raw = [
            (8 * rng.randint(0, 12), 8 * rng.randint(0, 12), 8 * rng.randint(1, 3))
            for _ in range(rng.randint(0, 30))
        ]
        got = merge_adjacent(np.array(raw, dtype=np.int64).reshape(-1, 3))
        assert descriptor_list(got) == _ref_merge(list(raw)) == descriptor_list(merge_adjacent(raw))


def test_head_slices_match_the_python_reference():
    rng = random.Random(5)
    layout = HeadLayout(block_size=4, head_dim=8, elem_bytes=2)
    names = [f"layers.{i}" for i in range(3)]
    for src_heads, dst_heads in [((0, 2), (0, 4)), ((2, 4), (0, 4)), ((0, 1), (0, 2)), ((1, 2), (0, 4))]:
        n_src, n_dst = src_heads[1] - src_heads[0], dst_heads[1] - dst_heads[0]
        src = regions_for_kv_cache(0x10_0000, 40, names, 4, n_src, 8, 2)
        dst = regions_for_kv_cache(0x90_0000, 40, names[rng.randint(0, 2) :], 4, n_dst, 8, 2)
        plan = HeadSlicePlan(align_regions(src, dst, same_size=False), src_heads, dst_heads, layout)
        for bad in (False, True):
            s_ids, d_ids = _ids(rng, bad)
            assert _outcome(plan.descriptors, s_ids, d_ids) == _outcome(_ref_head_slices, plan, s_ids, d_ids)


@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        ([0, 1], [0], r"^sender has 2 block ids but receiver has 1; they pair 1:1$"),
        ([0, 1, 2], [5, 3, 5], r"^receiver block ids repeat \(two writes to one block\): \[5, 3, 5\]$"),
        ([0, 1, 2], [3, 3, 4], r"^receiver block ids repeat \(two writes to one block\): \[3, 3, 4\]$"),
        ([0, 8], [0, 1], r"^sender layer 'layers.0': block id 8 is outside \[0, 8\)$"),
        ([9, 0, 8], [0, 1, 2], r"^sender layer 'layers.0': block id 9 is outside \[0, 8\)$"),  # the first
        ([0, 1], [1, -2], r"^receiver layer 'layers.0': block id -2 is outside \[0, 4\)$"),
        ([0, 1], [3, 4], r"^receiver layer 'layers.0': block id 4 is outside \[0, 4\)$"),
    ],
)
def test_block_id_errors_keep_their_messages(src, dst, match):
    names = [f"layers.{i}" for i in range(2)]
    pairs = align_regions(
        regions_for_kv_cache(0x10000, 8, names, 4, 2, 8, 2),
        regions_for_kv_cache(0x90000, 4, names, 4, 2, 8, 2),
    )
    with pytest.raises(BlockIdError, match=match):
        DescriptorPlan(pairs).descriptors(src, dst)
    with pytest.raises(BlockIdError, match=match):
        _RefPlan(pairs).descriptors(src, dst)


def test_unchecked_ids_past_int64_are_refused():
    """Regions without num_blocks: an id whose address would not fit an int64 row is a
    BlockIdError, not a wrapped-around address; a region past 2**63 is refused at construction."""
    r = Region("a", 0, 1 << 40, 1 << 20, 1 << 20, None)
    plan = DescriptorPlan([(r, r)])
    assert descriptor_list(plan.descriptors([3], [5])) == [
        ((1 << 40) + 3 * (1 << 20), (1 << 40) + 5 * (1 << 20), 1 << 20)
    ]
    with pytest.raises(BlockIdError, match="past 2\\*\\*63"):
        plan.descriptors([1 << 43], [0])
    with pytest.raises(BlockIdError, match="outside int64"):
        plan.descriptors([0], [1 << 70])
    check_block_ids(np.array([0, 3]), None)
    with pytest.raises(ValueError, match="2\\*\\*63"):
        Region("a", 0, 1 << 63, 64, 64, None)
