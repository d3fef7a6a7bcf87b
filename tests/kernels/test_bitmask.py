"""Grammar bitmask kernel vs a per-token reference: compact rows, row indices, ragged vocabulary,
several chunks, dtypes, dispatch. On CPU under TRITON_INTERPRET=1 (tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import apply_token_bitmask_, bitmask_unsupported_reason
from pdserve.kernels.bitmask import apply_token_bitmask_torch

try:
    from pdserve.kernels.triton_bitmask import BLOCK
except ImportError:  # no triton: every test that runs the kernel skips (conftest.force_triton)
    BLOCK = 4096

CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def _reference(logits: torch.Tensor, allowed: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for r, row in enumerate(rows):
        out[row][~allowed[r]] = float("-inf")
    return out


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[k, V] bool -> [k, ceil(V / 32)] int32 (bit j of word w = token 32 w + j), xgrammar's layout."""
    k, vocab = allowed.shape
    words = -(-vocab // 32)
    padded = torch.zeros(k, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    packed = (padded.view(k, words, 32) * weights).sum(-1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_rows", "vocab", "rows"), [(4, 37, [2, 0]), (5, BLOCK + 77, [4, 1, 3]), (3, 512, None)]
)
def test_bitmask_matches_reference(force_triton, device, dtype, num_rows, vocab, rows) -> None:
    torch.manual_seed(vocab)
    logits = torch.randn(num_rows, vocab).to(dtype)
    k = len(rows) if rows is not None else num_rows
    allowed = torch.rand(k, vocab) < 0.3
    allowed[:, -1] = True  # the ragged last word
    want = _reference(logits, allowed, rows if rows is not None else list(range(k)))
    bitmask = _pack(allowed)
    for impl in ("triton", "torch"):
        x = logits.to(device)
        idx = torch.tensor(rows, device=device) if rows is not None else None
        if impl == "triton":
            assert bitmask_unsupported_reason(x, bitmask.to(device), idx) is None
            apply_token_bitmask_(x, bitmask.to(device), idx)
        else:
            apply_token_bitmask_torch(x, bitmask.to(device), idx)
        assert torch.equal(x.cpu(), want), impl  # rows not named are untouched, allowed values kept


def test_dispatch_and_empty(device) -> None:
    x = torch.zeros(2, 40, device=device)
    bitmask = torch.zeros(0, 2, dtype=torch.int32, device=device)
    apply_token_bitmask_(x, bitmask, torch.empty(0, dtype=torch.long, device=device))
    assert torch.equal(x, torch.zeros(2, 40, device=device))
    with kernels.use_backend("torch"):
        one = torch.tensor([[1 << 3, 0]], dtype=torch.int32, device=device)  # only token 3
        apply_token_bitmask_(x, one)
    assert torch.isinf(x[0]).sum() == 39 and x[0, 3] == 0 and not torch.isinf(x[1]).any()


@pytest.mark.parametrize("dtype", DTYPES[:2])
def test_a_bitmask_narrower_than_the_vocabulary_bans_the_rest(force_triton, device, dtype) -> None:
    """A grammar over the tokenizer's ids (fewer than the LM head's padded rows): every column
    past the bitmask's 32 W bits becomes -inf, across several kernel chunks."""
    torch.manual_seed(0)
    vocab, covered, rows = 2 * BLOCK + 100, 70, [2, 0]
    logits = torch.randn(3, vocab).to(dtype)
    allowed = torch.zeros(len(rows), vocab, dtype=torch.bool)
    allowed[:, :covered] = torch.rand(len(rows), covered) < 0.5
    want = _reference(logits, allowed, rows)
    bitmask = _pack(allowed[:, :covered])  # 3 words: tokens 0..95, of which 70..95 are 0 bits
    assert bitmask.shape[1] * 32 < vocab
    for impl in ("triton", "torch"):
        x = logits.to(device)
        idx = torch.tensor(rows, device=device)
        if impl == "triton":
            apply_token_bitmask_(x, bitmask.to(device), idx)
        else:
            apply_token_bitmask_torch(x, bitmask.to(device), idx)
        assert torch.equal(x.cpu(), want), impl
        assert torch.isinf(x[0, covered:]).all() and torch.equal(x[1].cpu(), logits[1]), impl


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, [3, 0]])
def test_the_cpu_penalty_mask_equals_the_reference_and_the_boolean_fallback(monkeypatch, dtype, rows) -> None:
    """The CPU path (a +inf / -inf penalty built from the bits, one torch.minimum) bans exactly
    the 0 bits, keeps every allowed value (also +inf / -inf logits) bit for bit, and agrees with
    the boolean path other devices take; a non-contiguous bitmask works too."""
    from pdserve.kernels import bitmask as bitmask_module

    torch.manual_seed(7)
    vocab = 4096 + 40  # the bitmask covers 4,064 tokens: the rest is banned
    logits = torch.randn(4, vocab).to(dtype)
    logits[0, 5] = float("inf")
    logits[0, 6] = float("-inf")
    k = 2 if rows is not None else 4
    allowed = torch.rand(k, 4064) < 0.4
    allowed[0, 5] = allowed[0, 6] = True
    full = torch.zeros(k, vocab, dtype=torch.bool)
    full[:, :4064] = allowed
    want = _reference(logits, full, rows if rows is not None else list(range(k)))
    bitmask = _pack(allowed)
    idx = torch.tensor(rows) if rows is not None else None
    fast = logits.clone()
    apply_token_bitmask_torch(fast, bitmask, idx)
    assert torch.equal(fast, want)
    strided = torch.zeros(k, 2 * bitmask.shape[1], dtype=torch.int32)[:, ::2]
    strided.copy_(bitmask)
    assert not strided.is_contiguous()
    again = logits.clone()
    apply_token_bitmask_torch(again, strided, idx)
    assert torch.equal(again, want)
    monkeypatch.setattr(bitmask_module, "_mask_cpu_", lambda logits, bitmask, rows: False)
    slow = logits.clone()
    apply_token_bitmask_torch(slow, bitmask, idx)
    assert torch.equal(slow, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_penalty_mask_with_a_bitmask_wider_than_the_vocabulary(dtype) -> None:
    """32 W > V (the last word's high bits are past the vocabulary): the penalty is cut to V."""
    torch.manual_seed(3)
    logits = torch.randn(3, 37).to(dtype)
    allowed = torch.rand(3, 64) < 0.5
    want = _reference(logits, allowed[:, :37], [0, 1, 2])
    got = logits.clone()
    apply_token_bitmask_torch(got, _pack(allowed), None)
    assert torch.equal(got, want)


@pytest.mark.skipif(not CUDA, reason="pinned host memory read by a CUDA kernel")
def test_a_pinned_host_bitmask_and_int32_rows_are_read_in_place() -> None:
    """The model runner hands the kernel its pinned bitmask buffer (and int32 row indices in
    it) without a copy where kernels.host_operands_readable says the device can read them."""
    assert kernels.host_operands_readable(torch.device("cuda"))
    torch.manual_seed(3)
    allowed = torch.rand(2, BLOCK + 77) < 0.3
    logits = torch.randn(5, BLOCK + 77, device="cuda")
    want = _reference(logits, allowed.cuda(), [4, 1])
    bitmask = _pack(allowed).pin_memory()
    rows = torch.tensor([4, 1], dtype=torch.int32).pin_memory()
    assert bitmask_unsupported_reason(logits, bitmask, rows) is None
    with kernels.use_backend("triton"):
        apply_token_bitmask_(logits, bitmask, rows)
    assert torch.equal(logits, want)
