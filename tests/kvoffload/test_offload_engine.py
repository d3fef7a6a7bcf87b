"""The offload tier through the engine (LLM, CPU): a conversation evicted from a small device
cache comes back from host memory or disk, computes only the remainder, and answers as
transformers' greedy decoding does; a corrupt disk file is a counted miss."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.sampling_params import SamplingParams
from tests.engine.test_engine_parity import NEW_TOKENS, _reference, compare_greedy

BLOCK = 16
DEVICE_BLOCKS = 40  # 640 tokens: each evicting prompt takes most of it


def _conversation(
    llm: Any, vocab: int, corrupt_dir: Path | None = None, evict_tokens: int = NEW_TOKENS
) -> tuple[list[int], list[int], int]:
    """Turn 1 of A, three long prompts (``evict_tokens`` each), then A's turn 2. Returns (turn-2
    prompt, its tokens, the prefill tokens turn 2 computed)."""
    rng = random.Random(7)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    turn1 = [rng.randrange(vocab) for _ in range(150)]
    out1 = llm.generate({"prompt_token_ids": turn1}, greedy)[0].outputs[0].token_ids
    for _ in range(3):  # other long prompts: A's blocks are evicted from the device cache
        evict = SamplingParams(max_tokens=evict_tokens, temperature=0.0, ignore_eos=True)
        llm.generate({"prompt_token_ids": [rng.randrange(vocab) for _ in range(400)]}, evict)
    eng = llm.engine
    if corrupt_dir is not None:
        _wait_for_disk_writes(eng.offload.manager.disk)
        files = sorted(corrupt_dir.rglob("*.kvb"))
        assert files, "the disk tier wrote no file"
        for i, f in enumerate(files):  # every other file flipped, the rest truncated
            data = bytearray(f.read_bytes())
            if i % 2:
                data[-1] ^= 0xFF
                f.write_bytes(bytes(data))
            else:
                f.write_bytes(bytes(data[: len(data) // 2]))
    turn2 = turn1 + list(out1) + [rng.randrange(vocab) for _ in range(30)]
    before = eng.counters.num_prefill_tokens_total
    out2 = llm.generate({"prompt_token_ids": turn2}, greedy)[0].outputs[0].token_ids
    return turn2, list(out2), eng.counters.num_prefill_tokens_total - before


def _wait_for_disk_writes(disk: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while disk.num_pending_writes:
        assert time.monotonic() < deadline, "the disk tier's writer did not catch up"
        time.sleep(0.01)


def tier_settings(tier: str, tmp_path: Path) -> dict[str, Any]:
    """LLM settings of a small device cache over a 4 MiB host ("cpu") or disk ("disk") tier."""
    kv_offload: dict[str, Any] = (
        {"cpu_bytes": 1 << 22} if tier == "cpu" else {"disk_path": str(tmp_path), "disk_bytes": 1 << 22}
    )
    return {"block_size": BLOCK, "num_blocks_override": DEVICE_BLOCKS, "kv_offload": kv_offload}


def _check_answer(model_dir: Path, prompt: list[int], got: list[int]) -> None:
    compare_greedy([got], _reference(model_dir, [prompt]))


@pytest.mark.parametrize(
    ("tier", "async_scheduling"),
    [("cpu", False), ("disk", False), ("cpu", True)],
    ids=["cpu", "disk", "cpu-async"],
)
def test_evicted_conversation_hits_offload_tier(
    tier: str, async_scheduling: bool, tiny_models, make_llm, tmp_path
) -> None:
    model_dir = tiny_models["llama"]
    llm = make_llm(model_dir, **tier_settings(tier, tmp_path), async_scheduling=async_scheduling)
    eng = llm.engine
    assert eng.offload is not None
    vocab = eng.arch.vocab_size
    prompt, got, prefilled = _conversation(llm, vocab)
    mgr = eng.offload.manager
    # Turn 1's prompt and answer (150 + 64 tokens, the last one never computed) filled 13 blocks.
    hit = mgr.hit_tokens[tier]
    assert hit == 13 * BLOCK, mgr.hit_tokens
    assert mgr.hit_tokens["disk" if tier == "cpu" else "cpu"] == 0
    assert prefilled == len(prompt) - hit
    assert mgr.num_stored_blocks > 0 and sum(mgr.load_seconds_counts) >= 1
    _check_answer(model_dir, prompt, got)


def test_corrupt_disk_file_is_a_counted_miss(tiny_models, make_llm, tmp_path) -> None:
    model_dir = tiny_models["llama"]
    llm = make_llm(
        model_dir,
        block_size=BLOCK,
        num_blocks_override=DEVICE_BLOCKS,
        kv_offload={"disk_path": str(tmp_path), "disk_bytes": 1 << 22},
    )
    eng = llm.engine
    assert eng.offload is not None
    prompt, got, prefilled = _conversation(llm, eng.arch.vocab_size, corrupt_dir=tmp_path)
    mgr = eng.offload.manager
    assert mgr.hit_tokens == {"cpu": 0, "disk": 0}
    assert mgr.num_corrupt_blocks == 1  # the lookup stops at the first bad file
    # ... and the declined run is counted: the bad block and the 12 the disk index held after it
    assert eng.declined_prefix_tokens()["offload_unreadable"] == 13 * BLOCK
    assert prefilled == len(prompt)
    _check_answer(model_dir, prompt, got)


def test_full_tiers_evict_and_never_fail_a_request(tiny_models, make_llm, tmp_path) -> None:
    """A host tier of 3 blocks above a disk tier of 4: both evict all the time; every request
    still completes with transformers' answer."""
    model_dir = tiny_models["llama"]
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # tiny llama, fp32
    llm = make_llm(
        model_dir,
        block_size=BLOCK,
        num_blocks_override=DEVICE_BLOCKS,
        kv_offload={
            "cpu_bytes": 3 * block_bytes,
            "disk_path": str(tmp_path),
            "disk_bytes": 4 * (block_bytes + 48),
        },
    )
    eng = llm.engine
    assert eng.offload is not None
    prompt, got, prefilled = _conversation(llm, eng.arch.vocab_size)
    mgr = eng.offload.manager
    assert mgr.num_stored_blocks > 10 and mgr.host.used_bytes <= 3 * block_bytes
    assert mgr.disk is not None and mgr.disk.used_bytes <= 4 * (block_bytes + 48)
    assert prefilled == len(prompt) - sum(mgr.hit_tokens.values())
    _check_answer(model_dir, prompt, got)
