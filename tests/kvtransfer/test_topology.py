"""Stage topology of a P -> D transfer, and completion counting across PP sizes (docs/design.md §3)."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.errors import ConfigError
from pdserve.kvtransfer.backend import LoopbackBackend
from pdserve.kvtransfer.connector import KVProducer
from pdserve.kvtransfer.regions import Region, RegionMismatchError, align_regions, regions_for_kv_cache
from pdserve.kvtransfer.send_tracker import KVSendTracker
from pdserve.kvtransfer.topology import (
    StageId,
    consumers_of,
    need_send,
    overlaps,
    prefill_ranks_to_ask,
    prefill_stages_to_ask,
    split_layers,
)

GEOM = dict(block_size=4, num_kv_heads=2, head_dim=8, elem_bytes=4)
LAYERS = 4
NAMES = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]


def test_split_even_and_configured_and_errors():
    assert split_layers(4, 1) == [(0, 4)]
    assert split_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert split_layers(5, 2) == [(0, 3), (3, 5)]
    assert split_layers(4, 2, [1, 3]) == [(0, 1), (1, 4)]
    with pytest.raises(ConfigError, match=r"pp=5 .* 4 layers"):
        split_layers(4, 5)
    with pytest.raises(ConfigError, match=r"\[2, 3\]"):
        split_layers(4, 2, [2, 3])


@pytest.mark.parametrize(
    ("p_tp", "p_pp", "d_tp", "d_pp"), list(itertools.product([1, 2, 4], [1, 2, 4], [1, 2, 4], [1, 2, 4]))
)
def test_need_send_matches_the_consumers_a_stage_sees(p_tp, p_pp, d_tp, d_pp):
    n = need_send(p_tp, p_pp, d_tp, d_pp)
    expected = max(1, d_tp // p_tp) * (d_pp if p_pp != d_pp else 1)
    assert n == expected
    # Enumerate the consumers from the decode side (who asks whom) and check every prefill stage
    # and rank is asked by exactly need_send distinct consumers.
    for pp_rank, tp_rank in itertools.product(range(p_pp), range(p_tp)):
        stage = StageId(pp_rank, tp_rank, p_pp, p_tp)
        askers = {
            (d, r)
            for d in range(d_pp)
            for r in range(d_tp)
            if pp_rank in prefill_stages_to_ask(d, p_pp, d_pp)
            and (tp_rank // max(1, p_tp // d_tp) == r if d_tp < p_tp else r // (d_tp // p_tp) == tp_rank)
        }
        # the prefill side's view: the ranks a decode rank asks hold exactly these consumers
        asked_by = {
            (d, r)
            for d in range(d_pp)
            for r in range(d_tp)
            if pp_rank in prefill_stages_to_ask(d, p_pp, d_pp)
            and tp_rank in prefill_ranks_to_ask(r, p_tp, d_tp)
        }
        assert asked_by == askers
        assert consumers_of(stage, d_tp, d_pp) == askers
        assert len(askers) == n


def test_equal_sizes_ask_the_same_index_only():
    assert prefill_stages_to_ask(1, 2, 2) == [1]
    assert prefill_stages_to_ask(1, 4, 2) == [0, 1, 2, 3]


def _regions(base: int, layers: range) -> list[Region]:
    return regions_for_kv_cache(base, 16, [NAMES[i] for i in layers], **GEOM)


def test_alignment_skips_a_layer_the_asking_stage_lacks():
    src = _regions(0x1000, range(0, 2))  # P stage holds layers 0, 1
    dst = _regions(0x9000, range(1, 4))  # D stage holds 1..3
    pairs = align_regions(src, dst)
    assert [(s.layer_name, d.layer_name) for s, d in pairs] == [(NAMES[1], NAMES[1])]
    assert align_regions(_regions(0x1000, range(2, 4)), _regions(0x9000, range(0, 2))) == []


def test_missing_second_occurrence_of_a_held_layer_is_an_error():
    src = regions_for_kv_cache(0x1000, 16, ["a", "b", "a"], **GEOM)
    dst = regions_for_kv_cache(0x9000, 16, ["a", "b"], **GEOM)
    with pytest.raises(RegionMismatchError, match="a"):
        align_regions(src, dst)
    with pytest.raises(RegionMismatchError):
        align_regions(dst, src)


def test_shape_mismatch_is_an_error():
    src = regions_for_kv_cache(0x1000, 16, ["a"], **GEOM)
    dst = regions_for_kv_cache(0x9000, 16, ["a"], **{**GEOM, "head_dim": 16})
    with pytest.raises(RegionMismatchError, match="block_bytes"):
        align_regions(src, dst)


class _Stage:
    """One pipeline stage's KV tensor of its layer slice, registered with its own endpoint."""

    def __init__(self, layers: tuple[int, int]) -> None:
        per_block = 2 * GEOM["block_size"] * GEOM["num_kv_heads"] * GEOM["head_dim"]
        self.cache = torch.zeros(16, layers[1] - layers[0], per_block, dtype=torch.float32)
        self.backend = LoopbackBackend()
        self.backend.register(self.cache.data_ptr(), self.cache.numel() * 4)
        self.layers = layers
        self.regions = regions_for_kv_cache(
            self.cache.data_ptr(), 16, [NAMES[i] for i in range(*layers)], **GEOM
        )


