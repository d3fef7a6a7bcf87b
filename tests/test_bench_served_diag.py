"""bench/served_diag.py: means over a window from two /metrics scrapes (parsed by prometheus_client)."""

from __future__ import annotations

from bench.served_diag import moved, pd_diagnostics

ROUTER = (
    "pdserve:router_prefill_leg_seconds_count",
    "pdserve:router_prefill_leg_seconds_sum",
    'pdserve:router_decode_first_delta_seconds_count{path="disaggregated"}',
    'pdserve:router_decode_first_delta_seconds_sum{path="disaggregated"}',
    'pdserve:router_requests_by_path_total{path="disaggregated"}',
    'pdserve:router_requests_by_path_total{path="local"}',
)
NODE = tuple(
    f'pdserve:{m}{{node="d",role="decode"}}'
    for m in (
        "kv_pull_seconds_count",
        "kv_pull_seconds_sum",
        "engine_steps_total",
        "engine_step_sequences_total",
        "engine_step_decode_sequences_total",
        "engine_step_tokens_total",
    )
)
ROUTER_BEFORE, ROUTER_AFTER = ((2, 0.02, 2, 0.04, 2, 5), (6, 0.06, 6, 0.16, 6, 9))
NODE_BEFORE, NODE_AFTER = ((1, 0.5, 10, 10, 10, 10), (5, 0.54, 110, 410, 310, 1010))


def _snap(names: tuple[str, ...], values: tuple[float, ...]) -> dict:
    """What served_diag.scrape makes of a /metrics page holding these samples."""
    from prometheus_client.parser import text_string_to_metric_families

    text = "".join(f"{n} {v}\n" for n, v in zip(names, values, strict=True))
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_window_means_and_per_node_batches_come_from_the_differences() -> None:
    before = {"router": _snap(ROUTER, ROUTER_BEFORE), "decode-0": _snap(NODE, NODE_BEFORE)}
    after = {"router": _snap(ROUTER, ROUTER_AFTER), "decode-0": _snap(NODE, NODE_AFTER)}
    d = pd_diagnostics(before, after, window_s=2.0)
    assert d["prefill_leg_ms"] == 10.0  # 0.04 s over 4 legs
    assert d["decode_first_delta_ms"] == 30.0 and d["decode_first_delta_ms_by_path"]["local"] is None
    assert d["kv_pull_ms"] == 10.0  # 0.04 s over 4 pulls (the earlier 0.5 s pull is outside)
    assert d["disaggregated_share"] == 0.5  # 4 of 8 sequences in the window
    assert d["nodes"]["decode-0"] == {
        "steps_per_s": 50.0,
        "seqs_per_step": 4.0,
        "decode_seqs_per_step": 3.0,
        "tokens_per_step": 10.0,
    }
    # a failed scrape or a missing metric gives None ("-" in the table), never an error
    assert moved(None, after["router"], "pdserve:router_prefill_leg_seconds_count") is None
    assert moved(before["router"], after["router"], "pdserve:nothing_total") is None
    assert pd_diagnostics({"router": None}, {"router": None}, 1.0)["prefill_leg_ms"] is None
