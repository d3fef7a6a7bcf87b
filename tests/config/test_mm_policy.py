"""Nodes act on the derived mm flags: every role x ec_role x (text-only / multimodal) case,
for items with and without their tensors."""

from __future__ import annotations

import pytest

from pdserve.config.cluster import ClusterConfig
from pdserve.config.resolver import check_mm_items_allowed, resolve_node_settings
from pdserve.errors import InvalidRequestError


def _cluster(with_encoder: bool) -> ClusterConfig:
    roles = [("p0", "prefill"), ("d0", "decode"), ("c0", "colocated")] + (
        [("e0", "encoder")] if with_encoder else []
    )
    nodes = [
        {"name": n, "role": r, "grpc_port": 51000 + i, "metrics_port": 52000 + i}
        for i, (n, r) in enumerate(roles)
    ]
    redis = {"redis_url": "redis://127.0.0.1:6379/0"} if with_encoder else {}
    return ClusterConfig.from_dict({"model": "/ckpt/m", "nodes": nodes, **redis})


# (node, multimodal, encoder present) -> (role, ec_role, accept, allow_missing)
TABLE = [
    ("p0", False, False, ("prefill", None, False, False)),
    ("d0", False, False, ("decode", None, False, False)),
    ("c0", False, False, ("colocated", None, False, False)),
    ("p0", True, False, ("prefill", None, False, False)),  # computes its own embeddings
    ("d0", True, False, ("decode", None, True, True)),  # KV consumer of a multimodal model
    ("c0", True, False, ("colocated", None, True, True)),
    ("p0", True, True, ("prefill", "ec_consumer", True, True)),
    ("d0", True, True, ("decode", None, True, True)),
    ("c0", True, True, ("colocated", "ec_consumer", True, True)),
    ("e0", True, True, ("encoder", "ec_producer", False, False)),
]


@pytest.mark.parametrize(("node", "mm", "encoder", "want"), TABLE)
def test_derived_flags_and_what_the_node_accepts(node: str, mm: bool, encoder: bool, want: tuple) -> None:
    r = resolve_node_settings(_cluster(encoder), node, is_multimodal=lambda _m: mm)
    assert (r.role, r.ec_role, r.accept_mm_embeds, r.allow_missing_mm_embeds) == want
    check_mm_items_allowed(r, [])  # text-only requests are always fine
    for items in ([True], [True, False], [False]):
        allowed = want[2] and (all(items) or want[3])
        if allowed:
            check_mm_items_allowed(r, items)
        else:
            with pytest.raises(InvalidRequestError, match=r"accept_mm_embeds|allow_missing_mm_embeds") as e:
                check_mm_items_allowed(r, items)
            assert node in str(e.value)
