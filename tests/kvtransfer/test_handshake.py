from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.kvtransfer.handshake import HandshakeError, HandshakeInfo, check_compat, compat_hash, new_epoch

LAYERS = tuple(f"model.layers.{i}" for i in range(4))


def info(**kw) -> HandshakeInfo:
    base = dict(
        model_id="tiny-llama",
        dtype="bfloat16",
        block_size=16,
        layer_names=LAYERS,
        num_kv_heads=2,
        head_dim=64,
    )
    base.update(kw)
    return HandshakeInfo(**base)


def test_hash_is_stable_and_sensitive():
    h = compat_hash("m", "bfloat16", 16, ["a", "b"], 2, 64, 1)
    assert h == compat_hash("m", "bfloat16", 16, ("a", "b"), 2, 64, 1)
    assert len(h) == 64 and int(h, 16) >= 0
    assert h != compat_hash("m", "float16", 16, ["a", "b"], 2, 64, 1)
    assert h != compat_hash("m", "bfloat16", 16, ["b", "a"], 2, 64, 1)


def test_epochs_differ():
    assert new_epoch() != new_epoch()


def test_compatible_passes_and_roundtrips():
    a, b = info(epoch=new_epoch()), info(epoch=new_epoch())
    check_compat(a, b)
    assert HandshakeInfo.from_dict(a.to_dict()) == a


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dtype", "float16"),
        ("block_size", 32),
        ("model_id", "other"),
        ("num_kv_heads", 4),
        ("head_dim", 128),
        ("layout_version", 2),
    ],
)
def test_mismatch_names_field(field, value):
    with pytest.raises(HandshakeError, match=field) as ei:
        check_compat(info(), info(**{field: value}))
    assert ei.value.field == field and ei.value.remote == value


def test_layer_names_mismatch():
    with pytest.raises(HandshakeError, match=r"layer_names.*index 2"):
        check_compat(info(), info(layer_names=(*LAYERS[:2], "x", LAYERS[3])))


def test_epoch_change_detected():
    remote = info(epoch="aaaa")
    check_compat(info(), remote, expected_remote_epoch="aaaa")
    with pytest.raises(HandshakeError, match="restarted"):
        check_compat(info(), replace(remote, epoch="bbbb"), expected_remote_epoch="aaaa")


def test_tampered_hash_on_wire():
    d = info().to_dict()
    d["compat_hash"] = "0" * 64
    with pytest.raises(HandshakeError, match="compat_hash"):
        HandshakeInfo.from_dict(d)


def test_kv_transport_mismatch_is_refused_and_unknown_is_not_checked():
    from pdserve.kvtransfer.handshake import HandshakeError, HandshakeInfo, check_compat

    base = dict(
        model_id="m", dtype="bfloat16", block_size=16, layer_names=("a", "b"), num_kv_heads=2, head_dim=8
    )
    tcp, ipc, old = (HandshakeInfo(**base, kv_transport=t) for t in ("tcp", "cuda_ipc", ""))
    with pytest.raises(HandshakeError, match="kv_transport") as e:
        check_compat(tcp, ipc)
    assert (e.value.local, e.value.remote) == ("tcp", "cuda_ipc")
    check_compat(tcp, old)  # a peer that does not send it
    check_compat(ipc, HandshakeInfo.from_dict(ipc.to_dict()))  # travels
    assert tcp.compat_hash == ipc.compat_hash  # not part of what the KV bytes mean


def test_kv_transport_travels_through_the_proto():
    from pdserve.rpc.kv_convert import handshake_from_pb, handshake_to_pb

    h = HandshakeInfo(
        model_id="m",
        dtype="float32",
        block_size=16,
        layer_names=("a",),
        num_kv_heads=1,
        head_dim=8,
        epoch="e",
        kv_transport="cuda_ipc",
    )
    assert handshake_from_pb(handshake_to_pb(h)) == h
