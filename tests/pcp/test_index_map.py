"""The PCP index maps: every rank's view of one global step (pdserve/pcp/index_map.py; no torch)."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from pdserve.pcp.index_map import REPLICATED, causal_cost, is_split_chunk, plan_step, zigzag_pieces

BLOCK = 16


@pytest.mark.parametrize("n", [32, 33, 100, 1000, 2047])
@pytest.mark.parametrize("pcp", [2, 3, 4])
def test_zigzag_pieces_cover_the_chunk_once(n: int, pcp: int) -> None:
    start = 40
    pieces = zigzag_pieces(start, n, pcp)
    assert len(pieces) == pcp and [len(p) for p in pieces] == [2] * (pcp - 1) + [1]
    flat = sorted(r for p in pieces for r in p)
    assert flat[0][0] == start and flat[-1][1] == start + n
    assert all(a[1] == b[0] for a, b in pairwise(flat))  # contiguous, no overlap
    per_rank = [sum(b - a for a, b in p) for p in pieces]
    assert max(per_rank) - min(per_rank) <= 2  # 2N pieces of near-equal length, two a rank
    # rank r: pieces r and 2N-1-r of 2N; rank N-1 the middle two as one range; rank 0 the last token
    assert pieces[0][1][1] == start + n
    for r in range(pcp - 1):
        assert pieces[r][0] == flat[r] and pieces[r][1] == flat[2 * (pcp - 1) - r]
    assert pieces[pcp - 1] == [flat[pcp - 1]]


@pytest.mark.parametrize("pcp", [2, 4])
def test_zigzag_balances_causal_attention_where_contiguous_does_not(pcp: int) -> None:
    prefix, n = 512, 4096  # a chunk after 512 cached positions
    zig = [causal_cost(p) for p in zigzag_pieces(prefix, n, pcp)]
    assert max(zig) / min(zig) < 1.01
    step = n // pcp
    contiguous = [causal_cost([(prefix + r * step, prefix + (r + 1) * step)]) for r in range(pcp)]
    assert max(contiguous) / min(contiguous) > 1.5  # rank N-1 attends over far more keys


def test_split_threshold_is_one_block_per_rank() -> None:
    assert not is_split_chunk(10_000, 1, BLOCK)
    assert not is_split_chunk(2 * BLOCK - 1, 2, BLOCK)
    assert is_split_chunk(2 * BLOCK, 2, BLOCK)
    assert not is_split_chunk(4 * BLOCK - 1, 4, BLOCK)


def test_plan_of_a_mixed_step() -> None:
    """Rows: a decode (1 token at position 99), a split prompt chunk of 64 tokens after 32
    cached positions, a short prompt (20 tokens: replicated), another decode."""
    query_lens = [1, 64, 20, 1]
    seq_lens = [100, 96, 20, 7]
    plan = plan_step(query_lens, seq_lens, 2, BLOCK)
    assert plan.is_split and plan.num_tokens == 86
    # global rows: decode 0 | chunk 1..64 | short 65..84 | decode 85
    assert [plan.owner[r] for r in (0, 65, 84, 85)] == [REPLICATED] * 4
    # chunk positions 32..96 in 4 pieces of 16: rank 0 [32,48)+[80,96), rank 1 [48,64)+[64,80)
    v0, v1 = plan.views
    assert [(s.seq, s.start, s.end, s.first_row) for s in v0.segments] == [
        (0, 99, 100, 0),
        (1, 32, 48, 1),
        (1, 80, 96, 49),
        (2, 0, 20, 65),
        (3, 6, 7, 85),
    ]
    # rank 1's pieces [48, 64) and [64, 80) touch: one segment
    assert [(s.seq, s.start, s.end) for s in v1.segments] == [
        (0, 99, 100),
        (1, 48, 80),
        (2, 0, 20),
        (3, 6, 7),
    ]
    assert list(v0.token_rows) == [0, *range(1, 17), *range(49, 65), *range(65, 86)]
    assert list(v1.token_rows) == [0, *range(17, 49), *range(65, 86)]
    # what each rank sends every layer: its split tokens, as local rows and as global rows
    assert list(v0.send_rows) == list(range(1, 33))
    assert list(plan.split_rows[0]) == [*range(1, 17), *range(49, 65)]
    assert list(v1.send_rows) == list(range(1, 33))
    assert list(plan.split_rows[1]) == list(range(17, 49))
    for rank, view in enumerate(plan.views):
        assert [view.token_rows[i] for i in view.send_rows] == list(plan.split_rows[rank])
    # every global row is computed by its owner or, replicated, by every rank
    for row in range(plan.num_tokens):
        ranks = [v.rank for v in plan.views if row in v.token_rows]
        assert ranks == ([0, 1] if plan.owner[row] == REPLICATED else [plan.owner[row]])


def test_logits_indices_come_from_the_global_batch() -> None:
    """The sampled rows of the global batch (each chunk's last token) map to the rank and local
    row that computed them: replicated rows to rank 0, a split chunk's last token to its owner.
    No rank samples its own local numbering: the local rows differ from the global ones."""
    query_lens, seq_lens = [1, 64, 20, 1], [100, 96, 20, 7]
    plan = plan_step(query_lens, seq_lens, 2, BLOCK)
    sample_idx = [0, 64, 84, 85]  # the global rows HostBatch.sample_idx holds
    sources = [plan.source_of(r) for r in sample_idx]
    assert sources == [(0, 0), (0, 32), (0, 52), (0, 53)]
    assert [plan.views[r].token_rows[i] for r, i in sources] == sample_idx
    # only split-owned rows cross ranks in the output gather
    assert [list(rows) for rows in plan.gathered_rows(sample_idx)] == [[64], []]
    assert [list(rows) for rows in plan.gathered_rows([10, 30, 64, 84])] == [[10, 64], [30]]
    assert plan.source_of(30) == (1, 14)


@pytest.mark.parametrize("pcp", [2, 3, 4])
def test_plan_invariants_over_random_steps(pcp: int) -> None:
    import random

    rng = random.Random(pcp)
    for _ in range(50):
        rows = rng.randrange(1, 6)
        query_lens = [rng.choice([1, 1, 5, 40, 130, 700]) for _ in range(rows)]
        seq_lens = [q + rng.randrange(0, 300) for q in query_lens]
        plan = plan_step(query_lens, seq_lens, pcp, BLOCK)
        covered = sorted(r for v in plan.views for r in v.token_rows if plan.owner[r] != REPLICATED)
        split = sorted(r for rows_ in plan.split_rows for r in rows_)
        assert covered == split and len(set(split)) == len(split)
        for v in plan.views:
            assert list(v.token_rows) == sorted(v.token_rows)
            assert sum(s.num_tokens for s in v.segments) == v.num_tokens
            for s in v.segments:  # each segment ends at or before its request's sequence length
                assert seq_lens[s.seq] - query_lens[s.seq] <= s.start < s.end <= seq_lens[s.seq]
        assert plan.is_split == any(is_split_chunk(q, pcp, BLOCK) for q in query_lens)


def test_a_single_rank_plan_is_the_global_batch() -> None:
    plan = plan_step([1, 300], [50, 300], 1, BLOCK)
    assert not plan.is_split
    assert list(plan.views[0].token_rows) == list(range(301))
    assert [(s.start, s.end) for s in plan.views[0].segments] == [(49, 50), (0, 300)]


@pytest.mark.parametrize("seed", range(4))
def test_mtp_rows_read_hidden_states_their_rank_holds(seed: int) -> None:
    """After a step, an MTP module's rows (spec_decode/mtp_drafter.after_step) are the step's
    chunks fed their next tokens: a prompt chunk keeps its length, a verified chunk of 1 + m rows
    keeps the a + 1 positions it verified, a decode row its one, and a decode row may be left out
    (drafting off). Split by ``plan_step`` as the module's own batch, every row a rank computes
    reads a hidden state that rank holds after the target's split step: its own rows, and the
    sampled rows, which the output gather brings to every rank (small blocks here, so verified
    chunks of up to 17 rows are split in the target's step too)."""
    rng = random.Random(seed)
    for _ in range(50):
        pcp, block = rng.choice([2, 3, 4]), rng.choice([1, 2, 4, 16])
        q_lens: list[int] = []
        ends: list[int] = []
        sampled: list[int] = []
        mtp: list[tuple[int, int, int]] = []  # (first target row, rows, end) of each module row
        row = 0
        for _ in range(rng.randrange(1, 6)):
            kind = rng.choice(["prompt", "prompt_end", "verify", "decode", "skipped"])
            start = rng.randrange(0, 300)
            q = rng.randrange(1, 400) if kind.startswith("prompt") else 1
            if kind == "verify":
                q = 1 + rng.randrange(1, 17)
            q_lens.append(q)
            ends.append(start + q)
            if kind != "prompt":  # every chunk but a middle prompt chunk samples its last row
                sampled.extend(range(row + q - 1 if kind != "verify" else row, row + q))
            fed = rng.randrange(1, q + 1) if kind == "verify" else q
            if kind != "skipped":
                mtp.append((row, fed, start + fed))
            row += q
        target = plan_step(q_lens, ends, pcp, block)
        index = [r for first, n, _ in mtp for r in range(first, first + n)]
        module = plan_step([n for _, n, _ in mtp], [e for _, _, e in mtp], pcp, block)
        for rank in range(pcp):
            held = set(target.views[rank].token_rows) | set(sampled)
            assert all(index[r] in held for r in module.views[rank].token_rows), (pcp, block, q_lens)
