"""Head-slice descriptors between TP ranks of different sizes, applied to real tensors."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pdserve.errors import ConfigError
from pdserve.kvtransfer.backend import LoopbackBackend
from pdserve.kvtransfer.connector import KVProducer
from pdserve.kvtransfer.head_slices import GatherPlan, HeadLayout, HeadSlicePlan
from pdserve.kvtransfer.regions import (
    DescriptorPlan,
    RegionMismatchError,
    align_regions,
    regions_for_kv_cache,
)
from pdserve.kvtransfer.staging import Stager
from pdserve.kvtransfer.topology import check_tp_pair, kv_head_range, prefill_ranks_to_ask

NB, LAYERS, BS, HKV, HD = 8, 3, 4, 4, 8
NAMES = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]


def _regions(cache: torch.Tensor):
    return regions_for_kv_cache(cache.data_ptr(), NB, NAMES, BS, cache.shape[-2], HD, cache.element_size())


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (4, 1), (1, 4)])
def test_each_decode_rank_gets_exactly_its_heads(p_tp, d_tp):
    """Every decode rank's blocks equal the model-wide KV's slice of its heads after the asked
    prefill ranks' descriptors ran; nothing else of its cache is touched."""
    torch.manual_seed(0)
    full = torch.randn(NB, LAYERS, 2, BS, HKV, HD)
    p_caches = [full[..., slice(*kv_head_range(r, p_tp, HKV)), :].contiguous() for r in range(p_tp)]
    d_caches = [torch.zeros(NB, LAYERS, 2, BS, HKV // d_tp, HD) for _ in range(d_tp)]
    src_ids, dst_ids = [1, 2, 5], [6, 0, 3]
    layout = HeadLayout(BS, HD, 4)
    for d in range(d_tp):
        d_heads = kv_head_range(d, d_tp, HKV)
        for p in prefill_ranks_to_ask(d, p_tp, d_tp):
            p_heads = kv_head_range(p, p_tp, HKV)
            src, dst = _regions(p_caches[p]), _regions(d_caches[d])
            if p_heads == d_heads:
                plan: DescriptorPlan | HeadSlicePlan = DescriptorPlan(align_regions(src, dst))
            else:
                plan = HeadSlicePlan(align_regions(src, dst, same_size=False), p_heads, d_heads, layout)
                assert plan.descriptors_per_block == 2 * BS * LAYERS
            for s, t, n in plan.descriptors(src_ids, dst_ids).tolist():
                ctypes.memmove(t, s, n)
    for d in range(d_tp):
        heads = slice(*kv_head_range(d, d_tp, HKV))
        assert torch.equal(d_caches[d][dst_ids], full[src_ids][..., heads, :])
        untouched = [b for b in range(NB) if b not in dst_ids]
        assert not d_caches[d][untouched].any()


def test_descriptor_counts_and_merging():
    """2 -> 1: one run per token row of K and V per layer and block (rows of the sender are
    contiguous, the receiver's are not); equal heads: whole blocks, fused across layers."""
    p = torch.zeros(NB, LAYERS, 2, BS, 2, HD)
    d = torch.zeros(NB, LAYERS, 2, BS, 4, HD)
    plan = HeadSlicePlan(
        align_regions(_regions(p), _regions(d), same_size=False), (2, 4), (0, 4), HeadLayout(BS, HD, 4)
    )
    assert len(plan.descriptors([0, 1], [0, 1])) == 2 * 2 * BS * LAYERS
    same = DescriptorPlan(align_regions(_regions(p), _regions(torch.zeros_like(p))))
    assert len(same.descriptors([0, 1], [0, 1])) == 1


def test_sizes_are_checked():
    p = torch.zeros(NB, LAYERS, 2, BS, 2, HD)
    with pytest.raises(RegionMismatchError, match="block_bytes"):
        HeadSlicePlan(
            align_regions(_regions(p), _regions(p), same_size=False), (0, 2), (0, 4), HeadLayout(BS, HD, 4)
        )
    with pytest.raises(RegionMismatchError):
        align_regions(_regions(p), _regions(torch.zeros(NB, LAYERS, 2, BS, 4, HD)))
    with pytest.raises(ConfigError, match="tp=2 and decode tp=3"):
        check_tp_pair(2, 3)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (2, 2), (1, 4), (4, 2)])
@pytest.mark.parametrize("d_layers", [(0, LAYERS), (1, 3)])  # a decode stage of layers 1, 2
def test_producers_push_each_decode_rank_its_heads(p_tp, d_tp, d_layers):
    """KVProducer.push per (prefill rank, decode rank) pair the topology asks, through a
    loopback engine: with more heads on the sender it packs them (GatherPlan + Stager, few
    descriptors), with fewer it writes one run per row (HeadSlicePlan); a decode stage holding
    only some layers gets exactly those."""
    torch.manual_seed(1)
    full = torch.randn(NB, LAYERS, 2, BS, HKV, HD)
    names = NAMES[slice(*d_layers)]
    layout = HeadLayout(BS, HD, 4)
    producers = []
    for r in range(p_tp):
        cache = full[..., slice(*kv_head_range(r, p_tp, HKV)), :].contiguous()
        be = LoopbackBackend()
        be.register(cache.data_ptr(), cache.numel() * 4)
        stager = Stager(be, cache)
        heads = kv_head_range(r, p_tp, HKV)
        prod = KVProducer(
            be, _regions(cache), BS, lambda t: None, heads=heads, layout=layout, gatherer=stager
        )
        prod.on_hold("t", [1, 2, 5], need_send=100)
        producers.append((prod, cache, be, stager))
    d_caches = []
    for d in range(d_tp):
        cache = torch.zeros(NB, len(names), 2, BS, HKV // d_tp, HD)
        be = LoopbackBackend()
        be.register(cache.data_ptr(), cache.numel() * 4)
        regions = regions_for_kv_cache(cache.data_ptr(), NB, names, BS, HKV // d_tp, HD, 4)
        d_heads = kv_head_range(d, d_tp, HKV)
        for p in prefill_ranks_to_ask(d, p_tp, d_tp):
            prod = producers[p][0]
            res = prod.push(
                "t", [6, 0, 3], 3 * BS, regions, be.session_id, (0, d), None if p_tp == d_tp else d_heads
            )
            assert res.ok, res.error
            plan = prod._plan(regions, None if p_tp == d_tp else d_heads)
            if p_tp < d_tp:
                assert isinstance(plan, GatherPlan)
                assert res.num_descriptors <= 3  # runs of destination blocks: 6 | 0 | 3
            elif p_tp > d_tp:
                assert isinstance(plan, HeadSlicePlan)
                assert res.num_descriptors == 3 * len(names) * 2 * BS
        d_caches.append((cache, be))
    for d, (cache, be) in enumerate(d_caches):
        want = full[[1, 2, 5]][:, slice(*d_layers)][..., slice(*kv_head_range(d, d_tp, HKV)), :]
        assert torch.equal(cache[[6, 0, 3]], want)
        be.close()
    for _, _, be, stager in producers:
        stager.close()
        be.close()
