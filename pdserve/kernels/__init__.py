"""Normalisation kernels: Triton on GPUs, pure-torch twins on CPU (and as test references).

Call sites use only the dispatching functions below; which implementation runs is decided by
one capability predicate (``triton_can_run``); ``set_backend``/``use_backend`` force a side.
"""

from __future__ import annotations

from pdserve.kernels.rmsnorm import (
    MAX_HIDDEN,
    Backend,
    fused_add_rms_norm,
    fused_add_rms_norm_torch,
    gated_rms_norm,
    gated_rms_norm_torch,
    get_backend,
    rms_norm,
    rms_norm_torch,
    set_backend,
    triton_can_run,
    triton_unsupported_reason,
    use_backend,
)

__all__ = [
    "MAX_HIDDEN",
    "Backend",
    "fused_add_rms_norm",
    "fused_add_rms_norm_torch",
    "gated_rms_norm",
    "gated_rms_norm_torch",
    "get_backend",
    "rms_norm",
    "rms_norm_torch",
    "set_backend",
    "triton_can_run",
    "triton_unsupported_reason",
    "use_backend",
]
