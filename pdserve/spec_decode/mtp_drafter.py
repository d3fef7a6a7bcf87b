"""``method: mtp``: the target checkpoint's MTP module (pdserve/models/mtp.py) drafts k tokens.

The module's KV at position i is computed from (h_i, t_{i+1}): the target's hidden state there
and the next token. Both exist only once the target has computed position i and the token after
it is known, so the module's KV is written after each target step (``after_step``), over the
step's verified positions:

    chunk of a prompt / a decode row   positions s .. s+n-1, next tokens t_{s+1} .. t_{s+n}
                                       (the last is the sampled token when the chunk samples)
    verified row (p, a accepted)       positions p .. p+a, next tokens = the a + 1 emitted

The last of those rows (position N-2 once the tokens are appended) gives d_1 and g_1 (the module's
own output, its "hidden state" for the next draft). ``draft`` then runs m - 1 one-row forwards,
(g_{j-1}, d_{j-1}) at position N-3+j -> d_j, g_j, into the slots the scheduler allocated for
this step (positions p .. p+m-2 with p = N-1).

Through prefill -> decode: the prefill node runs ``after_step`` over the prompt, so its MTP KV
holds positions 0 .. P-1 (the last from the sampled first token), and the transfer moves that KV
as one more layer (``model.layers.{L}.self_attn``, its own region, matched by name like the
target's layers). The decode node's first step then computes position P itself and drafts from
its second step on; no hidden state crosses the hop. Both sides must run the same MTP module
(the handshake refuses a mismatch: kvtransfer/speculative_compat.py).

While ``disable_by_batch_size`` keeps drafts off, decode rows are skipped (prompts are not: a
prefill node's transfer needs their KV); once drafts are on again a row's state restarts at its
chunk, the module's KV of the skipped positions left as it is (stale).

Under prefill context parallelism (``pcp: N``, pdserve/pcp) every rank runs ``after_step``: rank 0
first sends the step's tokens to the worker ranks (``after_step_peers``), and the module's rows
are split over the ranks as the target's step was (the same lengths, so the same zig-zag
pieces): each rank computes the rows whose h_i it holds, the next tokens coming from the global
batch, and the module's K/V go through the same per-layer all-gather as the target's
(``AttentionMetadata.kv_exchange``), so every rank ends with the module's whole KV. Its output
rows that draft are gathered in global row order (the chunk's last position is rank 0's anyway).
``draft`` runs on rank 0 only (its one-token rows read rank 0's whole KV); the drafts reach the
other ranks in the step that verifies them.

A request's first chunk may start past 0 (a prefix-cache hit, remote KV): the module's KV of those
positions is taken as it is in the blocks (written by the request that filled them; after a
prefix hit the KV of a block's last position was computed with that request's next token, which
may differ). That changes which drafts are proposed, never which tokens are emitted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine.request import Request
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pdserve.models.attention import AttentionMetadata
from pdserve.models.mtp import load_mtp
from pdserve.spec_decode.drafter import Drafter, DraftRow, set_drafts

if TYPE_CHECKING:
    from pdserve.engine.model_runner import ModelRunner


@dataclass
class MTPState:
    num_computed: int  # leading positions whose MTP KV is written
    first_draft: int | None = None  # d_1 for the request's next step
    hidden: torch.Tensor | None = None  # [H] g_1: the module's output that drafted d_1


class MTPDrafter(Drafter):
    def __init__(self, runner: ModelRunner) -> None:
        self.module = load_mtp(runner.config.model, runner.model)
        a = runner.arch
        super().__init__(runner, 1, a.num_attention_heads, a.num_key_value_heads, a.head_dim)
        self.transfer_layer_names = (f"model.layers.{a.num_hidden_layers}.self_attn",)
        self.states: dict[str, MTPState] = {}
        self._hidden: torch.Tensor | None = None  # the last launched step's, until after_step

    def keep_hidden(self, hidden: torch.Tensor) -> None:
        self._hidden = hidden

    def can_draft(self, req: Request) -> bool:
        st = self.states.get(req.request_id)
        return st is not None and st.first_draft is not None and st.num_computed == req.num_tokens - 1

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)

    @torch.inference_mode()
    def _forward(
        self, rows: list[DraftRow], prev: torch.Tensor, hidden_rows: list[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """(g of each request's last row [R, H], the greedy token there). ``hidden_rows``: the
        target step's row of each of ``prev``'s (after_step); under prefill context parallelism
        the rows are then split over the ranks as the target's were (``ContextParallel.run_split``:
        a rank computes the rows whose h_i it holds, the module's K/V all-gathered)."""
        input_ids, positions, meta, last, batch = self.inputs(rows)
        cache = self.layer_caches[0]
        pcp = self.runner.pcp
        if pcp is None or hidden_rows is None:
            g = self.module(input_ids, prev, positions, cache, meta)[last]
            return g, self.argmax(self.module.compute_logits(g))

        def run(local: torch.Tensor | None, m: AttentionMetadata) -> torch.Tensor:
            if local is None:
                return self.module(input_ids, prev, positions, cache, m)
            return self.module(input_ids[local], prev[local], positions[local], cache, m)

        out, plan = pcp.run_split(batch, meta, self.block_size, run, batch.sample_idx, 1)
        if plan.is_split and pcp.hidden_rows is not None:  # each local row's h_i is on this rank
            held = pcp.hidden_rows
            missing = [r for r in plan.views[pcp.rank].token_rows if hidden_rows[r] not in held]
            assert not missing, f"PCP rank {pcp.rank}: no target hidden state for MTP rows {missing[:8]}"
        g = out[last]
        return g, self.argmax(self.module.compute_logits(g))

    def after_step(
        self,
        sched: SchedulerOutput,
        sampled: dict[str, int],
        spec_sampled: dict[str, list[int]],
        drafting_off: bool,
    ) -> None:
        if self.after_step_peers is not None:  # PCP rank 0: the workers run this step with us
            self.after_step_peers(sampled, spec_sampled, drafting_off)
        hidden, self._hidden = self._hidden, None
        if hidden is None:
            return
        rows: list[DraftRow] = []
        index: list[int] = []  # rows of ``hidden`` fed, in order
        owners: list[tuple[MTPState, bool]] = []
        base = 0
        for c in sched.chunks:
            req, s = c.request, c.start_pos
            rid, row, base = req.request_id, base, base + c.num_tokens
            if drafting_off and s >= req.num_prompt_tokens:
                continue  # a decode row while drafts are off: its state restarts when they are on
            if c.spec_token_ids:
                nxt = list(spec_sampled.get(rid, ()))
            elif c.sample:
                t = sampled.get(rid)
                nxt = [] if t is None else [*req.token_ids_slice(s + 1, s + c.num_tokens), t]
            else:
                nxt = req.token_ids_slice(s + 1, s + c.num_tokens + 1)  # a prompt chunk: all known
            if not nxt:
                self.states.pop(rid, None)
                continue
            st = self.states.get(rid)
            if st is None or st.num_computed != s:
                st = self.states[rid] = MTPState(s)  # positions before s: computed elsewhere
            rows.append(DraftRow(nxt, s, c.block_ids))
            index.extend(range(row, row + len(nxt)))
            owners.append((st, c.sample))
        if not rows:
            return
        prev = hidden[torch.tensor(index, device=hidden.device)]
        g, first = self._forward(rows, prev, index)
        for i, ((st, sample), r) in enumerate(zip(owners, rows, strict=True)):
            st.num_computed += len(r.token_ids)
            st.first_draft = first[i] if sample else None
            st.hidden = g[i] if sample else None
        if self.device.type == "cuda":  # a prefill node's transfer reads this KV after the step
            torch.cuda.current_stream(self.device).synchronize()

    def draft(self, chunks: list[ScheduledChunk]) -> None:
        states = [self.states[c.request.request_id] for c in chunks]
        drafts: list[list[int]] = []
        hs: list[torch.Tensor] = []
        for st in states:
            assert st.first_draft is not None and st.hidden is not None
            drafts.append([st.first_draft])
            hs.append(st.hidden)
            st.first_draft, st.hidden = None, None
        want = [len(c.spec_token_ids) for c in chunks]
        for j in range(1, max(want)):
            live = [i for i, m in enumerate(want) if m > j]
            rows = [DraftRow([drafts[i][-1]], chunks[i].start_pos + j - 1, chunks[i].block_ids) for i in live]
            g, toks = self._forward(rows, torch.stack([hs[i] for i in live]))
            for k, i in enumerate(live):
                drafts[i].append(toks[k])
                hs[i] = g[k]
        for c, d in zip(chunks, drafts, strict=True):
            set_drafts(c, d)
