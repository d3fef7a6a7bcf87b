"""``method: draft_model``: a smaller checkpoint with the target's tokenizer drafts k tokens greedily.

Per request the drafter knows how many leading positions hold its KV (``num_computed``). Each
drafting step first catches up: one forward over the tokens from there to the last known token
(the whole prompt on a request's first drafted step, the accepted tokens and the bonus token
afterwards), whose last row gives d_1; then m - 1 one-token forwards give d_2 .. d_m:

    tokens   t_0 ... t_c ... t_{N-1} | d_1 d_2 ... d_{m-1}
    forward  [catch-up: c .. N-1]    | one row each            -> d_1, d_2, ..., d_m

Afterwards ``num_computed`` = N: only verified tokens count, so whatever the target accepts, the
next step's catch-up starts at a position whose KV holds the right token.

Through prefill -> decode the decode node rebuilds this state itself: its first drafted step
catches up from position 0 (a draft-model prefill of the prompt on the decode node). The draft
model is small, so this costs a fraction of the target's prefill; nothing of the drafter moves
with the transfer and a prefill node needs no draft weights (kvtransfer/speculative_compat.py
serves such a pair). A request's draft KV is never taken from the prefix cache for the same
reason: every request catches up from 0.

Under prefill context parallelism (``pcp: N``, pdserve/pcp) every rank holds the draft model and
its KV (``make_drafter``); drafting stays on rank 0 and the drafts reach the other ranks in
the step that verifies them. A request's first catch-up (from position 0: the prompt and its first
sampled token, whose slot the step after the prefill allocates) is the draft model's prefill.
When such a row is long enough to split (``is_split_chunk``, the target's rule), rank 0 sends the
rows to the worker ranks (``split_peers``) and every rank runs that forward as the target's
prefill ran (``ContextParallel.run_split``): its zig-zag slice of each row, the draft model's K/V
all-gathered per layer (every rank then holds the prompt's whole draft KV), and the rows that
draft (each row's last, global rows of the draft batch) gathered from the rank that computed
them, so rank 0 takes d_1 from the global batch, never from its local numbering.

Every later draft forward (catch-ups of accepted tokens, the one-token forwards) runs on rank 0
alone: a few rows, which a message to every rank per forward would cost more than computing.
That leaves the workers' draft KV past the split rows stale, so only rows from position 0 are
split (their context is the row itself: a split never reads what rank 0 alone wrote); a long
catch-up from a later position (drafting off under ``disable_by_batch_size`` for a while) runs
on rank 0 unsplit. Replicating every draft forward on every rank instead would keep the workers'
draft KV whole, for nothing the drafts need.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from pdserve.config.speculative import SpeculativeConfig
from pdserve.engine.request import Request
from pdserve.engine.scheduler_output import ScheduledChunk
from pdserve.errors import ConfigError
from pdserve.models.attention import AttentionMetadata
from pdserve.models.config import ModelArchConfig
from pdserve.models.loader import load_model, load_tokenizer
from pdserve.models.resolve import resolve_model_path
from pdserve.pcp.index_map import is_split_chunk
from pdserve.spec_decode.drafter import Drafter, DraftRow, set_drafts

if TYPE_CHECKING:
    from pdserve.engine.model_runner import ModelRunner


def check_same_tokenizer(
    target_dir: str, draft_dir: str, target: ModelArchConfig, draft: ModelArchConfig
) -> None:
    """ConfigError unless the draft checkpoint's tokenizer maps every token as the target's and
    its ids fit the target's vocabulary."""
    where = f"speculative.model {draft_dir}"
    if draft.vocab_size > target.vocab_size:
        raise ConfigError(
            f"{where}: vocab_size {draft.vocab_size} exceeds the target's {target.vocab_size}; the "
            "draft model must share the target's tokenizer"
        )
    try:
        draft_vocab = load_tokenizer(draft_dir).get_vocab()
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: cannot load its tokenizer ({e}); the draft needs the target's") from e
    target_vocab = load_tokenizer(target_dir).get_vocab()
    if draft_vocab != target_vocab:
        differ = len(set(draft_vocab.items()) ^ set(target_vocab.items()))
        raise ConfigError(
            f"{where}: its tokenizer differs from the target's ({len(draft_vocab)} against "
            f"{len(target_vocab)} tokens, {differ} (token, id) pairs differ); a draft model must "
            "use the target's tokenizer"
        )


