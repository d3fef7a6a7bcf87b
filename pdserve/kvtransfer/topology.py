"""Who asks whom, and how many pulls a prefill stage waits for (docs/design.md §3).

One place computes the stage topology of a prefill -> decode transfer, so the router (which
tells the prefill node ``need_send``), the prefill stages (which count reports) and the decode
stages (which pick the prefill stages to ask) cannot disagree:

    P pp=4: [0,1) [1,2) [2,3) [3,4)        D pp=2: [0,2) [2,4)
    sizes differ -> every D stage asks every P stage; P stage 2 shares no layer with D stage 0,
    so that pull moves no bytes, but it still counts: P stage 2 frees at 2 x (D tp) reports.

Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.errors import ConfigError


@dataclass(frozen=True)
class StageId:
    """One consumer or producer of KV: a pipeline stage's TP rank, and the node's sizes."""

    pp_rank: int = 0
    tp_rank: int = 0
    pp_size: int = 1
    tp_size: int = 1

    def __post_init__(self) -> None:
        assert 0 <= self.pp_rank < self.pp_size and 0 <= self.tp_rank < self.tp_size, self


def split_layers(
    num_layers: int, pp: int, split: list[int] | tuple[int, ...] | None = None
) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges of ``pp`` stages.

    ``split`` (layers per stage) overrides the even split; by default the first
    ``num_layers % pp`` stages get one layer more. Raises ConfigError naming the values when the
    model cannot be split so (more stages than layers, a split that does not add up).
    """
    if pp < 1:
        raise ConfigError(f"pp must be >= 1, got {pp}")
    if pp > num_layers:
        raise ConfigError(
            f"pp={pp} is more pipeline stages than the model's {num_layers} layers; use pp <= {num_layers}"
        )
    if split is not None:
        sizes = list(split)
        if len(sizes) != pp or any(s < 1 for s in sizes) or sum(sizes) != num_layers:
            raise ConfigError(
                f"pp_layer_split {sizes} must be {pp} positive layer counts adding up to the "
                f"model's {num_layers} layers"
            )
    else:
        base, extra = divmod(num_layers, pp)
        sizes = [base + (1 if i < extra else 0) for i in range(pp)]
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def prefill_stages_to_ask(d_pp_rank: int, p_pp: int, d_pp: int) -> list[int]:
    """The prefill stages decode stage ``d_pp_rank`` pulls from: the same index when the sizes
    are equal, every stage when they differ (a stage that shares no layer answers with 0 bytes)."""
    assert 0 <= d_pp_rank < d_pp, (d_pp_rank, d_pp)
    if p_pp == d_pp:
        return [d_pp_rank]
    return list(range(p_pp))


def prefill_ranks_to_ask(d_tp_rank: int, p_tp: int, d_tp: int) -> list[int]:
    """The prefill TP ranks holding the KV heads of decode TP rank ``d_tp_rank`` (the inverse of
    ``consumers_of``): one rank when decode has as many ranks or more (``d_tp_rank // (d_tp /
    p_tp)``), ``p_tp / d_tp`` consecutive ranks when it has fewer."""
    check_tp_pair(p_tp, d_tp)
    assert 0 <= d_tp_rank < d_tp, (d_tp_rank, d_tp)
    if d_tp >= p_tp:
        return [d_tp_rank // (d_tp // p_tp)]
    k = p_tp // d_tp
    return list(range(d_tp_rank * k, (d_tp_rank + 1) * k))


def check_tp_pair(p_tp: int, d_tp: int) -> None:
    """ConfigError unless one TP size divides the other (each rank's heads then map to whole
    ranks of the other side)."""
    if p_tp < 1 or d_tp < 1 or (max(p_tp, d_tp) % min(p_tp, d_tp)):
        raise ConfigError(
            f"prefill tp={p_tp} and decode tp={d_tp}: one TP size must divide the other "
            "(1, 2, 4, 8 pair with each other)"
        )


def kv_head_range(tp_rank: int, tp_size: int, num_kv_heads: int) -> tuple[int, int]:
    """The ``[start, end)`` KV heads TP rank ``tp_rank`` of ``tp_size`` holds."""
    assert 0 <= tp_rank < tp_size and num_kv_heads % tp_size == 0, (tp_rank, tp_size, num_kv_heads)
    per = num_kv_heads // tp_size
    return (tp_rank * per, (tp_rank + 1) * per)


def need_send(p_tp: int, p_pp: int, d_tp: int, d_pp: int) -> int:
    """Completed pulls one prefill stage (one of its TP ranks) waits for before it frees a request.

    ``(decode TP ranks one prefill TP rank serves) x (decode PP size, when the PP sizes differ)``.
    A prefill TP rank serves ``max(1, d_tp // p_tp)`` decode TP ranks (D with more ranks splits
    each P rank's heads further; D with fewer ranks reads each P rank once).
    """
    for name, v in (("p_tp", p_tp), ("p_pp", p_pp), ("d_tp", d_tp), ("d_pp", d_pp)):
        if v < 1:
            raise ConfigError(f"{name} must be >= 1, got {v}")
    tp_served = max(1, d_tp // p_tp)
    return tp_served * (d_pp if p_pp != d_pp else 1)


def consumers_of(p_stage: StageId, d_tp: int, d_pp: int) -> set[tuple[int, int]]:
    """The (decode pp_rank, decode tp_rank) consumers whose reports one prefill stage counts; its
    size equals ``need_send`` (checked in the tests)."""
    p_pp, p_tp = p_stage.pp_size, p_stage.tp_size
    d_stages = [d for d in range(d_pp) if p_stage.pp_rank in prefill_stages_to_ask(d, p_pp, d_pp)]
    if d_tp >= p_tp:
        per = d_tp // p_tp
        ranks = list(range(p_stage.tp_rank * per, (p_stage.tp_rank + 1) * per))
    else:  # fewer D ranks: D rank r reads P ranks r*k .. r*k+k-1
        ranks = [p_stage.tp_rank // (p_tp // d_tp)]
    return {(d, r) for d in d_stages for r in ranks}
