"""The base of every cluster-file settings model: frozen, and a field the model lacks is refused.

Shared by :mod:`pdserve.config.router_settings`, :mod:`pdserve.config.node_settings` and
:mod:`pdserve.config.cluster`; ``extra="forbid"`` is what lets a misspelt key fail at load
with a "did you mean" hint (:mod:`pdserve.config.cluster_file`). A key an older cluster file
may still carry after its setting was removed is named in the model's ``REMOVED_KEYS`` and
refused at load with what the code does now.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from pdserve.errors import ConfigError


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    # A removed setting's key -> what the code does now, without it.
    REMOVED_KEYS: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_removed_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            for key, now in cls.REMOVED_KEYS.items():
                if key in data:
                    raise ConfigError(f"{key} ({data[key]!r}) was removed: {now}; delete it")
        return data
