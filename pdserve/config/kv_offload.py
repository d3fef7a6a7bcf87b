"""The offload tier's settings (``kv_offload: {cpu_bytes, disk_path, disk_bytes}``). No torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.errors import ConfigError


@dataclass(frozen=True)
class KVOffloadConfig:
    # Both budgets are the node's: with pp or tp > 1 one block holds every stage's layers and every
    # rank's heads, so the processes share them in proportion to their KV (kvoffload/stages.py).
    # Host-memory tier: bytes of the preallocated pool of evicted blocks (pinned on CUDA); 0: none.
    cpu_bytes: int = 0
    # Local-disk tier below the host tier: a folder for one file per block, and its byte budget.
    disk_path: str | None = None
    disk_bytes: int = 0

    def __post_init__(self) -> None:
        if self.cpu_bytes < 0 or self.disk_bytes < 0:
            raise ConfigError(
                f"kv_offload: cpu_bytes ({self.cpu_bytes}) and disk_bytes ({self.disk_bytes}) must be >= 0"
            )
        if (self.disk_path is None) != (self.disk_bytes == 0):
            raise ConfigError(
                f"kv_offload: disk_path ({self.disk_path!r}) and disk_bytes ({self.disk_bytes}) go "
                "together: set both for a disk tier, or neither"
            )
        if self.cpu_bytes == 0 and self.disk_path is None:
            raise ConfigError(
                "kv_offload: no tier set; give cpu_bytes > 0 and/or disk_path with disk_bytes > 0, "
                "or remove the kv_offload section"
            )

    @classmethod
    def coerce(cls, value: KVOffloadConfig | dict[str, Any] | None) -> KVOffloadConfig | None:
        """``LLM(kv_offload={...})`` takes a dict as the cluster file's section does."""
        if value is None or isinstance(value, KVOffloadConfig):
            return value
        unknown = set(value) - {"cpu_bytes", "disk_path", "disk_bytes"}
        if unknown:
            raise ConfigError(
                f"kv_offload: unknown keys {sorted(unknown)}; supported: cpu_bytes, disk_path, disk_bytes"
            )
        return cls(**value)
