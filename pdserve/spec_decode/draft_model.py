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

Under prefill context parallelism the draft model lives on rank 0 only (``on_every_pcp_rank``):
it reads nothing the split prefill spread over the ranks, and its drafts reach the other ranks
in the step that verifies them. Its catch-up forward over a long prompt is not split.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from pdserve.config.speculative import SpeculativeConfig
from pdserve.engine.request import Request
from pdserve.engine.scheduler_output import ScheduledChunk
from pdserve.errors import ConfigError
from pdserve.models.config import ModelArchConfig
from pdserve.models.loader import load_model, load_tokenizer
from pdserve.models.resolve import resolve_model_path
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

    def draft(self, chunks: list[ScheduledChunk]) -> None:
        rows = []
        for c in chunks:
            req = c.request
            n = req.num_tokens
            assert c.start_pos == n - 1, (req.request_id, c.start_pos, n)
            start = min(self.num_computed.get(req.request_id, 0), n - 1)
            rows.append(DraftRow(req.token_ids_slice(start, n), start, c.block_ids))
        drafts = [[t] for t in self._forward(rows)]
        want = [len(c.spec_token_ids) for c in chunks]
        for j in range(1, max(want)):
            live = [i for i, m in enumerate(want) if m > j]
            step = [DraftRow([drafts[i][-1]], chunks[i].start_pos + j, chunks[i].block_ids) for i in live]
            for i, t in zip(live, self._forward(step), strict=True):
                drafts[i].append(t)
        for c, d in zip(chunks, drafts, strict=True):
            set_drafts(c, d)
            self.num_computed[c.request.request_id] = c.request.num_tokens
