"""The slot table and the batched apply: segmented and dense equal a per-row reference, LRU
eviction, stored scales; the scheduler's adapter limit; prefix-cache blocks never shared across
adapters; an unload waits for its requests."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.config.lora import LoRAConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.lora.apply import LoRASlots, LoRAStep
from pdserve.lora.manager import LoRAManager
from pdserve.lora.peft import LoRAAdapter, LoRAModuleWeights
from pdserve.models.linear import Linear
from tests.lora.adapters import make_adapter


def _weights(rank: int, i: int, o: int, scale: float) -> LoRAModuleWeights:
    return LoRAModuleWeights(torch.randn(rank, i), torch.randn(o, rank), rank, scale)


@pytest.mark.parametrize("mode", ["segmented", "dense"])
def test_apply_equals_per_row_reference(mode):
    torch.manual_seed(0)
    shards = [("q_proj", 0, 8), ("k_proj", 8, 4)]
    slots = LoRASlots(6, shards, max_loras=3, max_rank=4, dtype=torch.float32, device=torch.device("cpu"))
    per_slot = {
        0: [_weights(4, 6, 8, 2.0), None],
        1: [_weights(2, 6, 8, 0.5), _weights(3, 6, 4, 4.0)],
        2: [None, _weights(1, 6, 4, 1.5)],
    }
    for s, ws in per_slot.items():
        slots.set_slot(s, ws)
    chunks = [(0, 2), (-1, 1), (2, 3), (1, 1), (0, 1), (-1, 2)]  # slot 0 twice: not contiguous
    x = torch.randn(sum(n for _, n in chunks), 6)
    y0 = torch.randn(x.shape[0], 12)
    want = y0.clone()
    row = 0
    for s, n in chunks:
        for r in range(row, row + n):
            for (_, off, size), w in zip(shards, per_slot.get(s, [None, None]), strict=True):
                if w is not None:
                    want[r, off : off + size] += w.delta(x[r : r + 1])[0]
        row += n
    slots.step = LoRAStep.build(chunks, 3, mode, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(slots.add_delta(x, y0.clone()), want)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down_proj = Linear(6, 5, bias=False)


def _adapter(name: str, scale: float) -> LoRAAdapter:
    return LoRAAdapter(name, "/p", name.encode(), {"down_proj": _weights(2, 6, 5, scale)}, 2)


def test_lru_slots_and_stored_scale():
    torch.manual_seed(0)
    model = _Tiny()
    mgr = LoRAManager(model, LoRAConfig(max_loras=2, max_lora_rank=4), torch.float32, torch.device("cpu"))
    for i, name in enumerate("abc"):
        mgr.adapters[name] = _adapter(name, 1.0 + i)
    x = torch.randn(3, 6)
    for names in (["a", "b"], ["c"], ["a"], ["b", "c"]):
        mgr.begin_step([(n, 1) for n in names], torch.device("cpu"))
        got = model.down_proj(x[: len(names)])
        want = x[: len(names)] @ model.down_proj.weight.T
        want += torch.stack(
            [mgr.adapters[n].modules["down_proj"].delta(x[i : i + 1])[0] for i, n in enumerate(names)]
        )
        torch.testing.assert_close(got, want)
    # a, b loaded; c evicts a (LRU); a evicts b; b evicts c (a was used last but c is wanted)
    assert mgr.metrics.slot_loads == 5 and mgr.metrics.slot_evictions == 3
    assert set(mgr.slot_of) == {"b", "c"}
    mgr.begin_step([("", 3)], torch.device("cpu"))  # base only: no delta at all
    torch.testing.assert_close(model.down_proj(x), x @ model.down_proj.weight.T)


@pytest.fixture(scope="module")
def two_adapters(tiny_model_factory, tmp_path_factory):
    model_dir = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("lora-slots")
    kw = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    return model_dir, {n: str(make_adapter(model_dir, root / n, seed=i, **kw)) for i, n in enumerate("ab")}


def test_prefix_cache_not_shared_across_adapters(two_adapters, make_llm):
    model_dir, paths = two_adapters
    llm = make_llm(model_dir, kv_cache_memory_bytes=8 << 20, block_size=16, lora={"modules": paths})
    prompt = list(range(3, 70))
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    first = llm.generate([prompt], sp, lora_request="a")[0]
    cached = {
        name: llm.generate([prompt], sp, lora_request=name)[0].num_cached_tokens for name in ("a", "b", None)
    }
    assert first.num_cached_tokens == 0
    assert cached == {"a": 64, "b": 0, None: 0}


def test_scheduler_admits_at_most_max_loras_adapters(two_adapters, make_llm):
    model_dir, paths = two_adapters
    llm = make_llm(model_dir, kv_cache_memory_bytes=8 << 20, lora={"max_loras": 1, "modules": paths})
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i, name in enumerate(["a", "b", "a", ""]):
        eng.add_request(list(range(3, 20)), sp, f"r{i}", lora_name=name)
    seen = []
    while eng.has_unfinished():
        eng.step()
        seen.append({r.lora_name for r in eng.scheduler.running if r.lora_name})
    assert all(len(s) <= 1 for s in seen) and {"a"} in seen and {"b"} in seen


def test_unload_waits_for_requests_in_flight(two_adapters, make_llm):
    model_dir, paths = two_adapters
    llm = make_llm(model_dir, kv_cache_memory_bytes=8 << 20, lora={"modules": paths})
    eng = llm.engine
    eng.add_request(
        list(range(3, 20)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), "r", lora_name="a"
    )
    eng.step()
    assert eng.lora.unload("a", eng.scheduler.requests.values()) is False  # in flight: deferred
    with pytest.raises(Exception, match="being unloaded"):
        eng.add_request([5, 6, 7], SamplingParams(), "new", lora_name="a")
    finished = []
    while eng.has_unfinished():
        finished += [d for d in eng.step() if d.finish_reason]
    assert finished[0].finish_reason == "length"
    assert "a" not in eng.lora.manager.adapters
