"""Native CPU kernels for small bf16 steps: ``cpu_native.c``, a CPython extension module built on
first use with the host's C compiler (and Python's headers) and imported from a cache.

Why: a CPU decode step of a small model is bound by the count of torch ops, each ~1-2 us of
dispatch, not by arithmetic. On the tiny bench Llama (hidden 128, 4 layers) at one request a
step spent ~31 us per fused add + RMS norm, ~60 us per layer on rotary + KV store and ~75 us per
layer on attention (docs/benchmarks.md, "The CPU decode step"). Each wrapper is one call for one
of those: ~3-5 us with the Python around it (an output tensor's allocation is ~1 us of that; a
call through ctypes was ~2 us on its own, so the C functions take addresses as Python ints through
CPython's fast-call protocol instead).

When: ``backend`` "auto" (the default), a CPU bf16 tensor, and the work under each wrapper's
cap (past it torch's vectorised, multi-threaded kernels win); the callers in ``rmsnorm``,
``activation``, ``models.kv_store`` and ``models.attention_torch`` fall back to their torch twins
when a wrapper returns None. Backend "torch" never comes here.

``PDSERVE_CPU_KERNELS`` (read once, at first use):
  auto    (default) native when the module builds (a C compiler and Python.h); otherwise the
          torch twins, one warning
  torch   never native
  native  native required: a failed build raises (tests and benchmarks that must measure it)

This module holds the library's one load and its state (every wrapper reads the library from
here). Building, caching and loading the module: ``cpu_native_build``. The wrappers:
``cpu_native_rowwise`` (norms, silu * up, the small linear, the grammar bitmask) and
``cpu_native_attention`` (rotary + KV store, the KV index checks, attention).

Numerics (bf16 only; fp16 and fp32 keep the torch twins): elementwise results (rotary, the KV
store, the residual add) are the twins' bits; the norm's mean of squares and attention's sums
are added in another order, and silu and attention use a polynomial exp (their AVX2 + FMA loops,
``cpu_activation.c`` and ``cpu_attention.c``, where the CPU has both) or the C library's expf (the
scalar loops), so those can differ from the twin by one bf16 rounding step. The CPU bf16 path was not token-identical to ``transformers`` before
either (models/linear.py); fp32, the path the token-identity tests hold, does not come here.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from types import ModuleType

import torch

from pdserve.errors import ConfigError
from pdserve.kernels.cpu_native_build import load

logger = logging.getLogger(__name__)

ENV = "PDSERVE_CPU_KERNELS"
MODES = ("auto", "torch", "native")

_lock = threading.Lock()
_lib: ModuleType | None = None
_loaded = False  # the one attempt was made (its result is _lib)
_load_error: str | None = None


def mode() -> str:
    """``PDSERVE_CPU_KERNELS``, checked."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ConfigError(f"{ENV}={value!r} is not one of {', '.join(MODES)}")
    return value


def library() -> ModuleType | None:
    """The loaded library, or None (mode "torch", or the build failed in mode "auto")."""
    global _lib, _loaded, _load_error
    if _loaded:
        return _lib
    with _lock:
        if _loaded:
            return _lib
        m = mode()
        if m == "torch":
            _load_error = f"{ENV}=torch"
        else:
            try:
                _lib = load()
            except (RuntimeError, OSError, ImportError) as e:
                _load_error = str(e)
                if m == "native":
                    raise RuntimeError(f"{ENV}=native but the native CPU kernels are unavailable: {e}") from e
                logger.warning("native CPU kernels unavailable, using the torch twins: %s", e)
        _loaded = True
        return _lib


def available() -> bool:
    return library() is not None


def unavailable_reason() -> str | None:
    library()
    return _load_error if _lib is None else None


@functools.cache
def bf16_gemm_hardware() -> bool:
    """Whether torch runs bf16 GEMMs on hardware support here (oneDNN: AVX512-BF16, AMX or
    AVX-NE-CONVERT); without it torch's bf16 mm / bmm are generic loops."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _reset_for_tests() -> None:
    global _lib, _loaded, _load_error
    with _lock:
        _lib, _loaded, _load_error = None, False, None
