"""The base of every cluster-file settings model: frozen, and a field the model lacks is refused.

Shared by :mod:`pdserve.config.router_settings`, :mod:`pdserve.config.node_settings` and
:mod:`pdserve.config.cluster`; ``extra="forbid"`` is what lets a misspelt key fail at load
with a "did you mean" hint (:mod:`pdserve.config.cluster_file`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
