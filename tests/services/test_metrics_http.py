"""A node's /metrics server: on the address it is given, and behind the token when it has one."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from services.metrics_http import start_metrics_server


@pytest.mark.parametrize("token", [None, "m3trics"])
def test_metrics_answer_only_the_bearer_token_when_one_is_set(token: str | None) -> None:
    registry = CollectorRegistry()
    Counter("pdserve_probe", "a probe", registry=registry).inc(3)
    httpd, thread = start_metrics_server("127.0.0.1", 0, registry, token)
    try:
        host, port = httpd.server_address[:2]
        assert host == "127.0.0.1"
        url = f"http://127.0.0.1:{port}/metrics"
        plain = httpx.get(url, timeout=5)
        wrong = httpx.get(url, headers={"Authorization": "Bearer nope"}, timeout=5)
        right = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=5)
        if token is None:
            assert plain.status_code == 200 and "pdserve_probe_total 3.0" in plain.text
        else:
            for r in (plain, wrong):
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
                assert "pdserve_probe" not in r.text
            assert right.status_code == 200 and "pdserve_probe_total 3.0" in right.text
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
