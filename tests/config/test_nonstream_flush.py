"""router.nonstream_flush_ms / stream_flush_ms / pd_decode_leg: acted on, or refused at load."""

import pytest

from pdserve.config.cluster import RouterConfig


def test_nonstream_flush_over_half_the_inter_token_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="inter_token_timeout_s"):
        RouterConfig(nonstream_flush_ms=8000, inter_token_timeout_s=15.0)
    assert RouterConfig(nonstream_flush_ms=50).nonstream_flush_ms == 50


def test_stream_flush_over_half_the_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match=r"stream_flush_ms \(9000\).*inter_token_timeout_s"):
        RouterConfig(stream_flush_ms=9000, inter_token_timeout_s=15.0)
    assert RouterConfig().stream_flush_ms == 10
    assert RouterConfig(stream_flush_ms=0).stream_flush_ms == 0  # every step
    assert RouterConfig(stream_flush_ms=50).stream_flush_ms == 50


def test_pd_decode_leg_values() -> None:
    assert RouterConfig().pd_decode_leg == "with_prefill"
    assert RouterConfig(pd_decode_leg="after_prefill").pd_decode_leg == "after_prefill"
    with pytest.raises(ValueError, match="pd_decode_leg"):
        RouterConfig(pd_decode_leg="sometimes")


@pytest.mark.parametrize("value", ["multiplexed", "per_request"])
def test_the_removed_decode_stream_is_refused_naming_what_the_router_does_now(value: str) -> None:
    with pytest.raises(ValueError, match=rf"decode_stream \('{value}'\) was removed: .*Steps socket"):
        RouterConfig(decode_stream=value)
