"""kvtransfer/block_ids.py (BlockIds: the facts a plan checks) and what a push takes from it:
``DescriptorPlan.descriptors_spans`` (rows and their spans from the ids' extremes) against the
straightforward per-row reference on random layouts, ``layout_key`` as the plans' cache key."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest

from pdserve.kvtransfer import block_ids
from pdserve.kvtransfer.block_ids import BlockIdError, BlockIds, steps_by_one
from pdserve.kvtransfer.connector import KVProducer
from pdserve.kvtransfer.head_slices import HeadLayout, HeadSlicePlan
from pdserve.kvtransfer.regions import (
    DescriptorPlan,
    Region,
    align_regions,
    descriptor_list,
    layout_key,
    regions_for_kv_cache,
)
from tests.kvtransfer.test_regions_plan import _ids, _outcome, _pairs, _RefPlan


def _ref_facts(ids: list[int]) -> tuple[int, int, bool, bool, int | None]:
    """lowest, highest, strictly increasing, one run, an id that repeats (the smallest)."""
    inc = all(b > a for a, b in itertools.pairwise(ids))
    twice = sorted({b for b in ids if ids.count(b) > 1})
    lo, hi = (min(ids), max(ids)) if ids else (0, 0)
    return lo, hi, inc, inc and (not ids or hi - lo == len(ids) - 1), twice[0] if twice else None


def _facts(b: BlockIds) -> tuple[int, int, bool, bool, int | None]:
    return b.lo, b.hi, b.increasing, b.consecutive, b.first_repeat()


def test_block_ids_facts_match_the_reference_on_random_lists():
    rng = random.Random(3)
    kinds = {"run": 0, "increasing": 0, "repeat": 0, "other": 0}
    for _ in range(400):
        k = rng.randint(0, 12)
        kind = rng.choice(list(kinds))
        if kind == "run":
            s0 = rng.randint(-3, 50)
            ids = list(range(s0, s0 + k))
        elif kind == "increasing":
            ids = sorted(rng.sample(range(-5, 60), k))
        elif kind == "repeat":
            ids = [rng.randint(0, 6) for _ in range(k)]
        else:
            ids = rng.sample(range(0, 60), k)
        kinds[kind] += 1
        b = BlockIds.of(rng.choice([ids, tuple(ids), np.array(ids, dtype=np.int64)]))
        assert b.ids.dtype == np.int64 and b.tolist() == ids
        assert _facts(b) == _ref_facts(ids), ids
        assert b.step.tolist() == [y - x for x, y in itertools.pairwise(ids)]
        n = rng.randint(0, k)
        head = b.head(n)  # a push of fewer tokens than held
        assert head.tolist() == ids[:n] and _facts(head) == _ref_facts(ids[:n]), (ids, n)
        assert head.step.tolist() == b.step.tolist()[: max(0, n - 1)]
        assert BlockIds.of(b) is b
    assert BlockIds.of(range(4, 10, 2)).tolist() == [4, 6, 8]
    with pytest.raises(BlockIdError, match="outside int64"):
        BlockIds.of([1 << 70])


def test_steps_by_one_against_its_cache_and_past_it(monkeypatch):
    """Runs told by slices of the cached ids 0..n-1 (grown on demand), and by ints made for
    them where an id lies past the cache's cap or below 0: the same verdict either way."""
    monkeypatch.setattr(block_ids, "_RUN_CACHE_MAX", 5000)
    monkeypatch.setattr(block_ids, "_runs", ([], ()))
    rng = random.Random(11)
    for _ in range(300):
        first, k = (
            rng.choice([rng.randint(-5, 100), rng.randint(4990, 5010), rng.randint(0, 3000)]),
            rng.randint(1, 40),
        )
        ids = list(range(first, first + k))
        if rng.random() < 0.5 and k > 1:
            ids[rng.randrange(1, k)] += rng.choice([-1, 1, 7])
        want = all(b == ids[0] + i for i, b in enumerate(ids))
        assert steps_by_one(ids) is want and steps_by_one(tuple(ids)) is want, ids
        b = BlockIds.of(tuple(ids))
        assert b.tolist() == ids and b.consecutive is want
    assert 4096 <= len(block_ids._runs[0]) <= 5000 and block_ids._runs[1] == tuple(block_ids._runs[0])


def _ref_spans(rows: list[tuple[int, int, int]]) -> tuple[int, int, int, int]:
    return (
        min(s for s, _, _ in rows),
        max(s + n for s, _, n in rows),
        min(d for _, d, _ in rows),
        max(d + n for _, d, n in rows),
    )


