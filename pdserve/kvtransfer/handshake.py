"""Compatibility check between KV peers (docs/design.md §3, Integrity).

Both sides send a ``HandshakeInfo``: the fields that decide whether one side's KV bytes mean the
same thing on the other, their hash, and an epoch that changes on every process start. The
fields travel, not only the hash, so a mismatch names what differs (dtype, block size, ...).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.errors import PdserveError
from pdserve.kvtransfer.speculative_compat import speculative_mismatch

# Bump when the KV tensor layout or the region/descriptor scheme changes meaning.
KV_LAYOUT_VERSION = 1


class HandshakeError(PdserveError):
    """The peer's KV is not compatible with ours, or the peer restarted (epoch changed)."""

    def __init__(self, field_name: str, local: Any, remote: Any, hint: str = "") -> None:
        super().__init__(
            f"KV handshake mismatch on {field_name}: local {local!r}, remote {remote!r}"
            + (f"; {hint}" if hint else "")
        )
        self.field = field_name
        self.local = local
        self.remote = remote


def compat_hash(
    model_id: str,
    dtype: str,
    block_size: int,
    layer_names: Sequence[str],
    num_kv_heads: int,
    head_dim: int,
    layout_version: int = KV_LAYOUT_VERSION,
) -> str:
    """Stable sha256 hex of the fields (canonical JSON); ``layer_names`` = all of the model's, in order."""
    payload = {
        "model_id": model_id,
        "dtype": dtype,
        "block_size": int(block_size),
        "layer_names": list(layer_names),
        "num_kv_heads": int(num_kv_heads),
        "head_dim": int(head_dim),
        "layout_version": int(layout_version),
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def new_epoch() -> str:
    """A random id for this process start; a peer seeing it change knows our KV state is gone."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class HandshakeInfo:
    """What a KV peer announces; ``compat_hash`` is derived, never set by hand."""

    model_id: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    block_size: int  # tokens per KV block
    layer_names: tuple[str, ...]  # every layer of the model, not one stage's
    num_kv_heads: int  # of the whole model, before TP sharding
    head_dim: int
    layout_version: int = KV_LAYOUT_VERSION
    epoch: str = ""
    # the data plane (tcp | rdma | cuda_ipc): both ends must speak the same one. Not part of the
    # hash (it does not change what the KV bytes mean); "" = unknown (an older peer), not checked.
    kv_transport: str = ""
    # the speculative config, ``method|drafter|k`` ("" = none; pdserve.kvtransfer.speculative_compat)
    speculative: str = ""
    # the KV cache groups with tables of their own (kvtransfer/group_transfer.py; "" = one table
    # for every layer): compared apart from the hash, as the speculative config
    kv_groups: str = ""
    compat_hash: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        object.__setattr__(
            self,
            "compat_hash",
            compat_hash(
                self.model_id,
                self.dtype,
                self.block_size,
                self.layer_names,
                self.num_kv_heads,
                self.head_dim,
                self.layout_version,
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "layer_names": list(self.layer_names),
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "layout_version": self.layout_version,
            "epoch": self.epoch,
            "kv_transport": self.kv_transport,
            "speculative": self.speculative,
            "kv_groups": self.kv_groups,
            "compat_hash": self.compat_hash,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HandshakeInfo:
        info = cls(
            model_id=str(d["model_id"]),
            dtype=str(d["dtype"]),
            block_size=int(d["block_size"]),
            layer_names=tuple(d["layer_names"]),
            num_kv_heads=int(d["num_kv_heads"]),
            head_dim=int(d["head_dim"]),
            layout_version=int(d["layout_version"]),
            epoch=str(d.get("epoch", "")),
            kv_transport=str(d.get("kv_transport", "")),
            speculative=str(d.get("speculative", "")),
            kv_groups=str(d.get("kv_groups", "")),
        )
        sent = d.get("compat_hash")
        if sent is not None and sent != info.compat_hash:
            raise HandshakeError(
                "compat_hash",
                info.compat_hash,
                sent,
                "the peer hashes the same fields differently (version skew)",
            )
        return info


_FIELDS = ("model_id", "dtype", "block_size", "num_kv_heads", "head_dim", "layout_version")


def _layer_names_diff(local: Sequence[str], remote: Sequence[str]) -> str:
    if len(local) != len(remote):
        return f"{len(local)} layers locally vs {len(remote)} remotely"
    i = next(i for i, (a, b) in enumerate(zip(local, remote, strict=True)) if a != b)
    return f"first difference at index {i}: {local[i]!r} vs {remote[i]!r}"


def check_compat(
    local: HandshakeInfo, remote: HandshakeInfo, *, expected_remote_epoch: str | None = None
) -> None:
    """Raise HandshakeError naming the first field that differs; also if the peer's epoch moved."""
    for name in _FIELDS:
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            raise HandshakeError(
                name, a, b, "prefill and decode must serve the same model with the same KV settings"
            )
    if local.layer_names != remote.layer_names:
        raise HandshakeError(
            "layer_names",
            len(local.layer_names),
            len(remote.layer_names),
            _layer_names_diff(local.layer_names, remote.layer_names),
        )
    assert local.compat_hash == remote.compat_hash, "equal fields must hash equal"
    if local.kv_transport and remote.kv_transport and local.kv_transport != remote.kv_transport:
        raise HandshakeError(
            "kv_transport",
            local.kv_transport,
            remote.kv_transport,
            "prefill and decode must use the same kv_transport (every push would fail)",
        )
    why = speculative_mismatch(local.speculative, remote.speculative)
    if why is not None:
        raise HandshakeError("speculative", local.speculative or "off", remote.speculative or "off", why)
    if local.kv_groups != remote.kv_groups:
        raise HandshakeError(
            "kv_groups",
            local.kv_groups or "one table",
            remote.kv_groups or "one table",
            "prefill and decode must keep the model's KV groups alike (a block table per group on "
            "both: one stage, one TP rank, no kv_offload, no kv_checksum, not cuda_ipc)",
        )
    if expected_remote_epoch is not None and remote.epoch != expected_remote_epoch:
        raise HandshakeError(
            "epoch",
            expected_remote_epoch,
            remote.epoch,
            "the peer restarted: KV it held for earlier transfers is gone",
        )
