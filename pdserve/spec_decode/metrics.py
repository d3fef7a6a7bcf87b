"""A speculative node's pdserve:spec_decode_* metric families, with vLLM's meaning (stats.py).

    pdserve:spec_decode_num_drafts_total                   counter
    pdserve:spec_decode_num_draft_tokens_total             counter
    pdserve:spec_decode_num_accepted_tokens_total          counter
    pdserve:spec_decode_num_accepted_tokens_per_pos_total  counter, label position = 0 .. k-1

Mean accepted length = 1 + rate(accepted) / rate(drafts); acceptance rate = accepted / draft tokens.
A node without speculation exports none of them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily

from pdserve.spec_decode.scheduling import SpecScheduling


def spec_decode_metrics(
    spec: SpecScheduling | None, labels: list[str], values: list[str]
) -> Iterator[CounterMetricFamily]:
    if spec is None:
        return
    st = spec.stats
    for name, doc, value in (
        ("num_drafts", "Verification steps of requests that carried draft tokens", st.num_drafts),
        ("num_draft_tokens", "Draft tokens verified", st.num_draft_tokens),
        ("num_accepted_tokens", "Draft tokens accepted", st.num_accepted_tokens),
    ):
        # prometheus_client appends _total to a counter's name
        c = CounterMetricFamily(f"pdserve:spec_decode_{name}", doc, labels=labels)
        c.add_metric(values, value)
        yield c
    per_pos = CounterMetricFamily(
        "pdserve:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at each position of a draft",
        labels=[*labels, "position"],
    )
    counts = st.accepted_per_pos + [0] * (spec.config.num_speculative_tokens - len(st.accepted_per_pos))
    for i, n in enumerate(counts):
        per_pos.add_metric([*values, str(i)], n)
    yield per_pos
