"""What a node tells the KV transfer about its model runner: the KV regions to register and to
push from (``kv_regions_of``, ``drafter_kv_buffers``) and the handshake that peers compare before
any transfer (``handshake_info_of``, ``model_identity``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pdserve.kvtransfer.group_transfer import group_kv_regions
from pdserve.kvtransfer.handshake import HandshakeInfo
from pdserve.kvtransfer.regions import Region, regions_for_kv_cache


def model_identity(model_dir: str | Path) -> str:
    """Identifies a checkpoint across hosts (paths differ): its config plus its weight files' sizes."""
    d = Path(model_dir)
    h = hashlib.sha256(json.dumps(json.loads((d / "config.json").read_text()), sort_keys=True).encode())
    for f in sorted(d.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def kv_regions_of(runner: Any) -> list[Region]:
    """The regions of a model runner's KV cache tensor (one per local layer; a TP rank's hold
    its share of the KV heads: ``[num_blocks, L, 2, block_size, H_local, head_dim]``), or of
    each of its KV groups' tensors (kvtransfer/group_transfer.py)."""
    if getattr(runner, "group_kv", None) is not None:
        return group_kv_regions(runner)
    cache = runner.kv_cache
    a = runner.arch
    regions = regions_for_kv_cache(
        cache.data_ptr(),
        cache.shape[0],
        runner.model.layer_names,
        runner.block_size,
        cache.shape[-2],
        a.head_dim,
        cache.element_size(),
    )
    # A drafter whose KV the transfer moves (MTP: one more layer, its own tensor; the handshake's
    # speculative field makes both sides hold it or neither: spec_decode/drafter.py)
    drafter = getattr(runner, "drafter", None)
    return regions + (drafter.kv_regions() if drafter is not None else [])


def drafter_kv_buffers(runner: Any) -> list[tuple[int, int]]:
    """(address, bytes) of a drafter's KV tensor that a transfer reads or writes (MTP), for the
    transfer backend to register beside the runner's own KV tensor; [] without one."""
    drafter = getattr(runner, "drafter", None)
    if drafter is None or not drafter.transfer_layer_names:
        return []
    cache = drafter.kv_cache
    return [(cache.data_ptr(), cache.numel() * cache.element_size())]


def handshake_info_of(
    runner: Any,
    model_dir: str | Path,
    epoch: str,
    kv_transport: str = "",
    speculative: str = "",
    kv_groups: str = "",
) -> HandshakeInfo:
    a = runner.arch
    return HandshakeInfo(
        model_id=model_identity(model_dir),
        dtype=str(runner.dtype).removeprefix("torch."),
        block_size=runner.block_size,
        layer_names=tuple(f"model.layers.{i}.self_attn" for i in range(a.num_hidden_layers)),
        num_kv_heads=a.num_key_value_heads,
        head_dim=a.head_dim,
        epoch=epoch,
        kv_transport=kv_transport,
        speculative=speculative,
        kv_groups=kv_groups,
    )