def _p4_d2():
    freed: list[str] = []
    tracker = KVSendTracker(free_fn=lambda tid, _b: freed.append(tid), lease_s=60.0)
    p_stages = [_Stage(r) for r in split_layers(LAYERS, 4)]
    for i, s in enumerate(p_stages):
        s.cache[:] = i + 1.0  # P stage i's KV holds the value i+1
    producers = [
        KVProducer(s.backend, s.regions, 4, lambda _t: None, stage=i, num_stages=4, tracker=tracker)
        for i, s in enumerate(p_stages)
    ]
    d_stages = [_Stage(r) for r in split_layers(LAYERS, 2)]
    n = need_send(1, 4, 1, 2)
    producers[0].on_hold("t", [0, 1], n)
    for prod, st in zip(producers, p_stages, strict=True):
        prod.keep_alive = st  # type: ignore[attr-defined]  # the regions point into st.cache
    return tracker, freed, producers, d_stages


def _pull(producers, d_stages, d: int, p: int) -> int:
    s = d_stages[d]
    res = producers[p].push("t", [3, 4], 8, s.regions, s.backend.session_id, consumer=(d, 0))
    assert res.ok, res.error
    return res.bytes


def test_p4_to_d2_frees_only_after_every_decode_stage_pulled():
    tracker, freed, producers, d_stages = _p4_d2()
    # D stage 0 (layers 0, 1) asks every P stage; P stages 2 and 3 share no layer: 0 bytes.
    moved = [_pull(producers, d_stages, 0, p) for p in range(4)]
    assert moved[0] > 0 and moved[1] > 0 and moved[2:] == [0, 0]
    assert freed == [] and "t" in tracker  # P stages 2, 3 wait for D stage 1
    # A duplicated pull from D stage 0 does not count twice.
    for p in range(4):
        _pull(producers, d_stages, 0, p)
    assert freed == [] and "t" in tracker
    # D stage 1 (layers 2, 3) pulls: from P stages 0, 1 these are no-ops that still count.
    assert [_pull(producers, d_stages, 1, p) for p in range(3)][:2] == [0, 0]
    assert freed == []
    assert _pull(producers, d_stages, 1, 0) == 0  # a retry of a counted consumer: still held
    assert freed == []
    _pull(producers, d_stages, 1, 3)  # P stage 3 reaches its count last
    assert freed == ["t"]  # freed by the counts, with the 60 s lease far off
    assert tracker.expire() == [] and tracker.num_held_blocks == 0
    # The bytes landed where they belong: D stage 0 has P stages 1, 2's values, D stage 1 3, 4's.
    assert d_stages[0].cache[3:5, 0].unique().tolist() == [1.0]
    assert d_stages[0].cache[3:5, 1].unique().tolist() == [2.0]
    assert d_stages[1].cache[3:5, 0].unique().tolist() == [3.0]
    assert d_stages[1].cache[3:5, 1].unique().tolist() == [4.0]
    assert d_stages[1].cache[0:3].unique().tolist() == [0.0]


def test_counting_is_per_stage_and_overlap_helper():
    assert overlaps((0, 2), (1, 3)) and not overlaps((0, 1), (1, 2))
    tracker, freed, producers, d_stages = _p4_d2()
    for d in range(2):  # every D stage pulls from P stages 0..2 only: stage 3 is short
        for p in range(3):
            _pull(producers, d_stages, d, p)
    assert freed == [] and tracker.get("t") is not None
    assert tracker.abort("t") and freed == ["t"]
