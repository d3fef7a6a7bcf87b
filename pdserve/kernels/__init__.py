"""Kernels: Triton on GPUs, pure-torch twins on CPU (and as test references), and on the CPU a few
native C kernels for small bf16 steps (``cpu_native``: they fall back to the twins).

Call sites use only the dispatching functions below (``rms_norm``, ``fused_add_rms_norm``,
``gated_rms_norm``, ``apply_rotary``, ``silu_and_mul``, ``argmax_rows``, ``apply_token_bitmask_``); which implementation runs
is decided by each family's one capability predicate (``triton_can_run``, ``rotary_can_run``,
``silu_and_mul_can_run``, ``argmax_unsupported_reason``,
``bitmask_unsupported_reason``); ``set_backend``/``use_backend`` force a
side for all of them.
"""

from __future__ import annotations

from pdserve.kernels.activation import (
    silu_and_mul,
    silu_and_mul_can_run,
    silu_and_mul_torch,
    silu_and_mul_unsupported_reason,
)
from pdserve.kernels.argmax import (
    argmax_rows,
    argmax_unsupported_reason,
    host_operands_readable,
    masked_argmax_rows,
)
from pdserve.kernels.backend import (
    Backend,
    get_backend,
    set_backend,
    use_backend,
    wants_native,
    wants_triton,
)
from pdserve.kernels.bitmask import apply_token_bitmask_, bitmask_unsupported_reason
from pdserve.kernels.rmsnorm import (
    MAX_HIDDEN,
    fused_add_rms_norm,
    fused_add_rms_norm_torch,
    gated_rms_norm,
    gated_rms_norm_torch,
    rms_norm,
    rms_norm_torch,
    triton_can_run,
    triton_unsupported_reason,
)
from pdserve.kernels.rotary import (
    MAX_ROTARY_HEAD_DIM,
    apply_rotary,
    apply_rotary_torch,
    rotary_can_run,
    rotary_cos_sin,
    rotary_cos_sin_cache,
    rotary_unsupported_reason,
    rotate_qk_torch,
)

__all__ = [
    "MAX_HIDDEN",
    "MAX_ROTARY_HEAD_DIM",
    "Backend",
    "apply_rotary",
    "apply_rotary_torch",
    "apply_token_bitmask_",
    "argmax_rows",
    "argmax_unsupported_reason",
    "bitmask_unsupported_reason",
    "fused_add_rms_norm",
    "fused_add_rms_norm_torch",
    "gated_rms_norm",
    "gated_rms_norm_torch",
    "get_backend",
    "host_operands_readable",
    "masked_argmax_rows",
    "rms_norm",
    "rms_norm_torch",
    "rotary_can_run",
    "rotary_cos_sin",
    "rotary_cos_sin_cache",
    "rotary_unsupported_reason",
    "rotate_qk_torch",
    "set_backend",
    "silu_and_mul",
    "silu_and_mul_can_run",
    "silu_and_mul_torch",
    "silu_and_mul_unsupported_reason",
    "triton_can_run",
    "triton_unsupported_reason",
    "use_backend",
    "wants_native",
    "wants_triton",
]
