from __future__ import annotations

import pytest

from pdserve.kvtransfer.regions import (
    BlockIdError,
    Region,
    RegionMismatchError,
    align_regions,
    build_descriptors,
    check_block_ids,
    regions_for_kv_cache,
    split_batches,
)

NAMES = [f"layers.{i}" for i in range(4)]
# block_size 4, 2 kv heads, head_dim 8, 2-byte elements -> 256 bytes per layer per block
GEOM = dict(block_size=4, num_kv_heads=2, head_dim=8, elem_bytes=2)
LAYER_BYTES = 2 * 4 * 2 * 8 * 2


def kv(base: int, names: list[str], num_blocks: int = 32) -> list[Region]:
    return regions_for_kv_cache(base, num_blocks, names, **GEOM)


def test_layout_matches_tensor_formula():
    r = kv(1000, NAMES)
    assert [x.base_addr for x in r] == [1000 + i * LAYER_BYTES for i in range(4)]
    assert {x.block_stride_bytes for x in r} == {4 * LAYER_BYTES}
    assert r[2].block_addr(5) == 1000 + 2 * LAYER_BYTES + 5 * 4 * LAYER_BYTES


def test_region_wire_roundtrip():
    r = kv(4096, NAMES)[1]
    assert Region.from_dict(r.to_dict()) == r


def test_repeated_name_gets_occurrences():
    r = kv(0x1000, ["a", "b", "a"])
    assert [x.key for x in r] == [("a", 0), ("b", 0), ("a", 1)]


def test_align_by_name_not_position():
    src = kv(0x10000, NAMES)
    dst = list(reversed(kv(0x90000, NAMES)))
    pairs = align_regions(src, dst)
    assert [(s.layer_name, d.layer_name) for s, d in pairs] == [(n, n) for n in NAMES]
    assert all(s.key == d.key for s, d in pairs)


def test_align_skips_layers_dst_does_not_hold():
    src = kv(0x10000, NAMES)  # P stage holds layers 0..3
    dst = kv(0x90000, NAMES[2:])  # D stage holds only 2..3
    assert [s.layer_name for s, _ in align_regions(src, dst)] == NAMES[2:]
    assert align_regions(src, kv(0x90000, ["other"])) == []


def test_missing_occurrence_raises():
    src = kv(0x10000, ["a", "a"])
    dst = kv(0x90000, ["a"])
    with pytest.raises(RegionMismatchError, match=r"'a' occurrence 1"):
        align_regions(src, dst)
    with pytest.raises(RegionMismatchError, match=r"'a' occurrence 1"):
        align_regions(dst, src)  # receiver expects an occurrence the sender lacks


def test_block_bytes_mismatch_names_both_values():
    src = kv(0x10000, NAMES)
    dst = regions_for_kv_cache(0x90000, 32, NAMES, block_size=8, num_kv_heads=2, head_dim=8, elem_bytes=2)
    with pytest.raises(RegionMismatchError) as ei:
        align_regions(src, dst)
    msg = str(ei.value)
    assert "layers.0" in msg and "block_bytes" in msg and "256" in msg and "512" in msg


def test_consecutive_runs_merge_to_one_descriptor():
    src, dst = kv(0x10000, NAMES), kv(0x90000, NAMES)
    descs = build_descriptors(align_regions(src, dst), [3, 4, 5, 6], [10, 11, 12, 13])
    assert descs == [(0x10000 + 3 * 4 * LAYER_BYTES, 0x90000 + 10 * 4 * LAYER_BYTES, 4 * 4 * LAYER_BYTES)]


def test_gap_splits_runs():
    src, dst = kv(0x10000, NAMES), kv(0x90000, NAMES)
    pairs = align_regions(src, dst)
    assert len(build_descriptors(pairs, [3, 4, 6, 7], [10, 11, 12, 13])) == 2  # gap on src
    assert len(build_descriptors(pairs, [3, 4, 5, 6], [10, 11, 20, 21])) == 2  # gap on dst
    assert len(build_descriptors(pairs, [0, 2, 4], [0, 2, 4])) == 3


def test_different_layer_subsets():
    # P stage holds 4 layers, D stage holds layers 1..2 (in its own 2-layer tensor).
    src, dst = kv(0x10000, NAMES), kv(0x90000, NAMES[1:3])
    descs = build_descriptors(align_regions(src, dst), [0, 1], [5, 6])
    # per block: layers 1..2 are adjacent on both sides -> one range of 2 layers per block;
    # blocks do not chain (src stride 4 layers, dst stride 2 layers)
    assert descs == [
        (0x10000 + 0 * 4 * LAYER_BYTES + LAYER_BYTES, 0x90000 + 5 * 2 * LAYER_BYTES, 2 * LAYER_BYTES),
        (0x10000 + 1 * 4 * LAYER_BYTES + LAYER_BYTES, 0x90000 + 6 * 2 * LAYER_BYTES, 2 * LAYER_BYTES),
    ]
    # reordered layer subsets on D break adjacency: one descriptor per (block, layer)
    dst_swapped = kv(0x90000, [NAMES[2], NAMES[1]])
    assert len(build_descriptors(align_regions(src, dst_swapped), [0, 1], [5, 6])) == 4


def test_descriptor_bytes_cover_every_layer_block_once():
    src, dst = kv(0x10000, NAMES), kv(0x90000, NAMES[::-1])
    descs = build_descriptors(align_regions(src, dst), [1, 2, 9], [4, 3, 0])
    assert sum(n for _, _, n in descs) == 3 * 4 * LAYER_BYTES


def test_split_batches_at_2048():
    descs = [(i, i, 1) for i in range(2049)]
    batches = split_batches(descs)
    assert [len(b) for b in batches] == [2048, 1]
    assert [len(b) for b in split_batches(descs[:2048])] == [2048]
    assert split_batches([]) == []


def test_bounds():
    check_block_ids([0, 31], 32)
    with pytest.raises(BlockIdError, match="32"):
        check_block_ids([0, 32], 32)
    with pytest.raises(BlockIdError, match="-1"):
        check_block_ids([-1], None)
    pairs = align_regions(kv(0x10000, NAMES, num_blocks=8), kv(0x90000, NAMES, num_blocks=4))
    with pytest.raises(BlockIdError, match="receiver"):
        build_descriptors(pairs, [0, 1], [3, 4])
    with pytest.raises(BlockIdError, match="sender"):
        build_descriptors(pairs, [8], [0])
    with pytest.raises(BlockIdError, match="pair"):
        build_descriptors(pairs, [0, 1], [0])
    with pytest.raises(BlockIdError, match="repeat"):
        build_descriptors(pairs, [0, 1], [2, 2])
