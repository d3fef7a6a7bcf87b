"""The speculative config in the P/D handshake: carried through the gRPC message, an n-gram or
draft-model decode node accepted with any prefill (it needs nothing from it: a draft model's KV
is rebuilt on the decode node), an MTP drafter (it reads the MTP KV prefill computes) refused on
a mismatch with both sides named; a draft model named by its checkpoint's content."""

from __future__ import annotations

import pytest
import yaml

from pdserve.config.speculative import SpeculativeConfig
from pdserve.kvtransfer.handshake import HandshakeError, HandshakeInfo, check_compat
from pdserve.kvtransfer.speculative_compat import SpecIdentity, spec_wire
from pdserve.rpc.kv_convert import handshake_from_pb, handshake_to_pb


def _info(spec: str) -> HandshakeInfo:
    return HandshakeInfo("tiny", "float32", 16, ("model.layers.0.self_attn",), 2, 16, speculative=spec)


NGRAM = spec_wire(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3))
DRAFT_A = SpecIdentity("draft_model", "draft_model[aaaa]", 3).to_wire()
DRAFT_B = SpecIdentity("draft_model", "draft_model[bbbb]", 3).to_wire()
# The MTP module's KV for the prompt comes from prefill.
MTP = SpecIdentity("mtp", "mtp[1]", 3).to_wire()
MTP_K5 = SpecIdentity("mtp", "mtp[1]", 5).to_wire()


def test_speculative_config_crosses_the_wire() -> None:
    assert NGRAM == "ngram|ngram[1,3]|4" and spec_wire(None) == ""
    got = handshake_from_pb(handshake_to_pb(_info(NGRAM)))
    assert got.speculative == NGRAM and got == _info(NGRAM)
    assert handshake_from_pb(handshake_to_pb(_info(""))).speculative == ""


@pytest.mark.parametrize(
    ("decode", "prefill"),
    [
        (NGRAM, ""),
        ("", NGRAM),
        (NGRAM, spec_wire(SpeculativeConfig())),
        (DRAFT_A, DRAFT_A),
        (DRAFT_A, DRAFT_B),
        (DRAFT_A, ""),
        (MTP, MTP),
    ],
)
def test_pairs_that_give_the_same_tokens_pass(decode: str, prefill: str) -> None:
    check_compat(_info(decode), _info(prefill))


@pytest.mark.parametrize(
    ("decode", "prefill"), [(MTP, MTP_K5), (MTP, ""), ("", MTP), (MTP, NGRAM), (MTP, DRAFT_A)]
)
def test_a_mismatch_that_changes_tokens_is_refused_naming_both(decode: str, prefill: str) -> None:
    with pytest.raises(HandshakeError, match="speculative") as e:
        check_compat(_info(decode), _info(prefill))
    assert (decode or "off") in str(e.value) and (prefill or "off") in str(e.value)


def test_cluster_file_setting(tmp_path) -> None:
    from pdserve.config.cluster import default_local_cluster
    from pdserve.config.cluster_file import load_cluster_config
    from pdserve.config.resolver import resolve_node_settings

    data = default_local_cluster(tmp_path, 9000).model_dump(mode="json", exclude_unset=True)
    data["nodes"][1]["speculative"] = {"method": "ngram", "num_speculative_tokens": 2}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    cluster = load_cluster_config(path)
    eng = resolve_node_settings(cluster, "decode-0", is_multimodal=lambda m: False).engine_config()
    assert eng.speculative == SpeculativeConfig(num_speculative_tokens=2)
    data["nodes"][1]["speculative"] = {"method": "eagle"}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(Exception, match=r"speculative.method 'eagle' .*supported: ngram, draft_model, mtp"):
        load_cluster_config(path)
    data["nodes"][1]["speculative"] = {"method": "mtp", "prompt_lookup_min": 2}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(Exception, match=r"prompt_lookup_min apply to method ngram only"):
        load_cluster_config(path)


def test_draft_identity_is_the_checkpoints_content(tiny_models, tmp_path) -> None:
    """Equal for a copy at another path; different for other weights of the same sizes."""
    import shutil

    from safetensors.torch import load_file, save_file

    a = tiny_models["llama"]
    b, c = tmp_path / "copy", tmp_path / "other"
    shutil.copytree(a, b)
    shutil.copytree(a, c)
    (f,) = c.glob("*.safetensors")
    tensors = load_file(str(f))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1.0
    save_file(tensors, str(f), metadata={"format": "pt"})

    def ident(d) -> str:
        return SpeculativeConfig(method="draft_model", model=str(d)).drafter_identity

    assert ident(a).startswith("draft_model[") and ident(a) == ident(b)
    assert ident(c) != ident(a) and f.stat().st_size == next(a.glob("*.safetensors")).stat().st_size
