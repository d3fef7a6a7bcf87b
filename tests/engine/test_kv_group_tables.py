"""A block table per KV cache group, without a model: a sliding-window group frees what its
window no longer sees as decode advances, a prefix hit is pinned to each group's cached blocks,
frees wait for the fence, and the byte budget's split between the groups."""

from __future__ import annotations

from pdserve.engine.kv_cache_groups import (
    DECLINE_WINDOW,
    FULL_ATTENTION,
    SLIDING_WINDOW,
    KVCacheGroupSpec,
)
from pdserve.engine.kv_cache_manager import KVCacheManager, StepFence
from pdserve.engine.kv_group_tables import (
    NULL_BLOCK_ID,
    plan_group_blocks,
    tables_off_reason,
    window_blocks_bound,
)
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams

BS, W = 16, 32
GROUPS = [
    KVCacheGroupSpec(FULL_ATTENTION, ("l1", "l3"), BS),
    KVCacheGroupSpec(SLIDING_WINDOW, ("l0", "l2"), BS, W),
]


def _kv(num_blocks: int = 64, sliding_blocks: int = 32, fence: StepFence | None = None) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, True, fence, GROUPS, (sliding_blocks,))


def _decode_to(kv: KVCacheManager, req: Request, num_tokens: int) -> None:
    """Decode one token at a time until ``num_tokens`` positions are computed."""
    while req.num_computed_tokens < num_tokens:
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        req.output_token_ids.append(7)
        kv.cache_computed_blocks(req)


def test_sliding_group_frees_blocks_its_window_left_behind() -> None:
    kv = _kv()
    req = Request("a", list(range(100)), SamplingParams(max_tokens=200, ignore_eos=True))
    assert kv.allocate_slots(req, 100) is not None  # a fresh prompt: every block of both groups
    assert len(kv.block_ids("a")) == 7 and kv.groups.num_held_blocks("a") == (7,)  # type: ignore[union-attr]
    req.num_computed_tokens = 100
    kv.cache_computed_blocks(req)
    _decode_to(kv, req, 241)
    # The last allocation was for position 240, whose query sees keys 209..240: blocks 13..15.
    # Full attention holds blocks 0..15.
    (sliding,) = kv.group_block_ids_views("a")
    assert len(kv.block_ids("a")) == 16 and kv.groups.num_held_blocks("a") == (3,)  # type: ignore[union-attr]
    assert list(sliding[:13]) == [NULL_BLOCK_ID] * 13 and NULL_BLOCK_ID not in sliding[13:]
    assert kv.groups.num_used_blocks == (3,)  # type: ignore[union-attr]
    kv.free("a")
    assert kv.groups.num_used_blocks == (0,) and kv.pool.num_used_blocks == 0  # type: ignore[union-attr]


def test_prefix_hit_is_pinned_to_the_window_blocks_each_group_cached() -> None:
    kv = _kv()
    sp = SamplingParams(max_tokens=1)
    prompt = list(range(100))
    a = Request("a", prompt, sp)
    kv.allocate_slots(a, 100)
    a.num_computed_tokens = 100
    kv.cache_computed_blocks(a)
    a_sliding = list(kv.group_block_ids_views("a")[0])
    kv.free("a")
    b = Request("b", prompt + [500, 501], sp)
    hits, n = kv.get_computed_blocks(b)
    assert n == 96 and len(hits) == 6  # every full block of the prompt
    assert kv.allocate_slots(b, len(b.prompt_token_ids) - n, hits, n) is not None
    (sliding,) = kv.group_block_ids_views("b")
    # Resuming at 96 needs keys 65..: blocks 4 and 5 are a's; blocks 0..3 are NULL; block 6 new.
    assert list(sliding[:4]) == [NULL_BLOCK_ID] * 4 and list(sliding[4:6]) == a_sliding[4:6]
    assert len(sliding) == 7 and sliding[6] not in a_sliding[4:6]
    kv.free("b")


def test_hit_declined_when_the_sliding_group_lost_its_window_blocks() -> None:
    kv = _kv(sliding_blocks=8)  # a small sliding pool: a's cached window blocks get evicted
    sp = SamplingParams(max_tokens=1)
    a = Request("a", list(range(96)), sp)
    kv.allocate_slots(a, 96)
    a.num_computed_tokens = 96
    kv.cache_computed_blocks(a)
    kv.free("a")
    c = Request("c", list(range(1000, 1100)), sp)  # another prompt takes every sliding block
    kv.allocate_slots(c, 100)
    kv.free("c")
    b = Request("b", list(range(96)) + [7], sp)
    hits, n = kv.get_computed_blocks(b)
    assert n == 0 and hits == []
    assert kv.coordinator.declined_tokens[DECLINE_WINDOW] == 96  # group 0 offered all of it


def test_window_frees_wait_for_the_fence() -> None:
    fence = StepFence()
    kv = _kv(fence=fence)
    req = Request("a", list(range(64)), SamplingParams(max_tokens=100, ignore_eos=True))
    kv.allocate_slots(req, 64)
    req.num_computed_tokens = 64
    kv.mark_written("a", 5)  # a step not yet completed wrote the request's blocks
    kv.cache_computed_blocks(req, 64)
    assert kv.allocate_slots(req, 1) is not None  # position 64: blocks 0 and 1 leave the window
    # Keys from 33 on: blocks 2..4 held (4 is new); 0 and 1 wait for step 5 to complete.
    assert kv.groups.num_held_blocks("a") == (3,) and kv.num_deferred_blocks == 2  # type: ignore[union-attr]
    fence.advance(5)
    assert kv.process_deferred_frees() == 2 and kv.groups.num_used_blocks == (3,)  # type: ignore[union-attr]
    kv.free("a")
    assert kv.groups.num_used_blocks == (0,)  # type: ignore[union-attr]


def test_budget_split_gives_the_window_what_it_can_need() -> None:
    layer = 1000  # bytes of one layer's block
    bound = window_blocks_bound(GROUPS[1], max_num_seqs=4, max_num_batched_tokens=64)
    assert bound == 4 * (2 + 2) + 4 + 1  # 4 requests x (window blocks + 2 partial) + one step + null
    split = plan_group_blocks(GROUPS, 4 * layer * 100, (layer, layer), 4, 64)
    assert split == ((4 * 100 * layer - bound * 2 * layer) // (2 * layer), bound)
    assert split[0] == 179  # 100 blocks each with an equal split; the window needs 21
    # A budget too small for the bound: the sliding group gets an equal split at most.
    assert plan_group_blocks(GROUPS, 4 * layer * 10, (layer, layer), 4, 64) == (10, 10)
    assert tables_off_reason(GROUPS, single_runner=True, kv_offload=False) is None
    assert "kv_offload" in str(tables_off_reason(GROUPS, single_runner=True, kv_offload=True))
    assert tables_off_reason(GROUPS, single_runner=True, kv_offload=False, shared_reason="why") == "why"
