"""deploy/grafana/pdserve-fleet.json: valid JSON whose every pdserve: metric is one the code exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_metric_of_the_dashboard_exists() -> None:
    dash = json.loads((ROOT / "deploy/grafana/pdserve-fleet.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"pdserve:[a-z_]+", e)}
    source = "\n".join(p.read_text() for d in ("services", "pdserve") for p in (ROOT / d).rglob("*.py"))

    def defined(name: str) -> bool:
        # A counter's series end in _total, a histogram's in _bucket; node metrics are named without
        # the prefix (services/node_metrics.py adds "pdserve:"), the router's with it.
        bases = {name, re.sub(r"_(total|bucket)$", "", name)}
        return any(f'"{b}"' in source or f'"{b.removeprefix("pdserve:")}"' in source for b in bases)

    missing = sorted(m for m in used if not defined(m))
    assert used and not missing, missing
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