class DraftModelDrafter(Drafter):
    def __init__(self, runner: ModelRunner, spec: SpeculativeConfig) -> None:
        assert spec.model is not None
        path = resolve_model_path(spec.model)
        cfg = ModelArchConfig.from_model_dir(path)
        check_same_tokenizer(str(runner.config.model), str(path), runner.arch, cfg)
        self.model, self.arch = load_model(path, runner.dtype, runner.device)
        self.path = path
        a = self.arch
        super().__init__(
            runner, a.num_hidden_layers, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        )
        self.num_computed: dict[str, int] = {}  # request id -> leading positions with draft KV
        # forwards split over the PCP ranks, and the split rows' tokens this rank computed in them
        self.num_split_forwards = 0
        self.num_split_tokens = 0

    def init_kv_cache(self, num_blocks: int) -> None:
        if self.arch.max_position_embeddings < self.runner.max_model_len:
            raise ConfigError(
                f"speculative.model {self.path}: max_position_embeddings {self.arch.max_position_embeddings} "
                f"is below the target's max_model_len {self.runner.max_model_len}; lower max_model_len"
            )
        super().init_kv_cache(num_blocks)

    def can_draft(self, req: Request) -> bool:
        return True

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.num_computed.pop(rid, None)

    @torch.inference_mode()
    def _forward(self, rows: list[DraftRow]) -> list[int]:
        input_ids, positions, meta, last, _ = self.inputs(rows)
        hidden = self.model(input_ids, positions, self.layer_caches, meta)
        assert isinstance(hidden, torch.Tensor)
        return self.argmax(self.model.compute_logits(hidden[last], upcast=False))

    @torch.inference_mode()
    def _split_forward(self, rows: list[DraftRow]) -> torch.Tensor:
        """One forward over ``rows`` split over the PCP ranks (every rank runs it with the same
        rows): the hidden states of each row's last token, [len(rows), hidden], gathered from
        the rank that computed it."""
        pcp = self.runner.pcp
        assert pcp is not None
        input_ids, positions, meta, last, batch = self.inputs(rows)

        def run(local: torch.Tensor | None, m: AttentionMetadata) -> torch.Tensor:
            if local is None:
                out = self.model(input_ids, positions, self.layer_caches, m)
            else:
                out = self.model(input_ids[local], positions[local], self.layer_caches, m)
            assert isinstance(out, torch.Tensor)
            return out

        hidden, plan = pcp.run_split(
            batch, meta, self.block_size, run, list(batch.sample_idx), self.num_layers
        )
        assert plan.is_split, "a split catch-up row is shorter than the split threshold"
        self.num_split_forwards += 1
        self.num_split_tokens += len(plan.views[pcp.rank].send_rows)
        return hidden[last]

    def peer_forward(self, rows: list[DraftRow]) -> None:
        self._split_forward(rows)

    def _catch_up(self, rows: list[DraftRow]) -> list[int]:
        """d_1 of every row. On PCP rank 0 the rows from position 0 long enough to split (first
        catch-ups) run as one forward split over the ranks, the rest as one forward here."""
        pcp, peers = self.runner.pcp, self.split_peers
        if pcp is None or peers is None:
            return self._forward(rows)
        split = [
            i
            for i, r in enumerate(rows)
            if r.start == 0 and is_split_chunk(len(r.token_ids), pcp.size, self.block_size)
        ]
        if not split:
            return self._forward(rows)
        out = [0] * len(rows)
        sent = [DraftRow(list(rows[i].token_ids), 0, list(rows[i].block_ids)) for i in split]
        with peers(sent), torch.inference_mode():
            logits = self.model.compute_logits(self._split_forward(sent), upcast=False)
        for i, t in zip(split, self.argmax(logits), strict=True):
            out[i] = t
        local = sorted(set(range(len(rows))) - set(split))
        if local:
            for i, t in zip(local, self._forward([rows[i] for i in local]), strict=True):
                out[i] = t
        return out

    def draft(self, chunks: list[ScheduledChunk]) -> None:
        rows = []
        for c in chunks:
            req = c.request
            n = req.num_tokens
            assert c.start_pos == n - 1, (req.request_id, c.start_pos, n)
            start = min(self.num_computed.get(req.request_id, 0), n - 1)
            rows.append(DraftRow(req.token_ids_slice(start, n), start, c.block_ids))
        drafts = [[t] for t in self._catch_up(rows)]
        want = [len(c.spec_token_ids) for c in chunks]
        for j in range(1, max(want)):
            live = [i for i, m in enumerate(want) if m > j]
            step = [DraftRow([drafts[i][-1]], chunks[i].start_pos + j, chunks[i].block_ids) for i in live]
            for i, t in zip(live, self._forward(step), strict=True):
                drafts[i].append(t)
        for c, d in zip(chunks, drafts, strict=True):
            set_drafts(c, d)
            self.num_computed[c.request.request_id] = c.request.num_tokens
