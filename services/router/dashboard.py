"""The operator's page: ``/dashboard`` (plain HTML + fetch, no build step) over ``/dashboard/state``
(JSON, behind the API key when one is set: the page asks for it and sends it as a bearer token).

The state is the router's own view, refreshed every second by the page: each node's role,
stages, health and breaker, load, KV blocks used / total, KV transfers in flight (prefill: pushes,
decode: pulls) and prefix-cache hit rate since the node started (GetLoad), the blocks the prefix
index says it holds (policy cache_aware), and the router's recent leg failures.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from fastapi import FastAPI
from fastapi.params import Depends
from fastapi.responses import HTMLResponse, JSONResponse

RECENT_ERRORS = 50  # leg failures the page lists (newest first)


class RecentErrors:
    """The last ``RECENT_ERRORS`` leg failures: (unix time, role, code)."""

    def __init__(self) -> None:
        self.items: deque[tuple[float, str, str]] = deque(maxlen=RECENT_ERRORS)

    def add(self, role: str, code: str) -> None:
        self.items.append((time.time(), role, code))


def fleet_state(backend: Any) -> dict[str, Any]:
    """JSON of the nodes a NodePool-like backend routes to (an empty list for another backend)."""
    index = getattr(backend, "prefix_index", None)
    nodes = []
    for n in [*getattr(backend, "prefill", []), *getattr(backend, "decode", [])]:
        nodes.append(
            {
                "name": n.name,
                "role": n.role,
                "address": n.address,
                "stages": n.pp_size,
                "healthy": n.healthy,
                "in_rotation": n.available,
                "breaker": n.breaker.state.value,
                "in_flight": n.in_flight,
                "reported_load": n.reported_load,
                "kv_blocks_used": n.kv_blocks_used,
                "kv_blocks_total": n.num_blocks_total,
                "prefix_index_blocks": index.num_blocks(n.name) if index is not None else None,
                "transfers_in_flight": n.transfers_in_flight,
                "prefix_hit_rate": (
                    n.prefix_cache_hit_blocks / n.prefix_cache_queried_blocks
                    if n.prefix_cache_queried_blocks
                    else None
                ),
            }
        )
    errors = getattr(backend, "recent_errors", None)
    return {
        "policy": getattr(getattr(backend, "policy", None), "policy", ""),
        "nodes": nodes,
        "recent_errors": [
            {"time": t, "role": role, "code": code}
            for t, role, code in reversed(errors.items if errors else [])
        ],
    }


def install_dashboard_routes(app: FastAPI, backend: Any, guarded: list[Depends]) -> None:
    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(PAGE)

    @app.get("/dashboard/state", dependencies=guarded, include_in_schema=False)
    async def dashboard_state() -> JSONResponse:
        return JSONResponse(fleet_state(backend))


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>pdserve fleet</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}
th{background:#f3f3f3}.down{color:#b00}.up{color:#080}
.bar{display:inline-block;height:10px;background:#4a8;vertical-align:middle}
.barbox{display:inline-block;width:120px;height:10px;background:#eee;margin-right:6px}
</style></head>
<body>
<h1>pdserve fleet</h1>
<div id="status">loading...</div>
<table id="nodes"><thead><tr><th>node</th><th>role</th><th>stages</th><th>health</th><th>load</th>
<th>KV blocks used / total</th><th>prefix blocks indexed</th><th>transfers in flight</th>
<th>prefix-hit rate</th></tr></thead><tbody></tbody></table>
<h2>Recent leg failures</h2><ul id="errors"></ul>
<script>
let key = sessionStorage.getItem("pdserve_key") || "";
function cell(tr, text, cls) { const td = tr.insertCell(); td.textContent = text; if (cls) td.className = cls; return td; }
async function refresh() {
  const r = await fetch("dashboard/state", {headers: key ? {Authorization: "Bearer " + key} : {}});
  if (r.status === 401) {
    key = prompt("API key") || ""; sessionStorage.setItem("pdserve_key", key); return;
  }
  const s = await r.json();
  document.getElementById("status").textContent =
    "policy " + s.policy + ", " + s.nodes.length + " nodes, updated " + new Date().toLocaleTimeString();
  const body = document.querySelector("#nodes tbody"); body.innerHTML = "";
  for (const n of s.nodes) {
    const tr = body.insertRow(); tr.id = "node-" + n.name;
    cell(tr, n.name + " (" + n.address + ")"); cell(tr, n.role); cell(tr, n.stages);
    cell(tr, n.in_rotation ? "in rotation" : (n.healthy ? "breaker open" : "down"), n.in_rotation ? "up" : "down");
    cell(tr, n.in_flight + " in flight, " + n.reported_load + " reported");
    const kv = cell(tr, ""); const pct = n.kv_blocks_total ? n.kv_blocks_used / n.kv_blocks_total : 0;
    kv.innerHTML = '<span class="barbox"><span class="bar" style="width:' + Math.round(120 * pct) + 'px"></span></span>';
    kv.appendChild(document.createTextNode(n.kv_blocks_used + " / " + n.kv_blocks_total));
    kv.className = "kv";
    cell(tr, n.prefix_index_blocks === null ? "-" : n.prefix_index_blocks);
    cell(tr, n.transfers_in_flight);
    cell(tr, n.prefix_hit_rate === null ? "-" : (100 * n.prefix_hit_rate).toFixed(1) + " %");
  }
  const ul = document.getElementById("errors"); ul.innerHTML = "";
  for (const e of s.recent_errors) {
    const li = document.createElement("li");
    li.textContent = new Date(e.time * 1000).toLocaleTimeString() + " " + e.role + " " + e.code; ul.appendChild(li);
  }
}
refresh(); setInterval(refresh, 1000);
</script></body></html>
"""
