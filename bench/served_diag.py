"""bench/served.py's P/D diagnostics: the router's and the nodes' /metrics scraped around each
measured window, turned into means (prefill leg, decode leg's first delta, KV pull) and per node
engine steps/s and batch per step; the in-process engine's counters for its row. A metric that
is missing prints as "-" (a diagnostic is never the reason a measurement fails).
"""

from __future__ import annotations

from typing import Any

from bench._common import log


def engine_counters(engine: Any) -> tuple[int, int, int, int]:
    """An in-process engine's (steps, sequences, decode sequences, tokens) so far."""
    return (
        engine.counters.num_steps_total,
        engine.counters.num_step_seqs_total,
        engine.counters.num_step_decode_seqs_total,
        engine.counters.num_step_tokens_total,
    )


Snapshot = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Snapshot | None:
    """Every sample of a /metrics page, or None when it cannot be read or parsed."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url, timeout=5.0).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }
    except Exception as e:  # a diagnostic: never the reason a measurement fails
        log(f"  scrape of {url} failed: {e!r}")
        return None


def moved(before: Snapshot | None, after: Snapshot | None, name: str, **labels: str) -> float | None:
    """The change of the samples called ``name`` (summed over those carrying ``labels``) between
    two scrapes; None when either scrape failed or the metric is not there."""
    if before is None or after is None:
        return None

    def total(snap: Snapshot) -> float | None:
        vals = [
            v
            for (n, ls), v in snap.items()
            if n == name and all(dict(ls).get(k) == x for k, x in labels.items())
        ]
        return sum(vals) if vals else None

    a, b = total(after), total(before)
    return None if a is None else a - (b or 0.0)


def _ratio(num: float | None, den: float | None, scale: float = 1.0, nd: int = 2) -> float | None:
    return round(scale * num / den, nd) if num is not None and den else None


def step_stats(
    steps: float | None, seqs: float | None, dec: float | None, toks: float | None, window_s: float
) -> dict:
    return {
        "steps_per_s": _ratio(steps, window_s, nd=1),
        "seqs_per_step": _ratio(seqs, steps),
        "decode_seqs_per_step": _ratio(dec, steps),
        "tokens_per_step": _ratio(toks, steps, nd=1),
    }


def path_share(before: Snapshot | None, after: Snapshot | None) -> float | None:
    """Of the sequences routed in the window, the share prefilled on a prefill node (the rest were
    prefilled on the decode node: short, seen there before, or every prefill node failed)."""
    by = {
        p: moved(before, after, "pdserve:router_requests_by_path_total", path=p)
        for p in ("disaggregated", "local", "local_fallback")
    }
    if all(v is None for v in by.values()):
        return None
    return _ratio(by["disaggregated"] or 0.0, sum(v or 0.0 for v in by.values()))


def pd_diagnostics(
    before: dict[str, Snapshot | None], after: dict[str, Snapshot | None], window_s: float
) -> dict:
    """Means over one measured window from the router's (key "router") and the nodes' scrapes."""

    def mean_ms(snaps: list[str], hist: str, **labels: str) -> float | None:
        n = [moved(before[k], after[k], hist + "_count", **labels) for k in snaps]
        s = [moved(before[k], after[k], hist + "_sum", **labels) for k in snaps]
        pairs = [(a, b) for a, b in zip(s, n, strict=True) if a is not None and b is not None]
        return _ratio(sum(a for a, _ in pairs), sum(b for _, b in pairs), 1e3) if pairs else None

    nodes = [k for k in before if k != "router"]
    first = "pdserve:router_decode_first_delta_seconds"
    out: dict[str, Any] = {
        "prefill_leg_ms": mean_ms(["router"], "pdserve:router_prefill_leg_seconds"),
        "decode_first_delta_ms": mean_ms(["router"], first),
        "decode_first_delta_ms_by_path": {
            p: mean_ms(["router"], first, path=p) for p in ("disaggregated", "local")
        },
        "kv_pull_ms": mean_ms(nodes, "pdserve:kv_pull_seconds"),
        "disaggregated_share": path_share(before["router"], after["router"]),
        "window_s": round(window_s, 3),
        "nodes": {},
    }
    for k in nodes:
        b, a = before[k], after[k]
        out["nodes"][k] = step_stats(
            *(
                moved(b, a, f"pdserve:{m}_total")
                for m in (
                    "engine_steps",
                    "engine_step_sequences",
                    "engine_step_decode_sequences",
                    "engine_step_tokens",
                )
            ),
            window_s,
        )
    return out


def print_diagnostics(rows: list[dict]) -> None:
    """Where a request's time goes, per (variant, level): the router's mean prefill leg, decode
    leg open -> first delta and decode's KV pull; per node steps/s and the batch per step."""
    diag = [r for r in rows if r.get("diagnostics")]
    if not diag:
        return

    def f(x: Any, spec: str) -> str:
        return format(x, spec) if x is not None else "-"

    hdr = (
        f"{'P/D diagnostics':<32}{'conc':>5}{'P/D share':>10}{'prefill ms':>11}{'1st delta ms':>13}"
        f"{'KV pull ms':>11}  "
        f"{'node':<12}{'steps/s':>9}{'seqs/step':>10}{'dec/step':>9}{'tok/step':>10}"
    )
    print("\n" + hdr)
    print("-" * len(hdr))
    for r in sorted(diag, key=lambda r: (r["concurrency"], r["variant"] != "in-process", r["variant"])):
        d = r["diagnostics"]
        lead = (
            f"{r['variant']:<32}{r['concurrency']:>5}{f(d.get('disaggregated_share'), '.2f'):>10}"
            f"{f(d.get('prefill_leg_ms'), '.1f'):>11}"
            f"{f(d.get('decode_first_delta_ms'), '.1f'):>13}{f(d.get('kv_pull_ms'), '.1f'):>11}  "
        )
        for i, (node, st) in enumerate(sorted(d.get("nodes", {}).items()) or [("-", {})]):
            print(
                (lead if i == 0 else " " * len(lead))
                + f"{node:<12}{f(st.get('steps_per_s'), '.1f'):>9}{f(st.get('seqs_per_step'), '.2f'):>10}"
                f"{f(st.get('decode_seqs_per_step'), '.2f'):>9}{f(st.get('tokens_per_step'), '.1f'):>10}"
            )
    print(
        "means over each measured window (router and node /metrics before and after it): P/D share = "
        "sequences prefilled on a prefill node / all (router_requests_by_path), prefill ms = "
        "router_prefill_leg_seconds, 1st delta ms = router_decode_first_delta_seconds (P/D: decode's "
        "KV pull + first step), KV pull ms = kv_pull_seconds on decode; per node engine steps/s and "
        "sequences / decode sequences / tokens per step",
        flush=True,
    )
