"""Generated stubs are never hand-edited: regenerating them gives no diff."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from pdserve.engine.outputs import GenerationDelta, TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError
from pdserve.rpc import convert
from pdserve.rpc import node_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]


def test_regenerating_stubs_gives_no_diff(tmp_path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            str(ROOT / "proto/pdserve/rpc/node.proto"),
        ],
        check=True,
    )
    for name in ("node_pb2.py", "node_pb2_grpc.py", "node_pb2.pyi"):
        fresh = (tmp_path / "pdserve/rpc" / name).read_text()
        committed = (ROOT / "pdserve/rpc" / name).read_text()
        assert fresh == committed, (
            f"pdserve/rpc/{name} differs from a fresh protoc run: run scripts/gen_proto.sh"
        )


def _pyproject_requirements() -> dict[str, str]:
    """Requirement name -> its version specifier, from every list in pyproject.toml."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = list(data["project"]["dependencies"])
    for extra in data["project"]["optional-dependencies"].values():
        reqs += extra
    out = {}
    for req in reqs:
        m = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*(.*)$", req)
        assert m is not None, req
        out[m.group(1).lower()] = m.group(2).replace(" ", "")
    return out


def test_generator_pins_match_the_committed_stubs() -> None:
    """The stubs' headers name the grpcio-tools and protoc versions that wrote them; the generator
    is pinned to exactly that version, and the runtime floors are at least as new (the stubs
    refuse an older grpcio / protobuf at import). A new generator version means: change the pin,
    run scripts/gen_proto.sh, commit both."""
    grpc_stub = (ROOT / "pdserve/rpc/node_pb2_grpc.py").read_text()
    pb_stub = (ROOT / "pdserve/rpc/node_pb2.py").read_text()
    m = re.search(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_stub, re.M)
    assert m is not None
    tools_version = m.group(1)
    m = re.search(r"^# Protobuf Python Version: ([0-9.]+)", pb_stub, re.M)
    assert m is not None
    protoc_version = m.group(1)

    reqs = _pyproject_requirements()
    assert reqs["grpcio-tools"] == f"=={tools_version}", reqs["grpcio-tools"]
    assert reqs["grpcio"] == f">={tools_version}", reqs["grpcio"]
    protobuf_floor = re.search(r">=([0-9.]+)", reqs["protobuf"])
    assert protobuf_floor is not None and protobuf_floor.group(1) == protoc_version, reqs["protobuf"]
    # and what is installed is what the pins say (a stale virtualenv gives a diff above)
    assert importlib.metadata.version("grpcio-tools") == tools_version


def test_sampling_and_delta_round_trip() -> None:
    sp = SamplingParams(temperature=0.5, top_k=3, seed=9, max_tokens=7, stop=["x"], logprobs=2, min_p=0.1)
    assert convert.sampling_from_pb(convert.sampling_to_pb(sp)) == sp
    ids_only = SamplingParams(max_tokens=3, detokenize=False)  # the router makes the text
    assert convert.sampling_to_pb(ids_only).skip_detokenize
    assert convert.sampling_from_pb(convert.sampling_to_pb(ids_only)) == ids_only
    assert convert.sampling_from_pb(convert.sampling_to_pb(SamplingParams())).detokenize
    d = GenerationDelta(
        "r", [1, 2], "ab", [TokenLogprob(1, -0.5, ((1, -0.5), (4, -1.0)))], "stop", "x", 3, 2, 1
    )
    assert convert.delta_from_pb(convert.delta_to_pb(d)) == d


@pytest.mark.parametrize(
    "d",
    [
        GenerationDelta("run", [5], "t", num_prompt_tokens=4, num_output_tokens=1),
        GenerationDelta("lp", [1, 2], "ab", [TokenLogprob(1, -0.5, ((1, -0.5),))], "stop", "</s>", 3, 2, 1),
        GenerationDelta("tok", [7], "", None, "stop", 7, 3, 2, 1),
        GenerationDelta("digits", [8], "", None, "stop", "7", 3, 2, 1),
        GenerationDelta("err", [], "", finish_reason="error", error="boom", num_prompt_tokens=2),
        GenerationDelta("none-lp", [3], "c", [], "length", None, 1, 1, 0),
        GenerationDelta(
            "plp",
            [9],
            "z",
            None,
            num_prompt_tokens=2,
            num_output_tokens=1,
            prompt_logprobs=[TokenLogprob(8, -1.25, ())],
        ),
    ],
)
def test_a_delta_added_to_a_step_batch_round_trips(d: GenerationDelta) -> None:
    """The Steps writer's path (only the set fields passed) loses nothing, and gives the same
    bytes as the one-message conversion."""
    batch = pb.StepBatch()
    convert.add_delta_pb(batch.deltas, d)
    convert.add_delta_pb(batch.deltas, GenerationDelta("other", [1], "x", num_prompt_tokens=1))
    got = pb.StepBatch.FromString(batch.SerializeToString())
    assert convert.delta_from_pb(got.deltas[0]) == d
    assert got.deltas[0].SerializeToString() == convert.delta_to_pb(d).SerializeToString()
    assert got.deltas[1].request_id == "other"


def test_tensor_checks() -> None:
    t = torch.randn(3, 4, dtype=torch.bfloat16)
    assert torch.equal(convert.tensor_from_pb(convert.tensor_to_pb(t)), t)
    m = convert.tensor_to_pb(t)
    m.data = m.data[:-2]
    try:
        convert.tensor_from_pb(m)
        raise AssertionError("short data accepted")
    except InvalidRequestError as e:
        assert "bytes" in str(e)
    bad = convert.tensor_to_pb(torch.tensor([1.0, float("nan")]))
    try:
        convert.tensor_from_pb(bad)
        raise AssertionError("NaN accepted")
    except InvalidRequestError as e:
        assert "NaN" in str(e)
