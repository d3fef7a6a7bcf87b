"""Each PCP rank's view of one global step, as index maps over its token rows (no torch).

The scheduler makes one ``SchedulerOutput`` for every rank; every rank builds the same global
``HostBatch`` from it (token rows request after request, ``pdserve.models.attention``) and
derives its own view here from the batch's query and sequence lengths only, so nothing depends
on per-rank request state.

Which chunks are split: a chunk of at least ``pcp_size * block_size`` tokens (a prompt chunk)
is split over the ranks; every other chunk (decode rows, speculative rows, short prompts) is
replicated: every rank computes it whole. A prompt shorter than ``pcp_size`` blocks therefore
runs as at pcp 1 on every rank, never refused.

The split is zig-zag: the chunk's positions [s, s + n) are cut into 2N pieces of near-equal
length, and rank r computes pieces r and 2N-1-r::

    positions  s ......................................... s + n
    pieces     | p0 | p1 | p2 | p3 | p4 | p5 | p6 | p7 |          N = 4
    rank       |  0 |  1 |  2 |  3 |  3 |  2 |  1 |  0 |

Causal attention of piece i costs about (prefix + i + 1/2) x piece^2 (its queries times the keys
before them), so every rank's pair costs the same; a contiguous split (rank r: piece-pair r)
leaves rank N-1 about 2N-1 times rank 0's attention (``causal_cost``). Rank 0 holds the
chunk's last token, but sampling never relies on that: ``StepPlan.source_of`` finds any row.

Each of a rank's segments is one attention row of its local batch: query positions
[start, end), sequence length ``end``, the request's block table. Every rank stores the whole
chunk's K/V (its own tokens, then the other ranks' split tokens, exchanged each layer:
``pdserve.pcp.exchange``) before attending, so a segment reads its whole context from the cache.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

REPLICATED = -1  # owner of a token row every rank computes


def is_split_chunk(num_tokens: int, pcp_size: int, block_size: int) -> bool:
    """Whether a chunk of ``num_tokens`` is split over ``pcp_size`` ranks: at least one block's
    worth of tokens per rank (and a token per zig-zag piece); shorter chunks are replicated
    (computed whole on every rank)."""
    return pcp_size > 1 and num_tokens >= pcp_size * max(block_size, 2)


def zigzag_pieces(start: int, num_tokens: int, pcp_size: int) -> list[list[tuple[int, int]]]:
    """Per rank, its [start, end) position ranges of the chunk [start, start + num_tokens):
    pieces r and 2N-1-r of 2N near-equal pieces (the first ``num_tokens % 2N`` one longer);
    rank N-1's two pieces touch and are one range."""
    parts = 2 * pcp_size
    base, extra = divmod(num_tokens, parts)
    bounds = [start]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    out = [
        [(bounds[r], bounds[r + 1]), (bounds[parts - 1 - r], bounds[parts - r])] for r in range(pcp_size - 1)
    ]
    return [*out, [(bounds[pcp_size - 1], bounds[pcp_size + 1])]]


def causal_cost(ranges: Sequence[tuple[int, int]]) -> int:
    """(query, key) pairs of causal attention for the query positions in ``ranges``: position p
    attends to its p + 1 keys (cached context included, positions counted from 0)."""
    return sum((a + b + 1) * (b - a) // 2 for a, b in ranges)


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of one request's positions that one rank computes: one attention row of its view."""

    seq: int  # the chunk's index in the step (its row in the global block table)
    start: int  # first position
    end: int  # one past the last position: the row's sequence length
    first_row: int  # the global token row of position ``start``

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class RankView:
    """One rank's rows of the step. ``token_rows`` is ascending (chunks in batch order, a
    split chunk's segments in position order), so a global row's local index is a bisection."""

    rank: int
    segments: list[Segment] = field(default_factory=list)  # attention rows, in batch order
    token_rows: array = field(default_factory=lambda: array("q"))  # global row of each local token
    # local rows of this rank's split tokens, in the order it sends their K/V every layer
    send_rows: array = field(default_factory=lambda: array("q"))

    @property
    def num_tokens(self) -> int:
        return len(self.token_rows)

    def local_row(self, global_row: int) -> int:
        """The local row of ``global_row``; AssertionError if this rank does not compute it."""
        i = bisect_left(self.token_rows, global_row)
        assert i < len(self.token_rows) and self.token_rows[i] == global_row, (self.rank, global_row)
        return i


@dataclass
class StepPlan:
    """The whole step's partition: every rank's view and who owns each global token row."""

    pcp_size: int
    num_tokens: int  # global token rows of the step
    views: list[RankView]
    owner: array  # 'b' [num_tokens]: the rank computing the row, REPLICATED for every rank
    # per rank: the global rows of its split tokens, ascending (what it sends every layer)
    split_rows: list[array]

    @property
    def is_split(self) -> bool:
        """Whether any chunk is split (else every rank computes the whole step: no exchange)."""
        return any(len(rows) for rows in self.split_rows)

    def source_of(self, global_row: int) -> tuple[int, int]:
        """(rank, local row) whose hidden state is global row ``global_row``: its owner, or rank 0
        for a replicated row. Logits indices of the global batch are mapped through this; no
        rank samples a row from its local numbering."""
        owner = self.owner[global_row]
        rank = 0 if owner == REPLICATED else owner
        return rank, self.views[rank].local_row(global_row)

    def gathered_rows(self, needed: Sequence[int]) -> list[array]:
        """Per rank, the rows among ``needed`` (global, e.g. the sampled rows) that only that rank
        computes, ascending: what each sends in the output gather. Replicated rows are local to
        every rank and cross nothing."""
        out = [array("q") for _ in range(self.pcp_size)]
        for row in sorted(set(needed)):
            owner = self.owner[row]
            if owner != REPLICATED:
                out[owner].append(row)
        return out


def plan_step(query_lens: Sequence[int], seq_lens: Sequence[int], pcp_size: int, block_size: int) -> StepPlan:
    """Every rank's view of a step whose request i computes positions
    [seq_lens[i] - query_lens[i], seq_lens[i]) at token rows after request i - 1's."""
    assert pcp_size >= 1 and len(query_lens) == len(seq_lens)
    views = [RankView(r) for r in range(pcp_size)]
    split_rows = [array("q") for _ in range(pcp_size)]
    num_tokens = sum(query_lens)
    owner = array("b", bytes(num_tokens))
    row = 0
    for seq, (q, end) in enumerate(zip(query_lens, seq_lens, strict=True)):
        start = end - q
        if not is_split_chunk(q, pcp_size, block_size):
            for v in views:
                v.segments.append(Segment(seq, start, end, row))
                v.token_rows.extend(range(row, row + q))
            owner[row : row + q] = array("b", [REPLICATED]) * q
        else:
            for rank, pieces in enumerate(zigzag_pieces(start, q, pcp_size)):
                v = views[rank]
                for a, b in pieces:
                    first = row + a - start
                    v.segments.append(Segment(seq, a, b, first))
                    v.send_rows.extend(range(v.num_tokens, v.num_tokens + b - a))
                    v.token_rows.extend(range(first, first + b - a))
                    split_rows[rank].extend(range(first, first + b - a))
                    owner[first : first + b - a] = array("b", [rank]) * (b - a)
        row += q
    return StepPlan(pcp_size, num_tokens, views, owner, split_rows)
