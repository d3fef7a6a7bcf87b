"""GPU tests: the CUDA engine path (Triton attention, CUDA graphs) against transformers and eager.

Tests marked ``gpu`` skip cleanly without CUDA. The Triton attention kernel tests also run on CPU
under TRITON_INTERPRET=1 (tiny shapes); it must be set before triton is first imported, which
pdserve does lazily, so setting it here is early enough.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
