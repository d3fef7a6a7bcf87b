"""The pdserve:spec_decode_* families a speculative node exports (vLLM's meaning), and none
without speculation."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.config.speculative import SpeculativeConfig
from pdserve.spec_decode.metrics import spec_decode_metrics
from pdserve.spec_decode.scheduling import SpecScheduling


class _Collector:
    def __init__(self, spec: SpecScheduling | None) -> None:
        self.spec = spec

    def collect(self):  # type: ignore[no-untyped-def]
        yield from spec_decode_metrics(self.spec, ["node"], ["decode-0"])


def _scrape(spec: SpecScheduling | None) -> dict[tuple[str, str], float]:
    reg = CollectorRegistry()
    reg.register(_Collector(spec))  # type: ignore[arg-type]
    text = generate_latest(reg).decode()
    return {
        (s.name, s.labels.get("position", "")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_spec_decode_counters() -> None:
    spec = SpecScheduling(SpeculativeConfig(num_speculative_tokens=3), 64)
    spec.stats.observe(3, 2)
    spec.stats.observe(2, 0)
    spec.stats.observe(3, 3)
    got = _scrape(spec)
    assert got[("pdserve:spec_decode_num_drafts_total", "")] == 3
    assert got[("pdserve:spec_decode_num_draft_tokens_total", "")] == 8
    assert got[("pdserve:spec_decode_num_accepted_tokens_total", "")] == 5
    per_pos = [got[("pdserve:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(3)]
    assert per_pos == [2, 2, 1] and sum(per_pos) == 5
    assert spec.stats.mean_accepted_length == 1 + 5 / 3
    assert _scrape(None) == {}
