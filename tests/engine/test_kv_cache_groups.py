"""KV cache groups without a model: the rounding of a prefix hit across groups, declines
counted by reason, and a pinned hit surviving the allocation that follows it."""

from __future__ import annotations

from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.engine.kv_cache_groups import (
    DECLINE_ALIGNMENT,
    DECLINE_GROUP_MISS,
    DECLINE_WINDOW,
    FULL_ATTENTION,
    SLIDING_WINDOW,
    KVCacheCoordinator,
    KVCacheGroupSpec,
    groups_of_model,
)
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams


def _full(bs: int) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(FULL_ATTENTION, ("a",), bs)


def _sliding(bs: int, window: int) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(SLIDING_WINDOW, ("b",), bs, window)


def test_group_geometry_and_stability() -> None:
    c = KVCacheCoordinator([_full(16), _sliding(32, 64)])
    assert c.group_block_sizes == (16, 32) and c.alignment == 32
    assert [m.positionally_stable for m in c.managers] == [True, False]
    assert c.managers[1].first_needed_block(200) == (200 - 64 + 1) // 32  # 4: blocks 0..3 are free to go
    groups = groups_of_model(
        ["l0", "l1", "l2"], ["sliding_attention", "full_attention", "sliding_attention"], 32, 16
    )
    assert [(g.kind, g.layer_names) for g in groups] == [
        (FULL_ATTENTION, ("l1",)),
        (SLIDING_WINDOW, ("l0", "l2")),
    ]
    assert groups_of_model(["l0"], [], None, 16)[0].kind == FULL_ATTENTION


def test_hit_mid_block_in_one_group_rounds_to_the_others_boundary() -> None:
    # Group 0 (bs 16) has 5 cached blocks = 80 tokens, which ends mid-block of group 1 (bs 32:
    # 2.5 blocks). Group 1 holds 3 blocks (96 tokens). The hit is 64 tokens: on both boundaries.
    c = KVCacheCoordinator([_full(16), _full(32)])
    hit = c.longest_hit([[True] * 5, [True] * 3], max_tokens=1000)
    assert hit.num_tokens == 64 and hit.offered_tokens == 96
    assert c.declined_tokens[DECLINE_GROUP_MISS] == 16  # 96 offered by group 1, 80 by group 0
    assert c.declined_tokens[DECLINE_ALIGNMENT] == 16  # 80 -> 64


def test_hit_on_a_boundary_of_both_groups_is_kept_whole() -> None:
    c = KVCacheCoordinator([_full(16), _full(32)])
    hit = c.longest_hit([[True] * 4, [True] * 2], max_tokens=1000)
    assert hit.num_tokens == 64 and sum(c.declined_tokens.values()) == 0


def test_sliding_group_needs_only_its_window() -> None:
    # Window 40 at bs 16: resuming at 96 needs positions [57, 96): blocks 3..5. Blocks 0..2 gone.
    c = KVCacheCoordinator([_full(16), _sliding(16, 40)])
    cached_sliding = [False, False, False, True, True, True]
    assert c.longest_hit([[True] * 6, cached_sliding], max_tokens=1000).num_tokens == 96
    assert sum(c.declined_tokens.values()) == 0
    # Block 4 missing: 96 and 80 cannot resume (their windows need it); 64 needs blocks 1..3,
    # block 1 and 2 are gone too: no usable hit at all. Every offered token is counted.
    hit = c.longest_hit([[True] * 6, [False, False, False, True, False, True]], max_tokens=1000)
    assert hit.num_tokens == 0
    assert c.declined_tokens[DECLINE_WINDOW] == 96


def test_hit_is_capped_to_leave_a_token_to_compute() -> None:
    c = KVCacheCoordinator([_full(16)])
    assert c.longest_hit([[True] * 4], max_tokens=63).num_tokens == 48
    assert c.declined_tokens[DECLINE_ALIGNMENT] == 15


def test_pinned_hit_is_not_evicted_by_the_allocation_that_follows() -> None:
    # 4 blocks. Request A caches 3 blocks and finishes: they are free but cached. B hits them and
    # needs 1 new block + its hit; the allocation must take the one never-cached free block, not
    # a hit block (the hit is touched before anything is allocated).
    kv = KVCacheManager(num_blocks=4, block_size=4)
    sp = SamplingParams(max_tokens=1)
    a = Request("a", list(range(12)), sp)
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    kv.cache_computed_blocks(a)
    kv.free("a")
    b = Request("b", list(range(12)) + [99, 98], sp)
    hits, n = kv.get_computed_blocks(b)
    assert n == 12 and len(hits) == 3
    hashes = hash_prompt_blocks(list(range(12)), 4)
    assert kv.allocate_slots(b, 2, hits, n) is not None
    assert [blk.block_hash for blk in hits] == hashes  # still cached, held by b
    assert all(blk.ref_cnt == 1 for blk in hits)
    kv.free("b")
