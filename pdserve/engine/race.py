"""The exponential race: argmax(x - log q) per row, q ~ Exp(1), a sample of softmax(x).

``race_drawn`` races rows after their sampling transforms: on the one-pass path
(``pdserve.engine.fused_sampling``) in one launch of ``kernels/triton_sample.py`` with the
counter-based draws (``counter_race``); otherwise q is drawn whole (``draw_``: a generator or
torch's default; ``kernels/triton_seeded_draw.py`` for counter rows on CUDA) and raced in torch
(``race``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve import kernels
from pdserve.engine.fused_sampling import SeedDraw, ToDevice, counter_race_applies


def race_drawn(
    x: torch.Tensor,
    draws: Sequence[SeedDraw],
    put: ToDevice,
    fused: bool,
    generators: Sequence[torch.Generator | None] | None = None,
) -> torch.Tensor:
    """The exponential race of rows ``x`` [S, V] after their sampling transforms (overwritten).
    Row j draws from ``generators[j]`` where set, else from the counter-based stream at
    ``draws[j]`` (seed, k); a row with neither is unseeded. With ``fused`` on the Triton path
    (``counter_race_applies``) the counter rows race in one launch at T = 1, an unseeded row j
    at (step key, j) (``pdserve.engine.fused_sampling``); otherwise q is drawn whole (torch's
    ``exponential_`` for unseeded rows, the seeded draw kernel for counter rows) and raced."""
    num_rows, device = x.shape[0], x.device
    gens = list(generators) if generators is not None else [None] * num_rows
    seeded = [(j, g) for j, g in enumerate(gens) if g is not None]
    if fused and counter_race_applies(x):
        need_key = any(g is None and d is None for g, d in zip(gens, draws, strict=True))
        temps = [0.0 if g is not None else 1.0 for g in gens]
        token_ids = counter_race(x, draws, temps, step_key() if need_key else 0, put)
        if seeded:  # rows with their own generator: drawn one by one, raced together
            idx = put([j for j, _ in seeded], torch.long)
            q = torch.empty((len(seeded), x.shape[1]), dtype=x.dtype, device=device)
            for i, (_, gen) in enumerate(seeded):
                draw_(q[i], gen)
            token_ids[idx] = race(x[idx], q)
        return token_ids
    q = torch.empty_like(x)  # [S, V] ~ Exp(1)
    counted = [
        (j, d) for j, (g, d) in enumerate(zip(gens, draws, strict=True)) if g is None and d is not None
    ]
    if len(seeded) + len(counted) < num_rows:
        draw_(q, None)
    for j, gen in seeded:
        assert gen.device.type == device.type, (gen.device, device)
        draw_(q[j], gen)
    if counted:
        assert device.type == "cuda", "counter-based seeded draws are Exp(1) values: CUDA only"
        from pdserve.kernels.triton_seeded_draw import seeded_exponential_

        table = put([[j, sd[0], sd[1]] for j, sd in counted], torch.long)  # [R, 3]
        seeded_exponential_(q, table[:, 0], table[:, 1], table[:, 2])
    return race(x, q)


def race(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """argmax(x - log q) per row: a sample of softmax(x) from ``q``'s raw draws (``draw_``; on
    the CPU uniform values, turned into Exp(1) here). ``q`` is overwritten."""
    if q.device.type == "cpu":
        q = torch.log1p(q.neg_()).neg_()  # u in [0, 1) -> -log(1 - u) ~ Exp(1), one vectorised pass
    # Exp(1) draws can be exactly 0 (u == 0); keep log finite so a masked -inf stays -inf.
    q.clamp_(min=torch.finfo(torch.float32).tiny)
    return kernels.argmax_rows(x - q.log())


def draw_(q: torch.Tensor, generator: torch.Generator | None) -> None:
    """One step's race draws for ``q``'s rows from ``generator`` (None: torch's default): Exp(1)
    values on a GPU; on the CPU uniform [0, 1) values that ``race`` turns into Exp(1) with
    one vectorised -log(1 - u), because torch's CPU ``exponential_`` is a scalar loop ~6x the
    cost of ``uniform_`` (16 x 4,096 draws: ~1.26 ms against ~0.2; docs/benchmarks.md,
    "The CPU decode step"). A seeded request's stream position is the number of draws, so a node that
    continues another's request (P/D, recompute) skips its earlier draws with this same call
    (``SeededStreams.generator``)."""
    if q.device.type == "cpu":
        q.uniform_(generator=generator)
    else:
        q.exponential_(generator=generator)


def step_key() -> int:
    """A fresh Philox key for one step's unseeded rows, from torch's default (CPU) generator."""
    return int(torch.randint(1 << 62, ()))


def counter_race(
    x: torch.Tensor,
    draws: Sequence[SeedDraw],
    temperatures: Sequence[float],
    key: int,
    put: ToDevice,
) -> torch.Tensor:
    """int64 [R] on ``x``'s device: row r's argmax(x / T - log q) with q the counter-based
    draws ``draws[r]`` ((seed, k), or None for (``key``, r)) and T = ``temperatures[r]``
    (0: the plain argmax, no draws). ``x`` [R, V] (fp32, bf16 or fp16) is not written. One
    table copy, one race launch."""
    from pdserve.kernels.triton_sample import TABLE_COLS, race_rows, race_table_row

    assert len(draws) == len(temperatures) == x.shape[0], (len(draws), len(temperatures), x.shape)
    flat: list[int] = []
    for r, (d, t) in enumerate(zip(draws, temperatures, strict=True)):
        seed, k = d if d is not None else (key, r)
        flat += race_table_row(seed, k, t)
    table = put(flat, torch.long).view(-1, TABLE_COLS)  # a flat list: ~3x cheaper to convert
    return race_rows(x if x.stride(1) == 1 else x.contiguous(), table)