def test_descriptors_spans_match_the_reference_rows_and_their_extremes():
    """Random layouts (fused, per-layer, K/V apart, a receiver stage holding some layers), ids
    as lists or as BlockIds (what a producer passes): the rows of the per-block reference, and
    spans equal to the rows' own extremes (what a backend checks against registered memory)."""
    rng = random.Random(99)
    spans_seen = 0
    for _ in range(300):
        pairs = _pairs(rng)
        plan, ref = DescriptorPlan(pairs), _RefPlan(pairs)
        for bad in (False, True):
            src, dst = _ids(rng, bad)
            want = _outcome(ref.descriptors, src, dst)
            src_arg = BlockIds.of(src) if rng.random() < 0.5 else src
            dst_arg = BlockIds.of(dst) if rng.random() < 0.3 else dst
            got = _outcome(plan.descriptors, src_arg, dst_arg)
            assert got == want, (pairs, src, dst)
            if isinstance(want, list):
                table, spans = plan.descriptors_spans(src_arg, dst_arg)
                assert (spans is None) == (not want)
                if want:
                    assert spans == _ref_spans(descriptor_list(table)), (pairs, src, dst)
                    spans_seen += 1
    assert spans_seen > 150


def test_spans_of_groups_with_different_strides():
    """The engine's fused tensor plus a drafter's own tensor (another stride): spans from the
    groups one by one, equal to the rows' extremes."""
    names = [f"layers.{i}" for i in range(3)]
    src = regions_for_kv_cache(0x10_0000, 40, names, 4, 2, 8, 2) + [Region("mtp", 0, 0x50_0000, 256, 256, 40)]
    dst = regions_for_kv_cache(0x90_0000, 40, names, 4, 2, 8, 2) + [Region("mtp", 0, 0xD0_0000, 512, 256, 40)]
    plan = DescriptorPlan(align_regions(src, dst))
    assert plan._one_stride is None
    rng = random.Random(4)
    for _ in range(50):
        k = rng.randint(1, 10)
        s_ids, d_ids = rng.sample(range(40), k), rng.sample(range(40), k)
        table, spans = plan.descriptors_spans(s_ids, d_ids)
        assert spans == _ref_spans(descriptor_list(table))
        assert descriptor_list(table) == descriptor_list(_RefPlan(plan.pairs).descriptors(s_ids, d_ids))


def test_head_slice_plans_take_block_ids():
    layout = HeadLayout(block_size=4, head_dim=8, elem_bytes=2)
    names = [f"layers.{i}" for i in range(3)]
    src = regions_for_kv_cache(0x10_0000, 40, names, 4, 2, 8, 2)
    dst = regions_for_kv_cache(0x90_0000, 40, names, 4, 4, 8, 2)
    plan = HeadSlicePlan(align_regions(src, dst, same_size=False), (0, 2), (0, 4), layout)
    s, d = [3, 4, 9], [7, 1, 2]
    assert descriptor_list(plan.descriptors(BlockIds.of(s), d)) == descriptor_list(plan.descriptors(s, d))


def test_layout_key_caches_a_plan_for_equal_regions_and_not_for_changed_ones():
    names = [f"layers.{i}" for i in range(4)]
    src = regions_for_kv_cache(0x10_0000, 40, names, 4, 2, 8, 2)
    dst = regions_for_kv_cache(0x90_0000, 40, names, 4, 2, 8, 2)
    fresh = [dataclasses.replace(r) for r in dst]  # the same layout, new objects (a new request)
    assert layout_key(fresh) == layout_key(dst) and hash(layout_key(fresh)) == hash(layout_key(dst))
    moved = [dataclasses.replace(dst[0], base_addr=dst[0].base_addr + 4096), *dst[1:]]
    fewer = [dataclasses.replace(dst[0], num_blocks=None), *dst[1:]]
    assert layout_key(moved) != layout_key(dst) and layout_key(fewer) != layout_key(dst)

    prod = KVProducer(backend=None, regions=src, block_size=4, release=lambda t: None)  # type: ignore[arg-type]
    plan = prod._plan(dst, None)
    assert prod._plan(fresh, None) is plan
    other = prod._plan(moved, None)
    assert other is not plan and isinstance(other, DescriptorPlan)
    assert other.groups[0][1] == plan.groups[0][1] + 4096
