"""What a transfer moves per KV cache group, in one process: a prefill engine holds a request's
KV (a sliding-window or short-convolution group keeping only its window), a decode engine
allocates its blocks (the window only, for those groups), one push through the loopback backend
moves every group with its own ids, and the decode engine's tokens equal transformers'."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.config.choices import KvLoadFailurePolicy
from pdserve.config.engine import CacheConfig, EngineConfig
from pdserve.engine.kv_group_tables import NULL_BLOCK_ID
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.backend import LoopbackBackend
from pdserve.kvtransfer.connector import KVProducer
from pdserve.kvtransfer.group_transfer import kv_tensors_of
from pdserve.kvtransfer.params import RemoteDecodeParams, RemotePrefillParams
from pdserve.kvtransfer.runner_kv import kv_regions_of
from tests.engine.test_engine_parity import NEW_TOKENS, compare_greedy
from tests.models.test_lfm2 import reference_full_forward

BS = 16
PROMPT = 150


def _engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(
        EngineConfig(str(model_dir), cache=CacheConfig(block_size=BS)), load_tokenizer_=False, **kw
    )


def _backend(eng: LLMEngine) -> LoopbackBackend:
    be = LoopbackBackend()
    for t in kv_tensors_of(eng.runner):
        be.register(t.data_ptr(), t.numel() * t.element_size())
    return be


# (arch, window in tokens): the group after the first keeps positions [p - window + 1, p]
@pytest.mark.parametrize(("arch", "window"), [("gemma3", 32), ("lfm2", 3)])
def test_push_moves_each_group_with_its_own_ids(arch: str, window: int, tiny_model_factory) -> None:
    model_dir = tiny_model_factory(arch, num_layers=4, max_position_embeddings=1024)
    held: dict[str, list[int]] = {}
    p = _engine(model_dir, on_hold_for_transfer=lambda req, ids: held.setdefault(req.request_id, ids) is ids)
    d = _engine(model_dir)
    assert p.kv.groups is not None and d.kv.groups is not None
    rng = random.Random(7)
    prompt = [rng.randrange(p.arch.vocab_size) for _ in range(PROMPT)]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # the prefill leg
    p_req = p.add_request(prompt, first, "t-1", kv_transfer_params=RemoteDecodeParams("t-1"))
    while "t-1" not in held:
        p.step()
    src_groups = p.kv.group_block_ids_views("t-1")
    need = -(-PROMPT // BS)
    first_needed = (PROMPT - window + 1) // BS  # the window of decode's first position, 150
    (src_sliding,) = src_groups
    assert NULL_BLOCK_ID not in src_sliding[first_needed:need]  # prefill still holds the window

    d.add_request(
        prompt,
        greedy,
        "r",
        kv_transfer_params=RemotePrefillParams("t-1", "p:1"),
        output_token_ids=list(p_req.output_token_ids),
    )
    d.step()
    (spec,) = d.take_kv_loads()
    (dst_sliding,) = spec.group_block_ids
    assert list(dst_sliding[:first_needed]) == [NULL_BLOCK_ID] * first_needed  # the window only
    assert d.kv.groups.num_held_blocks("r") == (need - first_needed,)

    p_be, d_be = _backend(p), _backend(d)
    released: list[str] = []
    producer = KVProducer(
        p_be,
        kv_regions_of(p.runner),
        BS,
        released.append,
        layer_groups=[set(m.spec.layer_names) for m in p.kv.coordinator.managers],
    )
    producer.on_hold("t-1", held["t-1"], 1, list(p_req.output_token_ids), src_groups)
    res = producer.push(
        "t-1",
        spec.block_ids[:need],
        PROMPT,
        kv_regions_of(d.runner),
        d_be.session_id,
        dst_group_block_ids=[t[:need] for t in spec.group_block_ids],
    )
    assert res.ok, res.error
    p_t, d_t = kv_tensors_of(p.runner), kv_tensors_of(d.runner)
    group0 = need * p_t[0][0].numel() * p_t[0].element_size()
    group1 = (need - first_needed) * p_t[1][0].numel() * p_t[1].element_size()
    assert res.bytes == group0 + group1  # the full group's blocks and the window's, nothing else
    for i in range(need):
        assert torch.equal(d_t[0][spec.block_ids[i]], p_t[0][held["t-1"][i]])
    for i in range(first_needed, need):
        assert torch.equal(d_t[1][dst_sliding[i]], p_t[1][src_sliding[i]])
    assert released == ["t-1"]  # its one consumer reported: prefill frees it
    assert p.scheduler.release_held("t-1")
    assert p.kv.pool.num_used_blocks == 0 and p.kv.groups.num_used_blocks == (0,)

    d.finish_kv_load("r", True, KvLoadFailurePolicy.FAIL)
    ours = list(p_req.output_token_ids)  # prefill's first token, then decode's
    while d.has_unfinished():
        ours += [t for delta in d.step() if delta.request_id == "r" for t in delta.token_ids]
    assert compare_greedy([ours], reference_full_forward(model_dir, [prompt])) <= 1
    d.kv.process_deferred_frees()
    assert d.kv.pool.num_used_blocks == 0 and d.kv.groups.num_used_blocks == (0,)
    p.close()
    d.close()


def test_handshake_refuses_another_group_layout() -> None:
    """A node with a table per group and one whose groups share a table cannot trade blocks."""
    from pdserve.engine.kv_cache_groups import groups_of_model
    from pdserve.kvtransfer.group_transfer import kv_groups_wire, shared_table_reason
    from pdserve.kvtransfer.handshake import HandshakeError, HandshakeInfo, check_compat

    groups = groups_of_model(["a", "b"], ["sliding_attention", "full_attention"], 32, BS)
    own = kv_groups_wire(groups, own_tables=True)
    assert own == "full_attention:16:0:1;sliding_window:16:32:1" and kv_groups_wire(groups, False) == ""
    base = dict(
        model_id="m", dtype="float32", block_size=BS, layer_names=("a", "b"), num_kv_heads=2, head_dim=16
    )
    check_compat(HandshakeInfo(**base, kv_groups=own), HandshakeInfo(**base, kv_groups=own))
    with pytest.raises(HandshakeError, match="kv_groups"):
        check_compat(HandshakeInfo(**base, kv_groups=own), HandshakeInfo(**base))
    assert shared_table_reason(True, True, "tcp") == "kv_checksum digests one KV tensor"
    assert shared_table_reason(True, False, "cuda_ipc") is not None
    assert shared_table_reason(True, False, "tcp") is None and shared_table_reason(False, True, "tcp") is None
