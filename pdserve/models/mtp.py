"""A DeepSeek-V3-style multi-token-prediction (MTP) module over a Llama-family target.

The checkpoint's config.json says ``num_nextn_predict_layers: 1``; the module's weights are stored
as one extra decoder layer after the target's last, index L = num_hidden_layers, the way
DeepSeek-V3 stores them:

    model.layers.L.enorm.weight                  [H]       RMSNorm of the next token's embedding
    model.layers.L.hnorm.weight                  [H]       RMSNorm of the target's hidden state
    model.layers.L.eh_proj.weight                [H, 2H]   cat(enorm(e), hnorm(h)) -> H
    model.layers.L.input_layernorm.weight, model.layers.L.self_attn.{q,k,v,o}_proj.*,
    model.layers.L.post_attention_layernorm.weight, model.layers.L.mlp.{gate,up,down}_proj.*
                                                           one decoder layer of the target's family
    model.layers.L.shared_head.norm.weight       [H]       RMSNorm before the shared LM head

The embedding and the LM head are the target's (DeepSeek-V3 also stores copies as
``model.layers.L.embed_tokens`` and ``model.layers.L.shared_head.head``; they are skipped if
present). The target's own loader skips every ``model.layers.L.*`` tensor (outside its layers).

At position i the module reads h_i (the target's last hidden state, after its final norm) and
the embedding of t_{i+1}, and predicts t_{i+2}:

    x = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))     [n, H]
    g = residual + layer(x)                                  [n, H]   (its own next "hidden")
    logits = lm_head(shared_head.norm(g))                    [n, V]
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from pdserve.errors import ConfigError
from pdserve.models.attention import AttentionMetadata
from pdserve.models.config import ModelArchConfig
from pdserve.models.linear import Linear, prepare_small_gemms
from pdserve.models.llama import STACKED_PARAMS, LlamaForCausalLM, RMSNorm, RotaryEmbedding

MTP_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SKIPPED = ("embed_tokens.", "shared_head.head.")  # the target's embedding and LM head serve


def num_nextn_predict_layers(model_dir: str | Path) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text()).get("num_nextn_predict_layers") or 0)


class MTPModule(nn.Module):
    def __init__(self, target: LlamaForCausalLM) -> None:
        super().__init__()
        cfg: ModelArchConfig = target.cfg
        if cfg.architecture not in MTP_ARCHITECTURES:
            raise ConfigError(
                f"speculative.method mtp: architecture {cfg.architecture} is not supported; supported: "
                f"{', '.join(MTP_ARCHITECTURES)}"
            )
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx = cfg.num_hidden_layers
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.layer = target.decoder_layer_cls(cfg, self.layer_idx)
        self.shared_head_norm = RMSNorm(h, eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        self._target = [target]  # not a submodule: its weights are the target's

    @property
    def prefix(self) -> str:
        return f"model.layers.{self.layer_idx}."

    def forward(
        self,
        input_ids: torch.Tensor,  # [n] t_{i+1}
        prev_hidden: torch.Tensor,  # [n, H] h_i (the target's) or g of the module's previous row
        positions: torch.Tensor,  # [n] i
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """g [n, H], before the shared head's norm."""
        embed = self._target[0].model.embed_tokens
        assert embed is not None
        e = self.enorm(embed(input_ids))
        assert isinstance(e, torch.Tensor)
        h = self.hnorm(prev_hidden.to(e.dtype))
        assert isinstance(h, torch.Tensor)
        x = self.eh_proj(torch.cat([e, h], dim=-1))  # [n, H]
        cos_sin = self.rotary_emb.cos_sin_cache(positions.device)
        out, residual = self.layer(x, None, positions, cos_sin, kv_cache, meta)
        return out + residual

    def compute_logits(self, g: torch.Tensor) -> torch.Tensor:
        """[n, V] in the weights' dtype (argmax only)."""
        normed = self.shared_head_norm(g)
        assert isinstance(normed, torch.Tensor)
        return self._target[0].compute_logits(normed, upcast=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the ``model.layers.L.*`` tensors in; ConfigError on a missing or misshapen one."""
        target = self._target[0]
        params = dict(self.named_parameters())
        loaded: set[tuple[str, str]] = set()
        for hf_name, tensor in weights:
            rest = hf_name.removeprefix(self.prefix)
            if rest == hf_name or rest.startswith(SKIPPED):
                continue
            if rest.startswith("shared_head.norm."):
                name = "shared_head_norm." + rest.removeprefix("shared_head.norm.")
            elif rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
                name = rest
            else:
                name = "layer." + rest  # the decoder layer's own names
            shard = ""
            for piece, (fused_piece, shard_id) in STACKED_PARAMS.items():
                if piece in name:
                    name, shard = name.replace(piece, fused_piece), shard_id
                    break
            if name not in params:
                raise ConfigError(f"MTP weight {hf_name!r} has no matching parameter; wrong architecture?")
            dst = params[name].data
            if shard:
                offset, size = target._shard_range(shard)
                dst = dst.narrow(0, offset, size)
            target._check_shape(hf_name, dst, tensor)
            dst.copy_(tensor)
            loaded.add((name, shard))
        expected = {(n, s) for n in params for s in target._shard_ids(n)}
        missing = sorted(f"{self.prefix}{n}" for n, _ in expected - loaded)
        if missing:
            raise ConfigError(f"the checkpoint lacks {len(missing)} MTP weights, e.g. {missing[:3]}")


def load_mtp(model_dir: str | Path, target: LlamaForCausalLM) -> MTPModule:
    """The checkpoint's MTP module on the target's device and dtype, in eval mode."""
    from pdserve.models.loader import iter_safetensors

    n = num_nextn_predict_layers(model_dir)
    if n != 1:
        raise ConfigError(
            f"speculative.method mtp needs a checkpoint with num_nextn_predict_layers: 1 in config.json; "
            f"{model_dir} has {n} (pdserve make-model --mtp writes one)"
        )
    p = next(target.parameters())
    with torch.device("meta"):
        module = MTPModule(target)
    module = module.to(dtype=p.dtype).to_empty(device=p.device)
    prefix = module.prefix
    module.load_weights(iter_safetensors(model_dir, lambda name: name.startswith(prefix)))
    module.eval().requires_grad_(False)
    prepare_small_gemms(module)  # the CPU routes of its Linear layers, as the target's (models/linear.py)
    return module


def write_mtp_weights(model_dir: str | Path, seed: int, init_range: float) -> None:
    """Add a random MTP layer to a tiny checkpoint (``make_tiny_model(..., mtp=True)``).

    The decoder layer's tensors take the shapes of the target's layer 0. eh_proj is the identity
    on the hidden-state half plus noise, and the layer's output projections are small, so the
    module's drafts start near the target's own next-token prediction (a random module would draft
    noise that is never accepted; this one is on runs of a repeated token)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    assert len(files) == 1, f"tiny checkpoints are one file, found {files}"
    cfg = json.loads((d / "config.json").read_text())
    n_layers, h = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    gen = torch.Generator().manual_seed(seed + 2)
    with safe_open(str(files[0]), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    dtype = tensors["model.embed_tokens.weight"].dtype
    prefix = f"model.layers.{n_layers}."
    for name, t in list(tensors.items()):
        if not name.startswith("model.layers.0."):
            continue
        rest = name.removeprefix("model.layers.0.")
        if "norm" in rest:
            new = 1.0 + 0.2 * torch.randn(t.shape, generator=gen)
        else:
            small = rest.endswith(("o_proj.weight", "down_proj.weight"))
            new = (0.1 if small else 1.0) * init_range * torch.randn(t.shape, generator=gen)
        tensors[prefix + rest] = new.to(dtype)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{norm}.weight"] = torch.ones(h, dtype=dtype)
    eh = 0.1 * init_range * torch.randn(h, 2 * h, generator=gen)
    eh[:, h:] += torch.eye(h)
    tensors[f"{prefix}eh_proj.weight"] = eh.to(dtype)
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
