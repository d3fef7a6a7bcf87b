"""``pdserve serve`` refuses a role it does not start, and a node started under another role than
its entry's, before loading anything."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from services.cli import app


def _cluster(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    nodes = [
        {"name": "p0", "role": "prefill", "grpc_port": 5101, "metrics_port": 5102},
        {"name": "d0", "role": "decode", "grpc_port": 5103, "metrics_port": 5104},
    ]
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"model": str(ckpt), "nodes": nodes}))
    return path


def test_an_unknown_role_is_refused(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["serve", "frontend", "--config", str(_cluster(tmp_path)), "--node", "p0"])
    assert r.exit_code == 2
    assert "role 'frontend' is not supported: use router, prefill, decode, encoder, colocated" in " ".join(
        r.output.replace("│", " ").split()
    )


def test_a_node_started_under_another_role_is_refused(tmp_path: Path) -> None:
    cfg = _cluster(tmp_path)
    r = CliRunner().invoke(app, ["serve", "decode", "--config", str(cfg), "--node", "p0"])
    assert r.exit_code == 2
    assert "node 'p0' has role prefill in" in " ".join(r.output.replace("│", " ").split())
